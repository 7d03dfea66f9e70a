"""saferun: a PyTorch training loop that gets the mode and gradient discipline right by default."""

from .callbacks import Callback, Control, StepOutput, TrainerView
from .config import Config, TrainerConfig, load_config
from .errors import ConfigError, SaferunError
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Callback", "Config", "ConfigError", "Control", "SaferunError", "StepOutput", "Trainer",
    "TrainerConfig", "TrainerView", "load_config", "__version__",
]
