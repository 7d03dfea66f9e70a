"""What `self.log`, `log_image`, `log_histogram` and `log_text` collect, kept on the device until
the loop's next log point or validation end.

A value logged with reduce="mean" joins the dict training_step or validation_step returns, so it
is reduced exactly as a returned value (weighted by the micro-batch's share under accumulation,
by batch size in validation, averaged over ranks). The other reductions fold each new value into
one device tensor per name as it comes (`Folded`): no host read until the log point.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from ..callbacks import Media
from ..errors import SaferunError
from .. import distributed

REDUCTIONS = ("mean", "last", "min", "max", "sum")
_IDENTITY = {"min": float("inf"), "max": float("-inf"), "sum": 0.0, "last": 0.0}
_LIGHTNING_ARGS = {
    "on_step": "training values are reduced over each log window (trainer.log_every_n_steps); "
               "for the value of the step itself use reduce='last'",
    "on_epoch": "validation values are reduced over the whole validation set",
    "sync_dist": "saferun always reduces over the ranks under torchrun",
    "prog_bar": "the progress bar shows train/loss",
    "batch_size": "validation values are weighted by the batch size the batch_size hook gives",
}


def _fold(kind: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if kind == "min":
        return torch.minimum(old, new)
    if kind == "max":
        return torch.maximum(old, new)
    if kind == "sum":
        return old + new
    return new  # last


class Folded:
    """Values logged with reduce min, max, sum or last: name -> (reduce, value, position), where
    position (the step, or the validation batch) orders "last" across ranks."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[str, torch.Tensor, int]] = {}

    def add(self, name: str, kind: str, value: torch.Tensor, position: int) -> None:
        if name in self.values:
            value = _fold(kind, self.values[name][1], value)
        self.values[name] = (kind, value, position)

    def merge(self, other: "Folded") -> None:
        for name, (kind, value, position) in other.values.items():
            self.add(name, kind, value, position)

    def state_dict(self) -> dict[str, Any]:
        return {k: list(v) for k, v in self.values.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.values = {k: (v[0], v[1], int(v[2])) for k, v in state.items()}

    def reduced(self, device: torch.device, group: Any = None) -> dict[str, torch.Tensor]:
        """name -> the value over the ranks of `group` (None: every rank), on the device (one
        collective under torchrun):
        min, max, sum over ranks; last: the latest position's, from the lowest rank that had it."""
        keys = [f"{kind}:{name}" for name, (kind, _, _) in self.values.items()]
        keys = distributed.union(keys, group)  # the same columns on every rank
        if not keys:
            return {}
        rows = []
        for key in keys:
            kind, name = key.split(":", 1)
            if name in self.values:
                _, value, position = self.values[name]
                rows.append(torch.stack([value.to(device).float().reshape(()),
                                         torch.full((), float(position), device=device)]))
            else:
                rows.append(torch.tensor([_IDENTITY[kind], -1.0], device=device))
        mine = torch.stack(rows)  # (keys, 2): value, position
        world = distributed.dist.get_world_size(group) if distributed.dist.is_initialized() else 1
        if world == 1:
            return {k.split(":", 1)[1]: mine[i, 0] for i, k in enumerate(keys)}
        every = [torch.empty_like(mine) for _ in range(world)]
        distributed.dist.all_gather(every, mine, group=group)
        ranks = torch.stack(every)  # (world, keys, 2)
        out = {}
        for i, key in enumerate(keys):
            kind, name = key.split(":", 1)
            values, positions = ranks[:, i, 0], ranks[:, i, 1]
            if kind == "last":  # argmax: the first (lowest) rank at the latest position
                out[name] = values[(positions == positions.max()).int().argmax()]
            else:
                out[name] = getattr(values, kind)()
        return out


class Logbook:
    """The Trainer's collection of what its hooks log. `phase` says where a value goes:
    "train" (training_step), "val" (validation_step, a callback's on_evaluate) or None
    (nowhere: saferun's own replays of a step, e.g. the compile check, log nothing)."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main  # media are written on rank 0 only
        self.phase: Optional[str] = None
        self.position = 0  # the step (training) or the batch (validation) being computed
        self.reduces: dict[tuple[Optional[str], str], str] = {}  # (phase, name) -> its reduce, fixed by its first use
        self.means: dict[str, torch.Tensor] = {}  # reduce="mean", this micro-batch or batch
        self.folded = Folded()  # the other reductions, this step or this validation pass
        self.media: list[Media] = []
        self.val_names: set[str] = set()  # what this validation pass's validation_step reported
        self.closed: Optional[str] = None  # a hook after the last log point (after_fit): refused there

    # ------------------------------------------------------------------ the user's calls

    def log(self, name: str, value: Any, reduce: str, extra: Mapping[str, Any]) -> None:
        self._check_open("log", name)
        if extra:
            said = "; ".join(f"{k}: {_LIGHTNING_ARGS.get(k, 'not an argument of self.log')}"
                             for k in extra)
            raise SaferunError(f"self.log({name!r}, ...) takes a name, a value and reduce= "
                               f"(one of {', '.join(REDUCTIONS)}); got {', '.join(extra)}. {said}.")
        if reduce not in REDUCTIONS:
            raise SaferunError(f"self.log({name!r}, ..., reduce={reduce!r}): reduce is one of "
                               f"{', '.join(REDUCTIONS)}.")
        key = (self.phase, name)  # train/acc and val/acc are two metrics: each its own
        if self.reduces.setdefault(key, reduce) != reduce:
            raise SaferunError(f"self.log({name!r}) with reduce={reduce!r}, but {self.phase}/"
                               f"{name} was logged with reduce={self.reduces[key]!r} before: a "
                               f"name keeps one reduction.")
        tensor = _scalar(name, value)
        if self.phase is None:
            return
        if reduce == "mean":
            self.means[name] = tensor
        else:
            self.folded.add(name, reduce, tensor.detach().reshape(()), self.position)

    def log_media(self, kind: str, name: str, value: Any) -> None:
        self._check_open(f"log_{kind}", name)
        if self.phase is None or not self.is_main:
            return
        if kind == "text":
            if not isinstance(value, str):
                raise SaferunError(f"self.log_text({name!r}, ...) takes a str, got "
                                   f"{type(value).__name__}.")
        else:
            value = torch.as_tensor(value).detach().clone()  # the caller may change it in place
            if kind == "image" and not (2 <= value.ndim <= 3):
                raise SaferunError(f"self.log_image({name!r}, ...) takes an image (C, H, W) or "
                                   f"(H, W), got shape {tuple(value.shape)}. For several "
                                   f"images make a grid (torchvision.utils.make_grid).")
        self.media.append(Media(kind, f"{self.phase}/{name}", value))

    def _check_open(self, method: str, name: str) -> None:
        if self.closed is not None and self.phase is None:  # (test() from after_fit logs test/)
            raise SaferunError(
                f"self.{method}({name!r}, ...) in {self.closed}: {self.closed} runs after the last "
                f"log point, so nothing it logs would be written anywhere. Log it in "
                f"training_step or validation_step, or evaluate with test() (test/<name> "
                f"metrics); a value of your own after training can be printed or written into "
                f"the run directory (self.state.run_dir).")

    # ------------------------------------------------------------------ the loop's calls

    def begin(self, phase: Optional[str], position: int) -> None:
        """A hook that may log starts: `position` is its step (or validation batch)."""
        self.phase, self.position = phase, position
        self.means = {}

    def run(self, phase: str, position: int, fn: Callable[[Any], Any], arg: Any, hook: str) -> Any:
        """`fn(arg)` as `hook`, which may log, started (`begin`) and its return value `joined`:
        the step frame's one call around training_step (loop/frame.py)."""
        self.phase, self.position = phase, position
        self.means = {}
        out = fn(arg)
        if self.means or self.folded.values:
            return self.joined(out, hook)
        self.phase = None  # (`joined` with nothing logged)
        return out

    def joined(self, out: Any, hook: str) -> Any:
        """`hook`'s return value with what it self.log()ged as "mean": a loss tensor becomes
        {"loss": loss, ...}; a dict gets the values added. A name both returned and logged is
        refused; "loss" logged in training_step must be the returned loss itself (train/loss)."""
        self.phase = None
        logged, self.means = self.means, {}
        if not (logged or self.folded.values) or \
                not (out is None or isinstance(out, (torch.Tensor, Mapping))):
            return out  # (anything else: the loop's own check names the mistake)
        returned = {"loss": out} if isinstance(out, torch.Tensor) else dict(out or {})
        if "loss" in logged and logged["loss"] is returned.get("loss"):
            del logged["loss"]  # self.log("loss", loss); return loss: train/loss, once
        both = sorted((set(logged) | set(self.folded.values)) & set(returned))
        if both:
            loss = " (train/loss is the loss training_step returns)" if "loss" in both else ""
            raise SaferunError(f"{hook} both returns and self.log()s {', '.join(both)}: keep one "
                               f"of the two{loss}.")
        if not logged:
            return out
        return {**returned, **{k: v.detach().reshape(()) for k, v in logged.items()}}

    def take_folded(self) -> Folded:
        folded, self.folded = self.folded, Folded()
        return folded

    def take_step(self) -> Optional[tuple[Folded, list[Media]]]:
        """`take()` after a training step; None (and nothing built) when it logged nothing
        besides means, as most steps do."""
        return self.take() if self.folded.values or self.media else None

    def take(self) -> tuple[Folded, list[Media]]:
        """What the step or validation pass logged besides means; the book starts empty."""
        folded, media = self.folded, self.media
        self.folded, self.media = Folded(), []
        return folded, media

    def validation_step(self, step_fn: Callable[[Any], Any], prefix: str, folded: Folded
                        ) -> Callable[[Any], Any]:
        """`step_fn` (validation_step) collecting what it logs: means into its returned dict,
        the rest into `folded`; media named `prefix`/name. A validation_step that only logs
        may return None."""
        batch_index = 0
        self.val_names = set()

        def step(batch: Any) -> Any:
            nonlocal batch_index
            batch_index += 1
            self.begin(prefix, batch_index)
            out = step_fn(batch)
            if out is None and (self.means or self.folded.values):
                out = {}
            self.val_names |= set(self.folded.values)
            folded.merge(self.folded)
            self.folded = Folded()
            out = self.joined(out, "validation_step")
            self.val_names |= set(out) if isinstance(out, Mapping) else set()
            return out

        return step


def _scalar(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    if isinstance(value, str):
        raise SaferunError(f"self.log({name!r}, {value!r}) takes a number; a text is logged with "
                           f"self.log_text({name!r}, {value!r}).")
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise SaferunError(f"self.log({name!r}, ...) takes a scalar (a one-element tensor or a "
                           f"number), got {shape}. Reduce it first (e.g. .mean()), or log it "
                           f"with self.log_histogram.")
    return value  # (detached where it is kept: the identity of a logged loss is compared)



class EvalLog:
    """The Trainer's logging methods, handed to a callback's `on_evaluate`: what it logs is
    reported with the validation (val/<name>, at the validation's step)."""

    def __init__(self, book: Logbook) -> None:
        self._book = book

    def log(self, name: str, value: Any, reduce: str = "mean") -> None:
        """A scalar, as `Trainer.log` (reduce over the ranks that ran the callback)."""
        if name in self._book.val_names:
            raise SaferunError(f"on_evaluate logs {name!r}, which validation_step reports too "
                               f"(val/{name}): rename one of them.")
        self._book.log(name, value, reduce, {})

    def log_image(self, name: str, image: Any) -> None:
        self._book.log_media("image", name, image)

    def log_histogram(self, name: str, values: Any) -> None:
        self._book.log_media("histogram", name, values)

    def log_text(self, name: str, text: str) -> None:
        self._book.log_media("text", name, text)
