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


# ------------------------------------------------------------------ the user's model, loss and data (issue 24)

class ListedHead(nn.Module):
    """Heads kept in a plain list: model.parameters() does not see them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.heads = [nn.Linear(16, 3)]  # the planted bug: nn.ModuleList needed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads[0](self.body(x))


class ModulesInAList(ToyTrainer):
    def build_model(self) -> nn.Module:
        return ListedHead()


class LayerInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.head = nn.Linear(16, 3)  # the planted bug: a new, untrained layer at every call
        return self.head(torch.relu(self.body(x)))


class LayerMadeInForward(ToyTrainer):
    def build_model(self) -> nn.Module:
        return LayerInForward()


class CountsInPlainTensor(nn.Module):
    """Keeps running input statistics in a plain tensor attribute: not saved."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.mean = torch.zeros(8)  # the planted bug: register_buffer needed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc(x - self.mean)


class PlainTensorState(ToyTrainer):
    def build_model(self) -> nn.Module:
        return CountsInPlainTensor()


class CarriesState(nn.Module):
    """An RNN cell whose state is carried from batch to batch without detach."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.RNNCell(8, 16), nn.Linear(16, 3)
        self.state: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.state if self.state is not None and len(self.state) == len(x) else None
        self.state = self.cell(x, h)  # the planted bug: .detach() needed
        return self.head(self.state)


class GraphCarried(ToyTrainer):
    def build_model(self) -> nn.Module:
        return CarriesState()


class BroadcastMSE(ToyTrainer):
    """Regression with an (N, 1) prediction against an (N,) target."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y.float())  # the planted bug: (N, 1) vs (N,)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x).squeeze(1), y.float())}


class OneBasedLabels(ToyTrainer):
    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y + 1)  # the planted bug: labels 1..3 for 3 classes


class SoftmaxBeforeCrossEntropy(ToyTrainer):
    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(torch.softmax(self.model(x), 1), y)  # the planted bug


class NllOnLogits(ToyTrainer):
    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.nll_loss(self.model(x), y)  # the planted bug: log_softmax missing


class AlwaysDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.body(x)), 0.5, training=True)  # the planted bug
        return self.head(h)


class DropoutInEval(ToyTrainer):
    def build_model(self) -> nn.Module:
        return AlwaysDropout()


class NoisyView(Dataset):
    """Validation samples with random noise added at every read."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]  # the planted bug: random in validation


class RandomValidationTransform(ToyTrainer):
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train, val = super().build_datasets()
        return train, NoisyView(*val.tensors)  # type: ignore[attr-defined]


class UnshuffledLoader(ToyTrainer):
    def build_dataloaders(self, train: Dataset, val: Optional[Dataset]) -> Any:
        return (torch.utils.data.DataLoader(train, batch_size=32),  # the planted bug: no shuffle
                torch.utils.data.DataLoader(val, batch_size=32) if val is not None else None)


class SortedByLabel(ToyTrainer):
    """The data arrives sorted by label and the user's loader does not shuffle."""

    def build_datasets(self) -> tuple[Dataset, None]:
        x, y = make_classification(256)
        order = torch.argsort(y, stable=True)
        return TensorDataset(x[order], y[order]), None

    def build_dataloaders(self, train: Dataset, val: Optional[Dataset]) -> Any:
        return torch.utils.data.DataLoader(train, batch_size=16), None


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
    Mistake("submodule kept in a plain list", ModulesInAList, "fit",
            ["'heads[0]'", "nn.ModuleList", "no optimizer steps"]),
    Mistake("layer created inside forward", LayerMadeInForward, "fit",
            ["'head.weight'", "appeared after the optimizer was built", "in __init__"]),
    Mistake("state in a plain tensor attribute", PlainTensorState, "fit",
            ["'mean'", "plain tensor attributes", "register_buffer"]),
    Mistake("RNN state carried without detach", GraphCarried, "fit",
            ["'state'", "h.detach()", "Do not add retain_graph=True"]),
    Mistake("(N, 1) prediction against an (N,) target", BroadcastMSE, "fit",
            ["F.mse_loss", "(32, 1)", "(32,)", "broadcast to (32, 32)", "mistakes.py"]),
    Mistake("class labels outside [0, C)", OneBasedLabels, "fit",
            ["outside [0, 3)", "target positions", "y - 1"]),
    Mistake("softmax before cross_entropy", SoftmaxBeforeCrossEntropy, "fit",
            ["F.cross_entropy got probabilities", "drop the softmax", "mistakes.py"]),
    Mistake("nll_loss on raw scores", NllOnLogits, "fit",
            ["not log-probabilities", "log_softmax"]),
    Mistake("dropout hard-coded on in evaluation", DropoutInEval, "check:eval determinism",
            ["module 'head' (Linear) got a different input", "forward code of '(model)'",
             "self.training"]),
    Mistake("random transform on validation data", RandomValidationTransform,
            "check:eval determinism", ["validation sample 0 differs", "NoisyView"]),
    Mistake("training loader without shuffle", UnshuffledLoader, "setup",
            ["in index order", "shuffle=True", "trainer.shuffle=false"]),
    Mistake("batches sorted by label", SortedByLabel, "check:batch order",
            ["single class", "batch 0: all 0", "sorted by label"]),
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
            from saferun import check

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
