"""The model-state audit: mistakes in how a model holds its state, found around the first step.

Four mistakes train without an error and give a model that differs from the one the user
meant, or fail with torch's advice that is wrong for them:

- a submodule (or parameter) kept in a plain list, tuple or dict: `model.parameters()` does
  not see it, so the optimizer never trains it, checkpoints never save it and `.to()` never
  moves it;
- a parameter made after the optimizer was built (a layer created inside `forward`): the
  optimizer holds the parameters of the moment it was built, so the new one is never trained;
- a tensor kept as a plain attribute (not a parameter or buffer) that training changes: the
  state_dict does not hold it, so a resumed or reloaded model differs;
- a tensor that carries the autograd graph from one step into the next (an RNN's hidden state
  kept without `.detach()`): the next backward fails with "Trying to backward through the graph
  a second time", and torch's advice (`retain_graph=True`) would backpropagate through every
  earlier step instead.

`ModelAudit.at_setup` runs once when training starts; `after_first_backward` once, when the
second call of training_step begins (so after the first backward, and with one micro-batch
after the first update), and `carried_into` when that call returns (does its loss reach back
into a graph kept from the first call?). Nothing runs per step after that.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from ..data.transfer import batch_size_of
from ..errors import ModelStateError
from .loss_audit import LossCallAudit

log = logging.getLogger("saferun")

_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # _parameters, _buffers, _modules, hooks, ...
_CONTAINERS = (list, tuple, dict, set)


def _plain_values(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, value) of the attributes a module holds outside parameters, buffers and
    submodules, with the items of plain containers one level down (name[i], name['k'])."""
    for name, value in vars(module).items():
        if name in _MODULE_INTERNALS:
            continue
        yield name, value
        yield from _items(name, value)


