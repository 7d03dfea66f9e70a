"""collate_fn: a `_target_` node in the config, or the build_collate_fn hook, applied to the
training, validation and predict loaders, and checked for spawned workers like the dataset."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import saferun
from collate_toys import dict_collate
from toys import ToyTrainer, make_classification, toy_config


class DictBatches(ToyTrainer):
    """Steps that only work on the dict batches of collate_toys; records what each loader gave."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.seen = {"train": [], "val": [], "predict": []}

    def training_step(self, batch):
        self.seen["train"].append((batch["n"], batch["x"].clone()))
        return F.cross_entropy(self.model(batch["x"]), batch["y"])

    def validation_step(self, batch):
        self.seen["val"].append((batch["n"], batch["x"].clone()))
        return {"loss": F.cross_entropy(self.model(batch["x"]), batch["y"])}

    def predict_step(self, batch):
        self.seen["predict"].append((batch["n"], batch["x"].clone()))
        return self.model(batch["x"])


def collate_config(tmp_path, node, **trainer):
    cfg = toy_config(tmp_path, max_steps=3, **trainer)
    cfg["collate_fn"] = node
    return cfg


# spawn pickles the collate_fn for each worker (slow here: every worker imports torch afresh)
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_collate_fn_from_the_config_reaches_the_workers_and_every_loader(tmp_path, context):
    node = {"_target_": "collate_toys.dict_collate", "_partial_": True}
    t = DictBatches(collate_config(tmp_path, node, num_workers=1, multiprocessing_context=context))
    t.fit()
    x, y = make_classification(40, seed=9)
    out = t.predict(TensorDataset(x, y))
    assert out.shape == (40, 3)
    assert [n for n, _ in t.seen["train"]] == [32, 32, 32]
    assert [n for n, _ in t.seen["val"]] == [32, 32]  # 64 validation samples
    assert [n for n, _ in t.seen["predict"]] == [32, 8]
    assert torch.equal(torch.cat([b for _, b in t.seen["predict"]]), x)


def test_a_collate_class_gets_the_node_arguments(tmp_path):
    t = DictBatches(collate_config(tmp_path, {"_target_": "collate_toys.ScaledCollate",
                                              "scale": 0.0}))
    t.fit()
    assert all(not b.any() for _, b in t.seen["train"] + t.seen["val"])


def test_a_function_target_without_partial_is_refused_with_the_fix(tmp_path):
    with pytest.raises(saferun.ConfigError, match=r"collate_fn.*is a function.*_partial_: true"):
        DictBatches(collate_config(tmp_path, {"_target_": "collate_toys.dict_collate"}))


def test_the_hook_for_python_users_and_preflight_names_a_collate_fn_spawn_cannot_receive(tmp_path):
    class Hooked(DictBatches):
        def build_collate_fn(self):
            return dict_collate

    t = Hooked(toy_config(tmp_path, max_steps=2))
    t.fit()
    assert [n for n, _ in t.seen["train"]] == [32, 32]

    class Unpicklable(DictBatches):
        def build_collate_fn(self):
            return lambda samples: dict_collate(samples)

    cfg = toy_config(tmp_path, max_steps=2, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(saferun.SaferunError, match=r"preflight(.|\n)*collate_fn: a lambda"):
        Unpicklable(cfg).setup()


def test_resume_with_another_collate_fn_is_refused(tmp_path):
    node = {"_target_": "collate_toys.ScaledCollate", "scale": 1.0}
    DictBatches(collate_config(tmp_path, node)).fit()
    cfg = collate_config(tmp_path, {**node, "scale": 2.0})
    cfg["resume"] = "auto"
    with pytest.raises(saferun.ConfigError, match=r"collate_fn.scale: 1.0 -> 2.0"):
        DictBatches(cfg).fit()
