"""The settings of the loop's optional parts (`trainer.ema`), kept beside the code that reads
them; `config.TrainerConfig` holds them as nodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


@dataclass
class EmaConfig:
    """trainer.ema: an exponential moving average of the weights (off by default), validated beside
    the raw weights (val_ema/...), checkpointed, and exported as <run_dir>/model_ema.pt."""

    decay: Optional[float] = None
    """ema = decay * ema + (1 - decay) * weights after each optimizer step (e.g. 0.999; null: off)."""
    use_buffers: bool = True
    """Average floating buffers (BatchNorm statistics) too; false: copy them. Integers are copied."""

    def __post_init__(self) -> None:
        if isinstance(self.decay, (int, float)) and not 0.0 < self.decay < 1.0:
            raise ConfigError(f"trainer.ema.decay must be in (0, 1), e.g. 0.999, or null; got {self.decay}.")