def _items(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{name}[{k!r}]", v
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield f"{name}[{i}]", v
    elif isinstance(value, (set, frozenset)):
        for i, v in enumerate(value):
            yield f"{name}{{item {i}}}", v


def _held_deeper(module: nn.Module, depth: int = 4) -> Iterator[tuple[str, Any]]:
    """Like `_plain_values`, also into containers inside containers (to `depth` levels) and
    into the attributes of plain objects the module holds (an instance of the user's own
    class that is not a Module): where a module or parameter is out of the model's sight."""
    stack = [(name, value, depth) for name, value in vars(module).items()
             if name not in _MODULE_INTERNALS]
    budget = 100_000  # values looked at: a model holding a large plain structure stays quick
    while stack and budget:
        budget -= 1
        name, value, left = stack.pop()
        yield name, value
        if left == 0 or isinstance(value, (nn.Module, torch.Tensor)):
            continue
        if isinstance(value, (dict, list, tuple, set, frozenset)):
            stack.extend((n, v, left - 1) for n, v in _items(name, value))
        elif _plain_object(value):
            stack.extend((f"{name}.{k}", v, left - 1) for k, v in vars(value).items())


def _plain_object(value: Any) -> bool:
    """An instance of a user's class with attributes (not a type, function or module)."""
    return (hasattr(value, "__dict__") and not isinstance(value, type)
            and not callable(value) and type(value).__module__ not in ("builtins", "types"))


def _where(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def hidden_modules(model: nn.Module) -> list[tuple[str, nn.Module | nn.Parameter]]:
    """Submodules and parameters held in plain containers and not registered anywhere in the
    model: ('path.attr[i]', the module or parameter)."""
    registered = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}
    found: dict[int, tuple[str, nn.Module | nn.Parameter]] = {}
    for path, module in model.named_modules():
        for name, value in _held_deeper(module):
            if isinstance(value, (nn.Module, nn.Parameter)) and id(value) not in registered:
                found.setdefault(id(value), (_where(path, name), value))
    # a hidden module's own submodules are not named again
    inside = {id(m) for _, v in found.values() if isinstance(v, nn.Module)
              for m in list(v.modules())[1:]} | {id(p) for _, v in found.values()
                                                 if isinstance(v, nn.Module) for p in v.parameters()}
    return sorted((item for key, item in found.items() if key not in inside), key=lambda i: i[0])


def hidden_layers_advice(model: nn.Module) -> str:
    """For a model without parameters that model.parameters() sees: where its layers are held
    instead, and the fix ("" if none are found)."""
    hidden = hidden_modules(model)
    if not hidden:
        return ""
    names = ", ".join(repr(n) for n, _ in hidden[:3]) + (f" ({len(hidden)} in all)" if len(hidden) > 3 else "")
    return (f" Its layers are held where model.parameters() does not look: {names}. Use "
            f"{_fix(hidden[0][0])}.")


def plain_tensors(model: nn.Module, rows: int = 0) -> dict[str, tuple[int, int]]:
    """'path.attr' -> (id, version) of every tensor a module holds as a plain attribute; with
    `rows` (the batch's samples), not those with one row per sample: the data of a batch (a
    detached copy of a forward's output, attention maps kept to look at) is not the model's
    state, which does not grow with the batch."""
    found = {}
    for path, module in model.named_modules():
        for name, value in _plain_values(module):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                    and not (rows > 1 and value.ndim >= 1 and value.shape[0] == rows):
                found[_where(path, name)] = (id(value), _version(value))
    return found


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return -1


def graph_carriers(model: nn.Module) -> list[str]:
    """'path.attr' of the plain tensor attributes that hold an autograd graph."""
    return list(_graph_nodes(model))


def _graph_nodes(model: nn.Module) -> dict[str, Any]:
    """'path.attr' -> grad_fn of the plain tensor attributes that hold an autograd graph."""
    return {_where(path, name): value.grad_fn for path, module in model.named_modules()
            for name, value in _plain_values(module)
            if isinstance(value, torch.Tensor) and value.grad_fn is not None}


def _reached(output: Any, nodes: dict[str, Any], limit: int = 200_000) -> list[str]:
    """The names in `nodes` whose graph node the autograd graph of `output`'s tensors reaches
    (at most `limit` nodes are visited: a first step's graph is far smaller)."""
    wanted = {id(node): name for name, node in nodes.items()}
    stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
    seen: set[int] = set()
    found = []
    while stack and len(seen) < limit:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in wanted:
            found.append(wanted[id(node)])
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def carried_graph_advice(names: list[str]) -> str:
    """What to say about tensors that carry a step's graph into the next."""
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" ({len(names)} in all)" if len(names) > 3 else "")
    return (f"the model keeps {shown} as a plain attribute holding the autograd graph of an "
            f"earlier step, so the next backward reaches back into that step's freed graph. "
            f"Detach it where it is stored (self.hidden = h.detach()): gradients then stop at "
            f"the step boundary (truncated backpropagation through time). Do not add "
            f"retain_graph=True, which would backpropagate through every earlier step and keep "
            f"their graphs in memory. To keep it in checkpoints too, make it a buffer "
            f"(register_buffer) and assign the detached tensor to it.")


