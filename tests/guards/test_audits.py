"""Issue 24: the model-state audit, the loss-call audit, evaluation determinism and training
order. Each planted mistake is in tests/mistakes.py (test_mistakes runs them all); here: the
details of each mechanism, the false-alarm zoo, and that nothing runs after the first steps."""

from __future__ import annotations

import logging
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

from mistakes import (CORPUS, GraphCarried, LayerMadeInForward, ModulesInAList, OneBasedLabels,
                      catch, config_for)
from saferun.errors import LossCallError, ModelStateError, SaferunError
from saferun.guards import model_audit
from saferun.guards.loss_audit import LossCallAudit
from toys import Net, ToyTrainer, make_classification, toy_config


def warnings_of(fn: Any, caplog: Any) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="saferun"):
        fn()
    return [r.getMessage() for r in caplog.records if r.name == "saferun"
            and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ the model-state audit

def test_modules_in_a_plain_list_are_refused_before_a_second_update(tmp_path):
    t = ModulesInAList(toy_config(tmp_path, max_steps=5))
    with pytest.raises(ModelStateError, match=r"'heads\[0\]'.*nn.ModuleList"):
        t.fit()
    assert t.state.step == 1  # refused when step 2 began: one update, not five


class Holder:
    """A plain object (not an nn.Module) that holds a layer."""

    def __init__(self) -> None:
        self.proj = nn.Linear(16, 16)


class DeeplyHidden(nn.Module):
    """Layers in a list of lists and on a plain object: model.parameters() sees neither."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.stages = [[nn.Linear(16, 16), nn.ReLU()], [nn.Linear(16, 16)]]
        self.extra = Holder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        for stage in self.stages:
            for layer in stage:
                h = layer(h)
        return self.head(self.extra.proj(h))


def test_modules_in_nested_containers_and_on_plain_objects_are_refused(tmp_path, caplog):
    class T(ToyTrainer):
        def build_model(self) -> nn.Module:
            return DeeplyHidden()

    with caplog.at_level(logging.WARNING, logger="saferun"):
        with pytest.raises(ModelStateError) as info:
            T(toy_config(tmp_path, max_steps=4)).fit()
    message = str(info.value)
    assert "'extra.proj'" in message and "'stages[0][0]'" in message and "'stages[1][0]'" in message
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "plain Python object (not an nn.Module)" in warned and "nn.ModuleList" in warned


def test_a_model_whose_layers_are_all_hidden_is_told_where_they_are(tmp_path):
    class AllInAList(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(8, 16), nn.Linear(16, 3)]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[1](torch.relu(self.layers[0](x)))

    class T(ToyTrainer):
        def build_model(self) -> nn.Module:
            return AllInAList()

    with pytest.raises(SaferunError, match=r"no trainable parameters\. Its layers are held where "
                                           r"model\.parameters\(\) does not look: 'layers\[0\]', "
                                           r"'layers\[1\]'\. Use nn\.ModuleList"):
        T(toy_config(tmp_path)).fit()


class DictHeads(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.heads = {"a": nn.Linear(16, 3)}  # a plain dict
        if frozen:
            self.heads["a"].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](torch.relu(self.body(x)))


def test_modules_in_a_plain_dict_are_named_with_module_dict(tmp_path, caplog):
    class T(ToyTrainer):
        def build_model(self) -> nn.Module:
            return DictHeads(frozen=False)

    with caplog.at_level(logging.WARNING, logger="saferun"):
        with pytest.raises(ModelStateError, match=r"\"heads\['a'\]\"|'heads\[\\'a\\'\]'|nn.ModuleDict"):
            T(toy_config(tmp_path)).fit()
    assert any("heads['a']" in r.getMessage() and "nn.ModuleDict" in r.getMessage()
               for r in caplog.records)  # warned at setup, before any step


def test_a_frozen_module_kept_out_of_the_model_on_purpose_is_left_alone(tmp_path, caplog):
    class T(ToyTrainer):  # a frozen teacher kept in a dict so that it is not saved: allowed
        def build_model(self) -> nn.Module:
            return DictHeads(frozen=True)

    assert warnings_of(lambda: T(toy_config(tmp_path, max_steps=3)).fit(), caplog) == []


def test_a_layer_created_in_forward_is_named(tmp_path):
    with pytest.raises(ModelStateError, match=r"'head.weight', 'head.bias' appeared after the optimizer"):
        LayerMadeInForward(toy_config(tmp_path)).fit()


def test_a_graph_carried_into_the_next_step_is_named_before_torch_fails(tmp_path):
    with pytest.raises(ModelStateError) as info:
        GraphCarried(toy_config(tmp_path)).fit()
    message = str(info.value)
    assert "'state'" in message and "h.detach()" in message
    assert "Do not add retain_graph=True" in message


class KeepsOutputs(nn.Module):
    """Correct code that keeps forward outputs on the module: a KL term the loss reads, the
    attention weights kept to look at, and a weight re-made by torch's (old-style)
    spectral_norm pre-forward hook. Each is overwritten by the next forward."""

    def __init__(self) -> None:
        super().__init__()
        self.mu, self.logvar = nn.Linear(8, 4), nn.Linear(8, 4)
        self.attn = nn.utils.spectral_norm(nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)
        self.kl: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.mu(x), self.logvar(x)
        self.kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(1).mean()
        self.last_attn = self.attn(mu).softmax(-1)
        return self.head(self.last_attn * mu)


class KeepsOutputsTrainer(ToyTrainer):
    def build_model(self) -> nn.Module:
        return KeepsOutputs()

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y) + 0.01 * self.model.kl


def test_outputs_kept_on_the_module_are_not_carried_graphs_nor_state(tmp_path, caplog):
    """No refusal and no warning: neither the model audit (the second loss does not reach the
    first step's graph) nor the purity check after validation under inference_mode (the next
    forward overwrites them)."""
    cfg = toy_config(tmp_path, max_steps=6, val_every_n_steps=2)
    assert warnings_of(lambda: KeepsOutputsTrainer(cfg).fit(), caplog) == []


class CachesInEvaluation(nn.Module):
    """A cache made on first use: by validation (under inference_mode), then used in training,
    where autograd must save it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.scale: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = torch.linspace(0.5, 1.5, 8)
        return self.head(self.body(x) * self.scale)


def test_a_cache_made_in_evaluation_and_saved_by_training_is_explained_by_name(tmp_path):
    class T(ToyTrainer):
        def build_model(self) -> nn.Module:
            return CachesInEvaluation()

    with pytest.raises(SaferunError, match=r"attribute scale \(CachesInEvaluation\) is an inference"):
        T(toy_config(tmp_path / "a", max_steps=4)).validate()  # guards.eval_purity, at once
    cfg = toy_config(tmp_path / "b", max_steps=4)
    cfg["guards"] = {"eval_purity": False}
    trainer = T(cfg)
    trainer.validate()  # the cache is made here, under inference_mode
    with pytest.raises(SaferunError, match=r"The model holds: attribute scale\. .*eval_grad_mode=no_grad"):
        trainer.fit()


def test_with_the_audit_off_torchs_second_backward_error_is_explained_by_name(tmp_path):
    cfg = toy_config(tmp_path)
    cfg["guards"] = {"model_audit": False}
    with pytest.raises(RuntimeError) as info:  # the explained error keeps torch's type
        GraphCarried(cfg).fit()
    message = str(info.value)
    assert "Trying to backward through the graph a second time" in str(info.value.__cause__)
    assert "'state'" in message and "h.detach()" in message and "retain_graph=True" in message


def test_state_in_a_plain_tensor_is_warned_about_with_register_buffer(tmp_path, caplog):
    m = next(m for m in CORPUS if m.name == "state in a plain tensor attribute")
    found = warnings_of(lambda: m.trainer(config_for(m, tmp_path)).fit(), caplog)
    assert len(found) == 1 and "'mean'" in found[0] and "register_buffer" in found[0]


# ------------------------------------------------------------------ the loss-call audit

class Regression(ToyTrainer):
    """`loss_fn(pred, y)` with pred (N, 1): each form of a regression loss."""

    loss_fn: Any = staticmethod(F.mse_loss)
    squeeze = False

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        pred = self.model(x)
        return self.loss_fn(pred.squeeze(1) if self.squeeze else pred, y.float())

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": F.mse_loss(self.model(x).squeeze(1), y.float())}


@pytest.mark.parametrize("loss_fn", [F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
                                     nn.MSELoss(), nn.L1Loss()],
                         ids=["mse", "l1", "smooth_l1", "huber", "MSELoss", "L1Loss"])
def test_regression_losses_that_broadcast_are_refused_naming_both_shapes(tmp_path, loss_fn):
    class T(Regression):
        pass

    T.loss_fn = staticmethod(loss_fn) if not isinstance(loss_fn, nn.Module) else loss_fn
    t = T(toy_config(tmp_path))
    with pytest.raises(LossCallError, match=r"\(32, 1\).*\(32,\).*broadcast to \(32, 32\)") as info:
        t.fit()
    assert "test_audits.py" in str(info.value) and "self.loss_fn(" in str(info.value)  # the line
    assert t.state.step == 0  # before any update


def test_matching_shapes_and_a_broadcast_target_are_not_reported(tmp_path, caplog):
    class Matching(Regression):
        squeeze = True

    assert warnings_of(lambda: Matching(toy_config(tmp_path, max_steps=3)).fit(), caplog) == []
    with LossCallAudit(1):  # a target broadcast over the predictions: torch warns; not refused
        with pytest.warns(UserWarning):
            F.mse_loss(torch.zeros(4, 3), torch.zeros(3))


def test_class_indices_out_of_range_name_the_positions_and_c(tmp_path):
    with pytest.raises(LossCallError) as info:
        OneBasedLabels(toy_config(tmp_path)).fit()
    message = str(info.value)
    assert "outside [0, 3)" in message and "C = 3" in message and "[3]" in message
    with LossCallAudit(1):  # ignore_index is allowed
        F.cross_entropy(torch.randn(4, 3), torch.tensor([0, 2, -100, 1]))
        with pytest.raises(LossCallError, match=r"positions \[\(1, 2\)\]"):  # (N, C, d) input
            F.cross_entropy(torch.randn(2, 3, 4), torch.tensor([[0, 1, 2, 0], [1, 2, 5, 0]]))


def test_probabilities_and_log_probabilities_where_each_is_expected(caplog):
    logits = torch.randn(16, 5)
    y = torch.randint(0, 5, (16,))
    with LossCallAudit(1):
        F.cross_entropy(logits, y)
        F.cross_entropy(logits.log_softmax(1), y)  # log_softmax is idempotent: harmless
        F.nll_loss(logits.log_softmax(1), y)
        F.kl_div(logits.log_softmax(1), logits.softmax(1), reduction="batchmean")
        F.binary_cross_entropy_with_logits(torch.randn(16), torch.rand(16))
        F.cross_entropy(logits, logits.softmax(1))  # probability targets
        for call in (lambda: F.cross_entropy(logits.softmax(1), y),
                     lambda: F.nll_loss(logits.softmax(1), y),
                     lambda: F.kl_div(logits.softmax(1), logits.softmax(1), reduction="batchmean")):
            with pytest.raises(LossCallError, match="probabilities"):
                call()
    assert not [r for r in caplog.records if r.name == "saferun"]
    with caplog.at_level(logging.WARNING, logger="saferun"), LossCallAudit(1) as audit:
        F.nll_loss(logits, y)
        F.binary_cross_entropy_with_logits(torch.sigmoid(torch.randn(16)), torch.rand(16))
    assert len(audit.warnings) == 2
    assert "not log-probabilities" in audit.warnings[0] and "sigmoid" in audit.warnings[1]


def _bce(logits: torch.Tensor) -> torch.Tensor:  # one loss line, called for several batches
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, 0.9))


