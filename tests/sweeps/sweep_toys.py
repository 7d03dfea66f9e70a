"""Importable by the jobs of the sweep tests (PYTHONPATH): a callback that sends its own process
a real signal at chosen steps, as a scheduler would."""

import os
import signal
from typing import Any, Optional, Sequence

import saferun


class SignalAt(saferun.Callback):
    """Sends `signum` (a name, e.g. SIGUSR2) to this process after each step in `steps`; with
    `once_file`, only while that file does not exist (it is created), so a rerun is not hit."""

    def __init__(self, steps: Sequence[int], signum: str = "SIGUSR2",
                 once_file: Optional[str] = None) -> None:
        self.steps, self.signum, self.once_file = set(steps), signum, once_file

    def on_train_step_end(self, view: Any, output: Any) -> None:
        if view.step not in self.steps or (self.once_file and os.path.exists(self.once_file)):
            return
        if self.once_file:
            open(self.once_file, "w").close()
        os.kill(os.getpid(), signal.Signals[self.signum])
