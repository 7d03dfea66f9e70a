import torch
from torch.utils.data import TensorDataset

from toys import ToyTrainer, make_classification, toy_config


def test_predict_returns_normal_cpu_tensors_in_order_without_changing_modes(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, max_steps=4))
    t.fit()
    x, y = make_classification(40, seed=9)
    flags = [m.training for m in t.model.modules()]
    out = t.predict(TensorDataset(x, y))
    assert out.shape == (40, 3) and out.device.type == "cpu"
    assert not out.is_inference() and not out.requires_grad  # safe to use in autograd later
    assert [m.training for m in t.model.modules()] == flags
    t.model.eval()
    with torch.no_grad():
        assert torch.allclose(out, t.model(x))


def test_validate_alone_returns_batch_size_weighted_means(tmp_path):
    class Counting(ToyTrainer):
        n_val = 70  # batches of 32, 32 and 6

        def validation_step(self, batch):
            x, _ = batch
            return {"first": x[:, 0].mean(), "size": torch.tensor(float(len(x)))}

    t = Counting(toy_config(tmp_path))
    metrics = t.validate()
    x, _ = make_classification(256 + 70)
    assert abs(metrics["val/first"] - x[256:, 0].mean().item()) < 1e-6
    assert abs(metrics["val/size"] - (32 * 32 + 32 * 32 + 6 * 6) / 70) < 1e-9


def test_predict_outputs_inside_dicts_and_tuples_are_normal_tensors_usable_in_autograd(tmp_path):
    class Structured(ToyTrainer):
        def predict_step(self, batch):
            x, _ = batch
            logits = self.model(x)
            return {"logits": logits, "pair": (logits.argmax(1), [logits[:, 0]]), "n": len(x)}

    t = Structured(toy_config(tmp_path, max_steps=2))
    t.fit()
    x, y = make_classification(40, seed=9)
    out = t.predict(TensorDataset(x, y))
    assert len(out) == 2 and out[0]["n"] == 32 and out[1]["n"] == 8  # one entry per batch
    leaves = [o["logits"] for o in out] + [o["pair"][0] for o in out] + [o["pair"][1][0] for o in out]
    assert all(t.device.type == "cpu" and not t.is_inference() for t in leaves)
    w = torch.ones(3, requires_grad=True)
    (out[0]["logits"] * w).sum().backward()  # saving an inference tensor for backward would fail
    assert torch.equal(w.grad, out[0]["logits"].sum(0))


def test_a_metric_reported_by_some_batches_is_averaged_over_those_batches_only(tmp_path):
    class Sometimes(ToyTrainer):
        n_val = 70  # batches of 32, 32 and 6

        def validation_step(self, batch):
            x, _ = batch
            out = {"first": x[:, 0].mean()}
            if len(x) == 32:  # e.g. a metric that needs a full batch
                out["full_only"] = x[:, 1].mean()
            if len(x) == 6:
                out["last_only"] = torch.tensor(5.0)
            return out

    metrics = Sometimes(toy_config(tmp_path)).validate()
    x, _ = make_classification(256 + 70)
    assert abs(metrics["val/first"] - x[256:, 0].mean().item()) < 1e-6
    assert abs(metrics["val/full_only"] - x[256:320, 1].mean().item()) < 1e-6  # not diluted by 70
    assert metrics["val/last_only"] == 5.0