def test_raw_scores_that_happen_to_lie_in_0_1_are_not_taken_for_a_sigmoids(caplog):
    # A GAN discriminator at initialisation: its raw scores cluster around its output bias and
    # can all lie in (0, 1) by chance. Not a sigmoid's outputs: no warning. With autograd the
    # graph tells (even around 0.5); without, raw scores near 0 are not a sigmoid's.
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    with torch.no_grad():
        disc[2].weight.mul_(0.1)
    real, fake = torch.randn(32, 64), torch.randn(32, 64)

    def near(bias):
        with torch.no_grad():
            disc[2].bias.fill_(bias)
        scores = disc(real)
        assert bool(((scores > 0) & (scores < 1)).all()) and scores.grad_fn is not None
        return scores

    with caplog.at_level(logging.WARNING, logger="saferun"), LossCallAudit(1) as audit:
        _bce(near(0.5)) + _bce(disc(fake))
        _bce(near(0.1).detach())
    assert audit.warnings == [] and not caplog.records, audit.warnings


def test_a_sigmoid_before_the_logits_loss_is_said_once_per_line(caplog):
    torch.manual_seed(0)
    head = nn.Linear(8, 1)
    with caplog.at_level(logging.WARNING, logger="saferun"), LossCallAudit(1) as audit:
        for _ in range(3):  # the same mistake at the same line: said once
            _bce(torch.sigmoid(head(torch.randn(16, 8))).squeeze(-1))
    assert len(audit.warnings) == 1 and len(caplog.records) == 1, audit.warnings
    assert "the output of a sigmoid" in audit.warnings[0], audit.warnings


