"""The step's pure helpers: splitting training_step's output, clipping, checking the optimizer,
resolving the device, explaining torch errors. No state: each is unit-tested on its own."""

from __future__ import annotations

import re

from collections.abc import Mapping  # isinstance on it is twice as fast as on typing.Mapping
import logging
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError, SaferunError
from ..text import short
from .failure_site import record
from ..guards.model_audit import graph_carriers, hidden_layers_advice
from ..guards.purity import find_inference_tensors
from .metrics import scalar_dict
from ..data.transfer import samples_in

log = logging.getLogger("saferun")
StepParts = tuple[torch.Tensor, dict[str, torch.Tensor], int]  # (loss, logs, samples)


def loss_and_logs(out: Any, step: int, need_grad: bool = True
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Split training_step's output into the loss and the extra scalars, checking both."""
    logs: dict[str, torch.Tensor] = {}
    if type(out) is not torch.Tensor and isinstance(out, Mapping):  # (abc's check is a Python call)
        if "loss" not in out:
            raise SaferunError(f"training_step returned a dict without 'loss' at step {step} "
                               f"(keys: {', '.join(map(str, out))}).")
        logs = {k: v.detach() for k, v in scalar_dict(out, "training_step").items() if k != "loss"}
        out = out["loss"]
    if not isinstance(out, torch.Tensor) or out.ndim != 0:
        got, fix = _not_a_loss(out)
        raise SaferunError(f"training_step must return a scalar loss tensor; got {got} at step "
                           f"{step}. {fix}")
    if need_grad and not out.requires_grad:
        raise SaferunError(
            f"the loss at step {step} does not require grad, so backward() cannot train anything. "
            f"Was it computed under torch.no_grad(), detached, or from frozen parameters only?")
    return out, logs


def accumulate(forward_backward: Callable[[Sequence[Any], float, bool, int], StepParts],
               micro_batches: Sequence[Any], batch_size: Callable[[Any], int]) -> StepParts:
    """trainer.accumulate > 1: each micro-batch through the one-micro-batch `forward_backward`
    (the Trainer's), its loss weighted by its share of the step's samples, so that the
    accumulated gradient equals the gradient of the whole batch's mean loss; only the last
    lets DDP average the gradients. Returns the summed (mean loss, mean logs, samples); a
    logged value that only some micro-batches report is the mean over their samples."""
    sizes = [samples_in(b, batch_size, f"micro-batch {i + 1} of {len(micro_batches)}")
             for i, b in enumerate(micro_batches)]
    total = sum(sizes)
    loss_sum: Optional[torch.Tensor] = None
    logs_sum: dict[str, torch.Tensor] = {}
    shares: dict[str, float] = {}  # per logged key: the shares of the micro-batches reporting it
    all_shares = 0.0
    for i, (batch, size) in enumerate(zip(micro_batches, sizes)):
        share = size / total if size != total else 1.0
        try:
            loss, logs, _ = forward_backward((batch,), share, i == len(sizes) - 1, size)
        except BaseException as exc:
            record(exc, micro_batch=(i, len(sizes)))
            raise
        loss_sum = loss if loss_sum is None else loss_sum + loss
        all_shares += share
        for k, v in logs.items():
            logs_sum[k] = logs_sum[k] + v if k in logs_sum else v
            shares[k] = shares.get(k, 0.0) + share
    assert loss_sum is not None
    for k, reported in shares.items():
        if reported != all_shares:  # (summed in the same order: equal when all report it)
            logs_sum[k] = logs_sum[k] / reported
    return loss_sum, logs_sum, total


def _not_a_loss(out: Any) -> tuple[str, str]:
    """(what training_step returned instead of a scalar tensor, the likely fix)."""
    if out is None:
        return "None", "Did training_step forget to `return loss`?"
    if isinstance(out, (int, float)):
        return (f"a Python {type(out).__name__} ({out!r})",
                ".item() or float() detached it from the graph, so there is nothing to "
                "backpropagate. Return the loss tensor itself (log values with .detach(); "
                "saferun reads them at log points).")
    if isinstance(out, torch.Tensor):
        return (f"shape {tuple(out.shape)}", "Reduce it over the batch, e.g. loss.mean() (or "
                "reduction='mean' in the loss function).")
    return type(out).__name__, "Return the loss tensor, or a dict with 'loss'."


def explained(exc: BaseException, step: int, model: nn.Module) -> Optional[SaferunError]:
    """A bare torch error that saferun can explain, rewritten with the fix; else None."""
    if isinstance(exc, RuntimeError) and "Inference tensors cannot be saved" in str(exc):
        held = [f.split(" (")[0] for f in find_inference_tensors(model) if f.startswith("attribute")]
        named = f" The model holds: {', '.join(held[:3])}." if held else ""
        return SaferunError(
            f"step {step}: a tensor created during evaluation, which runs under "
            f"torch.inference_mode(), was used in training (typically a cache or attribute set in "
            f"forward or validation_step).{named} Store a .clone() made outside inference mode "
            f"(or recompute it in training), or set trainer.eval_grad_mode=no_grad."
        )
    if type(exc) is RuntimeError and "backward through the graph a second time" in str(exc):
        if graph_carriers(model):  # diagnose/explain.py names the attribute, the module, the line
            return None
        return SaferunError(
            f"step {step}: autograd refused saferun's backward: part of this loss's graph was "
            f"already backpropagated through and freed. If training_step (or code it calls) "
            f"ran loss.backward() itself, remove it, with any optimizer.step() and zero_grad(), "
            f"and return the loss: saferun runs the backward and the step (with several "
            f"optimizers, call self.optimize(name, loss) for each). Otherwise a tensor kept from "
            f"an earlier step (a cache, a recurrent hidden state) links this loss to that step's "
            f"freed graph: store it .detach()ed.")
    collate = re.search(r"default_collate: batch must contain .*; found (.+)", str(exc))
    if collate:  # in this process, or a worker's error re-raised here
        return SaferunError(
            f"step {step}: the DataLoader's default collate cannot batch a sample holding "
            f"{collate.group(1).strip()} (it batches tensors, NumPy arrays, numbers, strings, and "
            f"dicts, lists and tuples of them). Convert it in the dataset's __getitem__ (a PIL "
            f"image: torchvision.transforms.functional.pil_to_tensor, or to_tensor for floats in "
            f"[0, 1]), or give a collate_fn that batches it (the collate_fn config node, or "
            f"override build_collate_fn).")
    if "Cannot re-initialize CUDA in forked subprocess" in str(exc):
        return SaferunError(
            f"step {step}: a DataLoader worker used CUDA (a .cuda() or device='cuda' in the "
            f"dataset or collate_fn). Workers started with fork cannot use CUDA once the main "
            f"process has. Return CPU tensors from the dataset: saferun moves each batch to the "
            f"device, with pinned memory and non_blocking copies.")
    return None


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer gets; an error if there are none."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        hidden = hidden_layers_advice(model)  # layers in a plain list: none are seen at all
        raise SaferunError("the model has no trainable parameters" + (
            f".{hidden}" if hidden else " (all are frozen or have requires_grad=False). Check "
            "trainer.frozen_modules."))
    return params


def check_same_parameters(model: nn.Module, built: set[int]) -> None:
    """Refuse a fit() on a model that holds a parameter it did not hold when the optimizer was
    built (`built`: their ids): `module.weight = nn.Parameter(...)` between two fit() calls.
    The optimizer would never update the new one, and train the others, silently."""
    new = [name for name, p in model.named_parameters() if id(p) not in built]
    if new:
        raise SaferunError(
            f"fit(): the model's {', '.join(repr(n) for n in new[:3])}"
            f"{f' ({len(new)} in all)' if len(new) > 3 else ''} is not the parameter the "
            f"optimizer was built with (it was replaced since, e.g. module.weight = "
            f"nn.Parameter(...)): the optimizer would never update it. Put new values into the "
            f"existing parameter instead (with torch.no_grad(): module.weight.copy_(values)), "
            f"or build a new Trainer for the changed model.")


def check_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module,
                           name: Optional[str] = None) -> None:
    """Warn (once, at setup) if the optimizer also holds frozen parameters: harmless while they
    get no gradient (torch's optimizers skip a parameter whose .grad is None, and saferun zeroes
    gradients with set_to_none=True), so it is a common fine-tuning pattern, not an error.
    `name`: which of several optimizers it is (build_optimizer's key)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SaferunError(
            f"build_optimizer returned a {type(optimizer).__name__}, not a torch.optim.Optimizer. "
            f"For several optimizers, return a dict {{name: optimizer}} and call "
            f"self.optimize(name, loss) for each in training_step.")
    frozen = {id(p): name for name, p in model.named_parameters() if not p.requires_grad}
    held = [frozen[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in frozen]
    if held:
        log.warning(
            "the optimizer%s also holds %d frozen parameters (%s). They stay unchanged: they get no "
            "gradient, and the optimizer skips parameters without one (no weight decay, no "
            "momentum, no state for them). Only if something gave them a gradient (a "
            "zero_grad(set_to_none=False)) would they move; requires_grad set back to True "
            "mid-run is refused at the next log point. To leave them out, build the optimizer "
            "from build_optimizer's params argument.",
            "" if name is None else f" {name!r} (self.optimize({name!r}, loss))", len(held),
            short(held, 3))


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto: CUDA if available, else CPU. Under torchrun, cuda means this rank's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"trainer.device: {e}. Use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device is cuda but no CUDA device is available; "
                          "use trainer.device=cpu or auto.")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device
