"""Bad input stops at or before the first step with a message naming what to fix."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import saferun
from toys import ToyTrainer, toy_config


def fit(cls, tmp_path, **kw):
    t = cls(toy_config(tmp_path, **kw))
    t.fit()
    return t


def test_non_scalar_loss(tmp_path):
    class PerSample(ToyTrainer):
        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(x), y, reduction="none")

    with pytest.raises(saferun.SaferunError, match=r"scalar loss.*shape \(32,\) at step 1.*loss.mean\(\)"):
        fit(PerSample, tmp_path)


def test_loss_without_grad(tmp_path):
    class Detached(ToyTrainer):
        def training_step(self, batch):
            return super().training_step(batch).detach()

    with pytest.raises(saferun.SaferunError, match="does not require grad.*no_grad"):
        fit(Detached, tmp_path)


def test_dict_without_loss(tmp_path):
    class NoLoss(ToyTrainer):
        def training_step(self, batch):
            return {"nll": super().training_step(batch)}

    with pytest.raises(saferun.SaferunError, match="without 'loss'.*nll"):
        fit(NoLoss, tmp_path)


class NumpyDataset(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": np.ones(8, dtype=np.float32), "y": 0}


@pytest.mark.parametrize("accumulate", [1, 2])  # (a batch it cannot move: nor count)
def test_batch_that_cannot_be_moved(tmp_path, accumulate):
    class Numpy(ToyTrainer):
        def build_datasets(self):
            return NumpyDataset(), None

        def build_dataloaders(self, train, val):
            # a collate_fn that leaves NumPy arrays in the batch
            return torch.utils.data.DataLoader(train, batch_size=8, collate_fn=lambda b: b), None

    with pytest.raises(saferun.SaferunError, match=r"batch\[0\]\['x'\] is a numpy.ndarray"):
        fit(Numpy, tmp_path, accumulate=accumulate)


def test_validation_metric_that_is_not_scalar(tmp_path):
    class PerSampleMetric(ToyTrainer):
        def validation_step(self, batch):
            x, y = batch
            return {"acc": (self.model(x).argmax(1) == y).float()}

    with pytest.raises(saferun.SaferunError, match=r"validation_step returned 'acc' = \(32,\), not a scalar"):
        fit(PerSampleMetric, tmp_path, max_steps=2)


def test_empty_dataset(tmp_path):
    class Empty(ToyTrainer):
        def build_datasets(self):
            return TensorDataset(torch.ones(0, 8), torch.ones(0)), None

    with pytest.raises(saferun.SaferunError, match="training dataset is empty"):
        fit(Empty, tmp_path)


def test_dataset_smaller_than_a_batch_with_drop_last(tmp_path):
    class Tiny(ToyTrainer):
        def build_datasets(self):
            return TensorDataset(torch.ones(4, 8), torch.zeros(4, dtype=torch.long)), None

    with pytest.raises(saferun.SaferunError, match="no batches in epoch 0.*drop_last"):
        fit(Tiny, tmp_path, drop_last=True)


@pytest.mark.parametrize("steps", [0, -3])
def test_non_positive_max_steps(tmp_path, steps):
    with pytest.raises(saferun.ConfigError, match="trainer.max_steps must be > 0"):
        ToyTrainer(toy_config(tmp_path, max_steps=steps))


def test_validation_set_without_validation_step(tmp_path):
    class NoVal(saferun.Trainer):
        def build_model(self):
            return torch.nn.Linear(8, 3)

        def build_datasets(self):
            return TensorDataset(torch.ones(8, 8)), TensorDataset(torch.ones(8, 8))

    with pytest.raises(saferun.SaferunError, match="does not override validation_step"):
        NoVal(toy_config(tmp_path)).setup()


def test_missing_model_hook_and_node(tmp_path):
    with pytest.raises(saferun.SaferunError, match="build_model.*not overridden.*model._target_"):
        saferun.Trainer(toy_config(tmp_path)).setup()


def test_inference_tensor_kept_from_validation_is_explained(tmp_path):
    class Caching(ToyTrainer):
        """Keeps a tensor computed during validation and reuses it in training."""

        cache = None

        def validation_step(self, batch):
            x, _ = batch
            self.cache = self.model.backbone(x[:1])
            return super().validation_step(batch)

        def training_step(self, batch):
            loss = super().training_step(batch)
            if self.cache is not None:
                loss = loss + (self.model.head(self.cache) ** 2).mean()
            return loss

    with pytest.raises(saferun.SaferunError, match="inference_mode.*eval_grad_mode=no_grad"):
        fit(Caching, tmp_path, val_every_n_steps=2, max_steps=4)