# ------------------------------------------------------------------ no cost after the first steps

def test_the_audits_run_in_the_first_two_steps_only(tmp_path, monkeypatch):
    # The step frame (loop/frame.py) runs them around the first two training_step calls, then
    # drops them: later steps pay nothing, and nothing is set on the Trainer instance.
    calls, audited = [], []

    class Counting(LossCallAudit):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    real = model_audit.ModelAudit.after_first_backward

    def after_first_backward(self, step, *args, **kwargs):
        audited.append(step)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(model_audit, "LossCallAudit", Counting)
    monkeypatch.setattr(model_audit.ModelAudit, "after_first_backward", after_first_backward)
    t = ToyTrainer(toy_config(tmp_path, max_steps=6))
    t.fit()
    assert "training_step" not in vars(t) and "train_step" not in vars(t)
    assert F.cross_entropy in calls  # the first step ran under the loss-call audit, once
    assert calls.count(F.cross_entropy) == 1
    assert audited == [2]  # the state audit: once, as the second step begins


# ------------------------------------------------------------------ training order

def test_the_order_warning_goes_when_trainer_shuffle_says_it_is_intended(tmp_path, caplog):
    m = next(m for m in CORPUS if m.name == "training loader without shuffle")
    assert catch(m, tmp_path / "a") is not None
    cfg = config_for(m, tmp_path / "b")
    cfg["trainer"]["shuffle"] = False
    assert warnings_of(lambda: m.trainer(cfg).setup(), caplog) == []


