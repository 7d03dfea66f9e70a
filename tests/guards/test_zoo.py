"""The guards and `saferun check` on real architectures (issue 33): Hugging Face models that no one
here wrote, built from tiny configs with random weights (tests/zoo_models.py), trained as their
users train them (`self.model(**batch).loss`). Each trains under the default guards and
guards=strict without a warning, and `saferun check` gives no FAIL and no WARN that is not true.

The default run covers an encoder, a decoder with rotary positions, a mixture of experts, an
encoder-decoder, a vision and an audio model; the rest run with `-m slow`."""

import logging
import warnings

import pytest

pytest.importorskip("transformers")

from saferun.config import load_config  # noqa: E402
from saferun.check import run_checks  # noqa: E402
from toys import toy_config  # noqa: E402
from zoo_models import ARCHS, TRAINERS  # noqa: E402

DEFAULT = ["bert", "llama", "mixtral", "t5", "vit", "wav2vec2"]
SLOW = [a for a in ARCHS if a not in DEFAULT]

# WARNs that are true, and why. A host sync in transformers' mask code is one on CUDA too: it
# reads attention_mask.all() to skip an all-ones mask (leaving the mask out removes it).
_MASK_SYNC = "transformers reads attention_mask.all() every forward: a real sync on CUDA"
TRUE_WARNINGS: dict[str, dict[str, str]] = {
    arch: {"host syncs": _MASK_SYNC}
    for arch in ("bert", "distilbert", "roberta", "llama", "qwen2", "mixtral", "t5", "bart")
}
# The Switch router reads each chosen expert's index into Python to pick the expert module
# (self[f"expert_{expert_idx[0]}"]): one real sync per expert and layer on CUDA too.
TRUE_WARNINGS["switch"] = {"host syncs": "the router reads expert indices into Python"}


def zoo_config(tmp_path, **top):
    cfg = toy_config(tmp_path, max_steps=4, batch_size=8, log_every_n_steps=2)
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-2}
    cfg.update(top)
    return load_config(cfg)


def _fit_without_warnings(arch, tmp_path, caplog, **top):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="saferun"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python warning raised while training fails the test
        TRAINERS[arch](zoo_config(tmp_path, **top)).fit()
    said = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("saferun")]
    assert not said, f"{arch}: {said}"


def _zoo(arch, tmp_path, caplog):
    _fit_without_warnings(arch, tmp_path / "default", caplog)
    _fit_without_warnings(arch, tmp_path / "strict", caplog,
                          guards={"spikes": "raise", "check_params": True, "anomaly_replay": True})
    found = run_checks(lambda c: TRAINERS[arch](c), zoo_config(tmp_path / "check"))
    true = TRUE_WARNINGS.get(arch, {})
    wrong = [str(r) for r in found if r.status == "fail" or (r.status == "warn" and r.name not in true)]
    assert not wrong, f"{arch}:\n" + "\n".join(wrong)
    # Each check that can test these models tests them (never "not checked" where it could).
    by_name = {r.name: r for r in found}
    for name in ("batch independence", "input baseline"):
        assert "not checked" not in by_name[name].finding, f"{arch}: {by_name[name]}"
    return by_name


@pytest.mark.parametrize("arch", DEFAULT)
def test_zoo_trains_and_checks_clean(arch, tmp_path, caplog):
    _zoo(arch, tmp_path, caplog)


@pytest.mark.slow
@pytest.mark.parametrize("arch", SLOW)
def test_zoo_trains_and_checks_clean_slow(arch, tmp_path, caplog):
    _zoo(arch, tmp_path, caplog)
