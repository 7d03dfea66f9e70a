"""The planted-bug corpus: one small Trainer per common user mistake (issue 16), with how
saferun must catch it and words its message must hold. Used by tests/guards/test_mistakes.py
and by tools/catch_table.py (which prints the catch table of docs/catch_table.md)."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import saferun
from toys import ToyTrainer, make_classification, toy_config


# ------------------------------------------------------------------ errors raised in user code

class NumpyData(Dataset):
    """A dataset of NumPy arrays: float64 features reach a float32 model."""

    def __init__(self) -> None:
        x, y = make_classification(128)
        self.x, self.y = x.numpy().astype(np.float64), y.numpy()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]


class Float64Data(ToyTrainer):
    def build_datasets(self) -> tuple[Dataset, None]:
        return NumpyData(), None


class MakesTensorElsewhere(nn.Module):
    """Creates a tensor in forward without device=: on a GPU it lands on the CPU. On a CPU-only
    machine the same mistake is planted with the meta device (the error has the same form)."""

    def __init__(self, where: str = "meta") -> None:
        super().__init__()
        self.fc, self.where = nn.Linear(8, 3), where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.zeros(3, device=self.where)  # the planted bug


class DeviceMismatch(ToyTrainer):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), MakesTensorElsewhere())


class ShapeMismatch(ToyTrainer):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(12, 3))  # 16 -> 12: the bug


class LastBatchOfOne(ToyTrainer):
    n_train = 65  # batch_size 32: batches of 32, 32 and 1


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.fc(x))  # sigmoid saves its output for backward
        y.mul_(2)  # the planted bug: changes that saved output in place
        return y


class InPlaceAutograd(ToyTrainer):
    def build_model(self) -> nn.Module:
        return InPlace()


class NanInInput(ToyTrainer):
    def build_datasets(self) -> tuple[Dataset, None]:
        x, y = make_classification(128)
        x[[5, 77], 3] = float("nan")  # missing values read as NaN
        return TensorDataset(x, y), None


class ForgotReturn(ToyTrainer):
    def training_step(self, batch: Any) -> Any:
        loss = super().training_step(batch)  # noqa: F841  (the planted bug: no return)


class ItemLoss(ToyTrainer):
    def training_step(self, batch: Any) -> Any:
        return super().training_step(batch).item()


class ValidationDtype(ToyTrainer):
    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.cross_entropy(self.model(x.double()), y)}


# ------------------------------------------------------------------ found at setup

class FrozenByHand(ToyTrainer):
    def build_model(self) -> nn.Module:
        model = super().build_model()
        model.backbone.requires_grad_(False)  # frozen by hand, not in trainer.frozen_modules
        return model


# ------------------------------------------------------------------ found by saferun check

class TrainValOverlap(ToyTrainer):
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        x, y = make_classification(160)
        return TensorDataset(x[:128], y[:128]), TensorDataset(x[100:], y[100:])  # 28 shared


class LoudHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        nn.init.normal_(self.head.weight, std=30.0)  # the planted bug: huge initial logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class MisscaledInit(ToyTrainer):
    def build_model(self) -> nn.Module:
        return LoudHead()


class MixesSamples(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, 16)
        h = h.t().reshape(h.shape[0], -1)  # the planted bug: a transpose mixes the samples
        return self.fc2(torch.relu(h))


class BatchMixing(ToyTrainer):
    def build_model(self) -> nn.Module:
        return MixesSamples()


class IgnoresInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.ones_like(x))  # the planted bug: the input is overwritten


class InputIgnored(ToyTrainer):
    def build_model(self) -> nn.Module:
        return IgnoresInput()


# ------------------------------------------------------------------ the corpus

@dataclass
class Mistake:
    name: str
    trainer: type
    how: str  # fit, setup, check:<check name>, config
    expect: list[str]  # words the message must hold
    config: dict[str, Any] = field(default_factory=dict)


CORPUS = [
    Mistake("NumPy float64 batch into a float32 model", Float64Data, "fit",
            ["batch field batch[0] is torch.float64", "convert in the dataset", "'backbone.0' (Linear)"]),
    Mistake("tensor created in forward without device=", DeviceMismatch, "fit",
            ["different devices", "'1' (MakesTensorElsewhere)", "device=x.device", "mistakes.py"]),
    Mistake("shape mismatch between layers", ShapeMismatch, "fit",
            ["shape mismatch in module '2' (Linear)", "input[0]: float32 (32, 16)"]),
    Mistake("BatchNorm gets a last batch of one sample", LastBatchOfOne, "fit",
            ["'backbone.1' (BatchNorm1d)", "trainer.drop_last=true", "65 % 32 == 1", "step 3"]),
    Mistake("BatchNorm last batch of one, predicted at setup", LastBatchOfOne, "setup",
            ["65 samples % batch_size 32 == 1", "backbone.1", "trainer.drop_last=true"]),
    Mistake("in-place op on a tensor autograd saved", InPlaceAutograd, "fit",
            ["in-place operation", "y = torch.sigmoid(self.fc(x))", "out of place"]),
    Mistake("NaN already in the input data", NanInInput, "fit",
            ["input data already holds NaN/Inf", "batch[0] in dataset samples", "not at fault"]),
    Mistake("NaN in the input, with anomaly replay on", NanInInput, "fit",
            ["input data already holds NaN/Inf", "batch[0] in dataset samples"],
            {"guards": {"anomaly_replay": True}}),
    Mistake("training_step forgets `return`", ForgotReturn, "fit", ["got None", "forget to `return loss`"]),
    Mistake("training_step returns loss.item()", ItemLoss, "fit",
            ["a Python float", "Return the loss tensor itself"]),
    Mistake("validation_step casts to float64", ValidationDtype, "fit",
            ["validation_step failed", "dtype mismatch in module 'backbone.0' (Linear)"]),
    Mistake("submodule frozen by hand, BatchNorm drifts", FrozenByHand, "setup",
            ["module 'backbone'", "frozen by hand", "trainer.frozen_modules=[backbone]"]),
    Mistake("validation samples also in training", TrainValOverlap, "check:data overlap",
            ["28 validation samples are identical", "val 0 = train 100"]),
    Mistake("mis-scaled output layer at initialisation", MisscaledInit, "check:initial loss",
            ["far above ln(3)"]),
    Mistake("a transpose mixes samples of a batch", BatchMixing, "check:batch independence",
            ["depends on the input of samples", "mixes the batch dimension"]),
    Mistake("model ignores its input", InputIgnored, "check:input baseline",
            ["does not seem to use its inputs"]),
    Mistake("misspelt config key", ToyTrainer, "config", ["Did you mean trainer.max_steps?"],
            {"trainer": {"max_stepz": 5}}),
]


def config_for(m: Mistake, tmp: Path) -> dict[str, Any]:
    cfg = toy_config(tmp, max_steps=12, log_every_n_steps=4)
    for key, value in m.config.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def catch(m: Mistake, tmp: Optional[Path] = None) -> Optional[str]:
    """Run the mistake as a user would meet it; the message saferun gave, or None."""
    tmp = Path(tmp or tempfile.mkdtemp(prefix="saferun-mistake-"))
    cfg = config_for(m, tmp)
    records = _Collect()
    logger = logging.getLogger("saferun")
    logger.addHandler(records)
    try:
        if m.how == "config":
            m.trainer(cfg)
        elif m.how == "fit":
            m.trainer(cfg).fit()
        elif m.how == "setup":
            m.trainer(cfg).setup()
        else:
            from saferun.config import load_config
            from saferun.guards import check

            base = check._short_session(load_config(cfg), str(tmp / "check"))
            wanted = m.how.split(":", 1)[1]
            fn = getattr(check, "_" + wanted.replace(" ", "_"))
            result = check._run(fn, lambda c: m.trainer(c), base)
            return None if result.status == "pass" else result.finding
    except saferun.SaferunError as e:
        return str(e)
    finally:
        logger.removeHandler(records)
    return "\n".join(records.messages) or None


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def caught(m: Mistake, message: Optional[str]) -> bool:
    return message is not None and all(w in message for w in m.expect)


CleanRun = Callable[[Path], None]