# ------------------------------------------------------------------ the false-alarm zoo

class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.embed.weight  # weight tying
        self.head = nn.Linear(8, 3)
        self.register_buffer("scale", torch.ones(8), persistent=False)  # a non-persistent buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(torch.relu(self.embed(x))) * self.scale)


class Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.heads = nn.ModuleDict({"cls": nn.Linear(16, 3)})
        self.names = ["a", "b"]  # plain containers of non-modules are fine
        self.lazy = nn.LazyLinear(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.layers[1](torch.relu(self.layers[0](x))))
        return self.heads["cls"](h + self.lazy(x))


class DetachedRNN(nn.Module):
    """Truncated BPTT done right: the state is a buffer, assigned detached."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.RNNCell(8, 16), nn.Linear(16, 3)
        self.register_buffer("state", torch.zeros(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cell(x, self.state[: len(x)] if len(x) <= len(self.state) else None)
        if self.training and len(x) == len(self.state):
            self.state = h.detach()
        return self.head(h)


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        x, y = make_classification(256)
        return iter(zip(x, y))


class ZooTrainer(ToyTrainer):
    kind = "tied"

    def build_model(self) -> nn.Module:
        return {"tied": Tied, "containers": Containers, "rnn": DetachedRNN}.get(self.kind, Net)()

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        if self.kind == "stream":
            return Stream(), None
        return super().build_datasets()

    def build_dataloaders(self, train: Dataset, val: Optional[Dataset]) -> Any:
        if self.kind != "weighted":
            return super().build_dataloaders(train, val)
        sampler = WeightedRandomSampler(torch.ones(len(train)), len(train),  # type: ignore[arg-type]
                                        generator=torch.Generator().manual_seed(0))
        return DataLoader(train, batch_size=32, sampler=sampler), None


@pytest.mark.parametrize("kind", ["batchnorm", "tied", "containers", "rnn", "stream", "weighted"])
def test_the_zoo_of_legitimate_patterns_raises_nothing(tmp_path, caplog, kind):
    class T(ZooTrainer):
        pass

    T.kind = kind
    cfg = toy_config(tmp_path, max_steps=4)
    if kind == "stream":
        cfg["trainer"]["max_steps"] = 4
    assert warnings_of(lambda: T(cfg).fit(), caplog) == []


@pytest.mark.slow
def test_the_zoo_under_torch_compile_raises_nothing(tmp_path, caplog):
    cfg = toy_config(tmp_path, max_steps=4, compile=True, compile_backend="eager")
    assert warnings_of(lambda: ZooTrainer(cfg).fit(), caplog) == []


def test_saferun_check_passes_the_new_checks_on_a_clean_model(tmp_path):
    from saferun.config import load_config
    from saferun.check import run_checks

    results = run_checks(lambda c: ToyTrainer(c), load_config(toy_config(tmp_path)),
                         only=["eval determinism", "batch order"])
    assert [r.status for r in results] == ["pass", "pass"], results


def test_the_loss_audit_reads_twice_once_per_fit_and_the_loop_stays_sync_free(tmp_path):
    from saferun.guards.syncs import HostSyncCounter

    counters = []
    for audit in (True, False):
        cfg = toy_config(tmp_path / str(audit), max_steps=40, log_every_n_steps=20)
        cfg["guards"] = {"model_audit": audit}
        with HostSyncCounter() as counter:
            ToyTrainer(cfg).fit()
        counters.append(counter)
    on, off = counters
    # cross_entropy: one read for the class-index range, one for "already probabilities?"
    assert (on.once, off.once) == (2, 0)
    assert on.count == off.count and on.sites == off.sites  # the loop's own syncs: unchanged


def test_bf16_log_probabilities_and_probabilities_are_told_apart_at_bf16_precision(caplog):
    """bf16 keeps 8 bits: a correct log_softmax over 50 classes misses logsumexp 0 by more than
    float32's tolerance; the tolerance follows the dtype, so it is not warned about, while raw
    bf16 scores and bf16 probabilities still are."""
    torch.manual_seed(0)
    logits = torch.randn(64, 50).bfloat16()
    y = torch.randint(0, 50, (64,))
    assert logits.float().log_softmax(1).bfloat16().float().logsumexp(1).abs().max() > 1e-3
    with caplog.at_level(logging.WARNING, logger="saferun"), LossCallAudit(1) as audit:
        F.nll_loss(logits.log_softmax(1), y)
        assert audit.warnings == []
        F.nll_loss(logits, y)
        assert len(audit.warnings) == 1 and "not log-probabilities" in audit.warnings[0]
        with pytest.raises(LossCallError, match="probabilities"):
            F.cross_entropy(logits.softmax(1), y)