class ModelAudit:
    """Looks at the model when training starts and once after the first backward."""

    def __init__(self, model: nn.Module, optimized: list[nn.Parameter], check_new_params: bool
                 ) -> None:
        self.model = model
        self.optimized = {id(p) for p in optimized}
        self.check_new_params = check_new_params  # FSDP swaps parameters while it gathers them
        self.known = {id(p) for p in model.parameters()}
        self.hidden = hidden_modules(model)
        self.tensors = plain_tensors(model)
        self._carried: dict[str, Any] = {}
        self._one_sample: dict[str, tuple[int, ...]] = {}  # a BatchNorm's input of one sample
        self._norm_hooks: list[Any] = []

    def at_setup(self) -> list[str]:
        """Warn about trainable modules or parameters in plain containers (they may be a frozen
        teacher kept out of the model on purpose: a gradient reaching them is refused later);
        watch the first step's BatchNorm inputs (see `after_first_backward`)."""
        for name, module in self.model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                self._norm_hooks.append(module.register_forward_pre_hook(
                    functools.partial(self._norm_input, name)))
        warnings = []
        for name, value in self.hidden:
            params = [value] if isinstance(value, nn.Parameter) else list(value.parameters())
            if any(p.requires_grad for p in params):
                kind = "parameter" if isinstance(value, nn.Parameter) else type(value).__name__
                warnings.append(
                    f"model attribute '{name}' holds a trainable {kind} in a plain Python "
                    f"{_container_kind(name)}: model.parameters() does not see it, so it is not "
                    f"trained, not saved in checkpoints or model.pt, and not moved by .to(). "
                    f"Use {_fix(name)}. If it is kept out of the model on purpose (a frozen "
                    f"teacher), call requires_grad_(False) on it.")
        for warning in warnings:
            log.warning("%s", warning)
        return warnings

    def _norm_input(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if module.training and isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[0] == 1:
            self._one_sample.setdefault(name, tuple(x.shape))

    def _norms_of_one_sample(self, step: int) -> list[str]:
        for handle in self._norm_hooks:
            handle.remove()
        self._norm_hooks = []
        if not self._one_sample:
            return []
        shown = ", ".join(f"'{n}' (input {list(s)})" for n, s in list(self._one_sample.items())[:3])
        return [f"at step {step}, BatchNorm {shown} normalised a batch of one sample in training "
                f"mode: its statistics (and its running mean and variance) are one sample's, "
                f"noise rather than the batch's. Raise the samples per forward "
                f"(trainer.batch_size; with trainer.accumulate, each micro-batch is one "
                f"forward), call the model on the whole batch rather than sample by sample, or "
                f"use GroupNorm/LayerNorm, which do not depend on the batch."]

    def after_first_backward(self, step: int, rows: int = 0,
                             holders: Optional[Mapping[str, Any]] = None) -> list[str]:
        """Refuse what cannot train as meant; warn about state checkpoints lose and graphs
        kept alive. Returns the warnings. `rows`: the samples in the first batch (a tensor
        attribute with one row per sample is a forward's output kept to look at, not state);
        `holders`: the Trainer's attributes (a graph kept there, in a list of losses, say)."""
        errors = self._untrained(step)
        # A tensor attribute still holding the first call's graph is a mistake only if the
        # second call's loss reaches back into it (an RNN state kept without detach); one that
        # the next forward overwrites (a KL term, attention weights kept to look at, a
        # re-parametrized weight) is not: `carried_into` decides after that call.
        self._carried = _graph_nodes(self.model)
        if errors:
            raise ModelStateError(f"the model-state audit after the first backward (at step "
                                  f"{step}): " + "\n".join(errors))
        warnings = (self._changed_plain_tensors(step, rows) + graphs_held(holders or {}, step)
                    + self._norms_of_one_sample(step))
        for warning in warnings:
            log.warning("%s", warning)
        return warnings

    def carried_into(self, output: Any, step: int) -> None:
        """After the second training_step call: refuse if what it returned (its loss) reaches
        the graph an attribute kept from the first call, naming the attribute."""
        carried, self._carried = self._carried, {}
        reached = _reached(output, carried) if carried else []
        if reached:
            raise ModelStateError(f"the model-state audit after the first backward (at step "
                                  f"{step}): {carried_graph_advice(reached)}")

    def _untrained(self, step: int) -> list[str]:
        errors = []
        reached = [name for name, value in self.hidden for p in (
            [value] if isinstance(value, nn.Parameter) else value.parameters())
            if p.grad is not None]
        if reached:
            names = sorted(set(reached))
            errors.append(
                f"the loss reached parameters held in plain Python containers "
                f"({', '.join(repr(n) for n in names[:3])}), which no optimizer steps and no "
                f"checkpoint saves. Use {_fix(names[0])}.")
        if self.check_new_params:
            new = [n for n, p in self.model.named_parameters()
                   if id(p) not in self.known and id(p) not in self.optimized]
            if new:
                errors.append(
                    f"parameters {', '.join(repr(n) for n in new[:3])}"
                    f"{f' ({len(new)} in all)' if len(new) > 3 else ''} appeared after the "
                    f"optimizer was built (a layer created inside forward?): the optimizer never "
                    f"updates them, and a fresh layer is made at every call. Create every layer "
                    f"in __init__ (or use torch's lazy modules, e.g. nn.LazyLinear, when a size "
                    f"is known only from the first batch).")
        return errors

    def _changed_plain_tensors(self, step: int, rows: int) -> list[str]:
        now = plain_tensors(self.model, rows)
        outputs = self._carried  # a forward's output kept (a KL term): not state
        changed = [name for name, (ident, version) in now.items()
                   if name not in outputs and (
                       name not in self.tensors or self.tensors[name][0] != ident
                       or (version != -1 and self.tensors[name][1] != version))]
        if not changed:
            return []
        shown = ", ".join(f"'{n}'" for n in changed[:3])
        return [f"training changed {shown}{f' ({len(changed)} in all)' if len(changed) > 3 else ''}"
                f" by step {step}, held as plain tensor attributes (not parameters or buffers): "
                f"checkpoints and model.pt do not hold them, so a resumed or reloaded model "
                f"differs, and .to() does not move them. Register each as a buffer "
                f"(self.register_buffer(name, tensor), persistent=False for a cache that is "
                f"recomputed anyway)."]


def graphs_held(holders: Mapping[str, Any], step: int) -> list[str]:
    """The tensors holding an autograd graph in `holders` (the Trainer's attributes), directly
    or in lists, tuples and dicts: after the first backward, each keeps a step's activations
    in memory, and a list of them one more step's with each step."""
    found = [path for name, value in holders.items() for path, _ in _graph_tensors(value, name, 3)]
    if not found:
        return []
    return [f"after the first backward (at step {step}), {', '.join(repr(f) for f in found[:3])}"
            f"{f' ({len(found)} in all)' if len(found) > 3 else ''} on the Trainer "
            f"hold{'s' if len(found) == 1 else ''} a tensor with its autograd graph: every "
            f"activation of that step stays in memory (in a list, one more step's with each "
            f"step, until memory runs out). Keep loss.detach() instead (saferun logs the loss "
            f"itself; read values at log points)."]


def _graph_tensors(value: Any, path: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield path, value
    elif depth and isinstance(value, Mapping):
        for k, v in list(value.items())[:64]:
            yield from _graph_tensors(v, f"{path}[{k!r}]", depth - 1)
    elif depth and isinstance(value, (list, tuple)):
        for i, v in enumerate(value[:64]):
            yield from _graph_tensors(v, f"{path}[{i}]", depth - 1)


def _container_kind(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    if "[" not in last and "{" not in last:
        return "object (not an nn.Module)"
    return "set" if "{" in name else "dict" if "['" in name else "list or tuple"


def _fix(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    if "[" not in last and "{" not in last:  # held by a plain object's attribute
        return "an nn.Module for the object that holds it (then it is registered)"
    return "nn.ModuleDict (nn.ParameterDict)" if "['" in name else "nn.ModuleList (nn.ParameterList)"



class FirstStepAudits:
    """guards.model_audit in the step frame (loop/frame.py): the first `training_step` call runs
    under the loss-call audit (guards/loss_audit.py; not under trainer.compile, whose compiled
    forward a function mode cannot see into), the second begins with the state audit (after
    the first backward) and ends with the check of what it returned; then it is done and later
    steps pay nothing. `holders()`: the Trainer's attributes (a graph kept there)."""

    def __init__(self, audit: ModelAudit, loss_audit: bool,
                 holders: Callable[[], Mapping[str, Any]]) -> None:
        self._audit, self._loss_audit, self._holders = audit, loss_audit, holders
        self._calls = 0
        self.done = False

    def __call__(self, call: Callable[[Any], Any], batch: Any, step: int) -> Any:
        self._calls += 1
        if self._calls == 1:
            try:
                if not self._loss_audit:
                    return call(batch)
                with LossCallAudit(step):
                    return call(batch)
            except BaseException:
                self.done = True  # the run ends here; an explanation replays the step unaudited
                raise
        self.done = True
        self._audit.after_first_backward(step, batch_size_of(batch), self._holders())
        out = call(batch)
        self._audit.carried_into(out, step)
        return out
