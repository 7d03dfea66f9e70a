"""Print the catch table: each planted mistake of tests/mistakes.py, whether saferun caught it
(its message holds the words the corpus expects), and the message's first line; then the clean
runs (README's quickstart, the shipped recipes), where any saferun warning or error is a false
alarm.

    python tools/catch_table.py              # markdown, as in docs/catch_table.md (~1-2 min)
    python tools/catch_table.py --no-charlm  # leave out the slowest clean run
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import saferun  # noqa: E402
from mistakes import CORPUS, catch, caught  # noqa: E402


class Quickstart(saferun.Trainer):
    """README's quickstart."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2))

    def build_datasets(self):  # type: ignore[no-untyped-def]
        x = torch.randn(1024, 8)
        y = (x.sum(dim=1) > 0).long()
        return (torch.utils.data.TensorDataset(x[:900], y[:900]),
                torch.utils.data.TensorDataset(x[900:], y[900:]))

    def training_step(self, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def validation_step(self, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.model(x)
        return {"loss": nn.functional.cross_entropy(logits, y),
                "acc": (logits.argmax(1) == y).float().mean()}


def clean_run(name: str) -> list[str]:
    """Run a clean job; return saferun's warnings and errors (false alarms)."""
    tmp = tempfile.mkdtemp(prefix="saferun-clean-")
    alarms: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: alarms.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("saferun").addHandler(handler)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # a recipe's after_fit prints a sample
            _clean_fit(name, tmp)
    except saferun.SaferunError as e:
        alarms.append(str(e))
    finally:
        logging.getLogger("saferun").removeHandler(handler)
    return alarms


def _clean_fit(name: str, tmp: str) -> None:
    from hydra.utils import get_class

    from saferun.cli import compose_config

    if name == "quickstart":
        Quickstart({"trainer": {"max_steps": 500, "batch_size": 64, "log_every_n_steps": 50,
                                "run_dir": tmp, "progress_bar": False},
                    "optim": {"_target_": "torch.optim.AdamW", "lr": 3e-3}, "logger": {}}).fit()
        return
    cfg = compose_config([f"recipe={name}", "debug=fast", "trainer.progress_bar=false",
                          f"trainer.run_dir={tmp}", "logger={}"])
    task = dict(cfg.task)
    get_class(task.pop("_target_"))(cfg, **task).fit()


def first_line(message: str | None, width: int = 150) -> str:
    line = (message or "(nothing said)").strip().splitlines()[0].replace("|", "\\|")
    return line if len(line) <= width else line[: width - 3] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-charlm", action="store_true")
    args = parser.parse_args()
    logging.getLogger("saferun").setLevel(logging.WARNING)
    logging.getLogger("saferun").propagate = False
    print("| mistake | where caught | caught | first line of the message |")
    print("|---|---|---|---|")
    missed = 0
    for m in CORPUS:
        message = catch(m)
        ok = caught(m, message)
        missed += not ok
        print(f"| {m.name} | {m.how} | {'yes' if ok else 'NO'} | {first_line(message)} |")
    print("\n| clean run | false alarms | seconds |")
    print("|---|---|---|")
    alarmed = 0
    for name in ["quickstart", "digits", "tabular"] + ([] if args.no_charlm else ["charlm"]):
        start = time.time()
        alarms = clean_run(name)
        alarmed += bool(alarms)
        said = "none" if not alarms else f"{len(alarms)}: {first_line(alarms[0])}"
        print(f"| {name} (debug=fast)" if name != "quickstart" else "| README quickstart",
              f"| {said} | {time.time() - start:.0f} |")
    print(f"\n{len(CORPUS) - missed} of {len(CORPUS)} mistakes caught; "
          f"{alarmed} clean runs with a false alarm.")
    raise SystemExit(1 if missed or alarmed else 0)


if __name__ == "__main__":
    main()
