"""Tabular: an MLP regressor on the diabetes data set that ships with scikit-learn.

Launch:   saferun run recipe=tabular
Expected: validation R^2 about 0.46 (at least 0.44) and RMSE about 57 in the
          target's units after 500 steps, about 10 seconds on one CPU core.
          Ordinary least squares gets R^2 0.48 and RMSE 56 on the same split:
          this data is close to linear, and the MLP comes within about 0.02.

Everything specific to the task is in this file: the data (442 patients, 10
numeric features, bundled with scikit-learn, so nothing is downloaded), its
standardisation, the model and the training and validation steps. Features and
target are standardised with statistics of the training split only, so nothing
about the validation rows leaks into training. The loop, its discipline and
its safety checks come from saferun.Trainer. Copy it with
`saferun new DIR --from tabular`.
"""

from __future__ import annotations

import math

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import saferun


class TabularDataset(Dataset):
    """Standardised rows (features, target), plus the scales needed to report errors."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor, target_std: float) -> None:
        self.features = features  # (N, F), standardised with training statistics
        self.targets = targets  # (N,), standardised with training statistics
        self.target_std = target_std  # the training target's std, in original units
        # This split's target variance (standardised): R^2 = 1 - MSE / target_var.
        self.target_var = float(targets.var(unbiased=False))

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[i], self.targets[i]


def datasets(val_fraction: float = 0.2, split_seed: int = 0, test_fraction: float = 0.0
             ) -> tuple[TabularDataset, ...]:
    """scikit-learn's diabetes data, split once with a fixed seed, standardised by training rows.
    With test_fraction > 0 also a test split (for `saferun test`), taken from the training rows,
    so the validation rows stay the same."""
    from sklearn.datasets import load_diabetes

    # scaled=False: the raw measurements; we standardise them ourselves, from training rows only.
    x_all, y_all = load_diabetes(return_X_y=True, scaled=False)
    x = torch.tensor(x_all, dtype=torch.float32)  # (442, 10)
    y = torch.tensor(y_all, dtype=torch.float32)  # (442,)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_val, n_test = int(len(y) * val_fraction), int(len(y) * test_fraction)
    val, test, train = order[:n_val], order[n_val:n_val + n_test], order[n_val + n_test:]
    x_mean, x_std = x[train].mean(dim=0), x[train].std(dim=0)
    y_mean, y_std = y[train].mean(), y[train].std()
    x, y = (x - x_mean) / x_std, (y - y_mean) / y_std
    splits = (train, val, test) if n_test else (train, val)
    return tuple(TabularDataset(x[rows], y[rows], float(y_std)) for rows in splits)


class MLP(nn.Module):
    """`layers` hidden layers of width `hidden` with GELU and dropout, then one output."""

    def __init__(self, features: int = 10, hidden: int = 64, layers: int = 2,
                 dropout: float = 0.1) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(features if i == 0 else hidden, hidden), nn.GELU(),
                       nn.Dropout(dropout)]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, F) -> (B,) predictions of the standardised target."""
        return self.head(self.body(x)).squeeze(-1)


class TabularTrainer(saferun.Trainer):
    """Mean squared error on the standardised target.

    Validation reports `loss` (MSE, standardised units), `mse` and `rmse` (original
    units of the target) and `r2`. saferun averages validation_step's values over
    batches weighted by batch size, which is exact for loss, mse and r2 (linear in the
    squared error); rmse, the root of the mean, is derived afterwards in
    finish_validation.
    """

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        features, targets = batch
        return F.mse_loss(self.model(features), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]
                        ) -> Mapping[str, torch.Tensor]:
        assert self.val_loader is not None  # validation runs only with a validation loader
        return self.errors(batch, self.val_loader.dataset)  # type: ignore[arg-type]

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        assert self.test_loader is not None  # set while test() runs
        # R^2 needs the test split's own target variance, not the validation split's
        return self.errors(batch, self.test_loader.dataset)  # type: ignore[arg-type]

    def errors(self, batch: tuple[torch.Tensor, torch.Tensor], split: TabularDataset
               ) -> Mapping[str, torch.Tensor]:
        features, targets = batch
        loss = F.mse_loss(self.model(features), targets)  # standardised units
        mse = loss * split.target_std**2  # original units
        return {"loss": loss, "mse": mse, "r2": 1 - loss / split.target_var}

    def finish_validation(self, metrics: dict[str, float]) -> dict[str, float]:
        return {**metrics, "rmse": math.sqrt(metrics["mse"])}
