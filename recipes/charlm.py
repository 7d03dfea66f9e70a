"""Charlm: a character-level causal Transformer trained on Python's own standard library.

Launch:   saferun run recipe=charlm
Expected: validation loss about 2.0 bits per character (val/bpc below 2.15)
          after 1500 steps, 3-5 minutes on one CPU core; then it prints a
          200-character sample that looks like Python (indentation, `def`,
          `return`, names, docstrings), though not like working code.
          On a busy machine with few cores, trainer.num_threads=1 can be several
          times faster than one thread per core (saferun's auto plan sees the
          cores this process may use, not the other work on them).

Everything specific to the task is in this file: the corpus (the sources of a
fixed list of standard-library modules, read from this Python's installation,
so nothing is downloaded), the character vocabulary, the model and the
training and validation steps. The corpus is the first `max_chars` characters
of those files in order; the last `val_fraction` of it is the validation set,
split by position so no validation text is seen in training. Training reads
windows at random positions, validation the held-out tail in consecutive
windows. The text of the standard library changes between Python releases, so
the exact numbers do too. The loop, its discipline and its safety checks come
from saferun.Trainer. Copy it with `saferun new DIR --from charlm`.
"""

from __future__ import annotations

import math
import random
import sysconfig
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import saferun
import saferun.modes

# Modules present as plain files in every CPython since 3.10, sorted so the corpus is stable.
STDLIB_FILES = (
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "code.py",
    "codecs.py", "collections/__init__.py", "configparser.py", "contextlib.py", "copy.py",
    "csv.py", "dataclasses.py", "difflib.py", "dis.py", "enum.py", "fnmatch.py", "fractions.py",
    "functools.py", "getopt.py", "glob.py", "heapq.py", "inspect.py", "json/decoder.py",
    "json/encoder.py", "logging/__init__.py", "os.py", "pprint.py", "queue.py", "random.py",
    "shlex.py", "shutil.py", "statistics.py", "tempfile.py", "textwrap.py", "threading.py",
    "tokenize.py", "traceback.py", "typing.py", "warnings.py", "weakref.py",
)
# Newline plus printable ASCII (96 symbols); any other character is read as FALLBACK.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
FALLBACK = "?"
INDEX = {c: i for i, c in enumerate(VOCAB)}


def encode(text: str) -> torch.Tensor:
    """Characters to vocabulary indices, (len(text),) int64."""
    fallback = INDEX[FALLBACK]
    return torch.tensor([INDEX.get(c, fallback) for c in text], dtype=torch.long)


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def read_corpus(files: Optional[Sequence[str]], max_chars: int) -> str:
    """The first `max_chars` characters of `files` (default: STDLIB_FILES) joined in order.

    Relative paths are under the standard-library directory. A missing default
    file is skipped (a future Python may move a module); a missing given one raises.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for name in STDLIB_FILES if files is None else files:
        path = root / name  # an absolute `name` replaces root
        if not path.is_file():
            if files is None:
                continue
            raise ValueError(f"no such file: {path}")
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharDataset(Dataset):
    """(input, target) windows of `context` characters; the target is the input shifted by one.

    With `samples` set, each item is a window at a random position (a virtual
    epoch of `samples` items); with None, the text is cut into consecutive
    non-overlapping windows, the same every time (for validation).
    """

    def __init__(self, ids: torch.Tensor, context: int, samples: Optional[int]) -> None:
        self.ids = ids  # (N,)
        self.context = context
        self.samples = samples

    def __len__(self) -> int:
        return self.samples if self.samples is not None else (len(self.ids) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.samples is not None:
            # Python's global RNG, which saferun seeds per DataLoader worker and epoch.
            start = random.randrange(len(self.ids) - self.context)
        else:
            start = i * self.context
        window = self.ids[start : start + self.context + 1]  # (T + 1,)
        return window[:-1], window[1:]


def datasets(context: int = 64, max_chars: int = 1_000_000, val_fraction: float = 0.1,
             samples_per_epoch: int = 100_000, files: Optional[list[str]] = None
             ) -> tuple[CharDataset, CharDataset]:
    """The corpus, encoded and split by position: the first part trains, the tail validates."""
    ids = encode(read_corpus(files, max_chars))
    n_val = int(len(ids) * val_fraction)
    if n_val <= context or len(ids) - n_val <= context:
        raise ValueError(f"the corpus has {len(ids)} characters, too few for context {context} "
                         f"and val_fraction {val_fraction}; raise max_chars or add files.")
    return (CharDataset(ids[:-n_val], context, samples=samples_per_epoch),
            CharDataset(ids[-n_val:], context, samples=None))


class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention, then an MLP, each residual.

    `qkv`'s outputs are grouped by head (each head's query, key and value side by side), so
    that tensor parallel, splitting them in contiguous parts, gives each rank whole heads."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads}).")
        self.heads, self.head_dim = heads, d_model // heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads, 3, head_dim); under tensor parallel this rank's heads only
        qkv = self.qkv(self.norm1(x)).view(B, T, -1, 3, self.head_dim)
        q, k, v = qkv.transpose(1, 2).unbind(3)  # each (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A small GPT: token + learned position embeddings, `layers` blocks, a linear head."""

    def __init__(self, context: int = 64, d_model: int = 96, layers: int = 2, heads: int = 4,
                 vocab_size: int = len(VOCAB)) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) indices, T <= context -> (B, T, vocab_size) next-character logits."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)  # (B, T, C)
        return self.head(self.norm(self.blocks(x)))


class CharLMTrainer(saferun.Trainer):
    """Next-character cross-entropy; validation reports loss (nats) and bits per character.

    After training, `fit()` prints a sample of `sample_chars` characters (0: none).
    """

    model: CharTransformer  # the `model` node's network, built by setup()

    def __init__(self, cfg: Any = None, callbacks: Sequence[saferun.Callback] = (),
                 sample_chars: int = 200, sample_prompt: str = "def ",
                 temperature: float = 0.8) -> None:
        super().__init__(cfg, callbacks)
        self.sample_chars = sample_chars
        self.sample_prompt = sample_prompt
        self.temperature = temperature

    def tokens_per_sample(self) -> Optional[int]:
        """A window's characters: each is a next-character prediction (perf/tokens_per_sec)."""
        return getattr(self.train_loader.dataset if self.train_loader else None, "context", None)

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """trainer.strategy=mesh: tensor parallel over mesh["tp"] (Megatron's plan): in each
        block, qkv and the MLP's first layer split by output (whole heads per rank), proj and
        the MLP's last layer by input, their outputs summed over the group. The embeddings,
        norms and head stay whole on every rank (FSDP2 shards them over "dp_shard")."""
        tp = mesh["tp"]
        if tp.size() == 1:
            return model
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        for i, block in enumerate(cast(nn.Sequential, model.blocks)):
            if block.heads % tp.size():
                raise saferun.ConfigError(
                    f"trainer.parallel.tp={tp.size()} does not divide model.heads={block.heads} "
                    f"(block {i}): each rank must hold whole attention heads. Choose tp among "
                    f"the divisors of model.heads.")
            parallelize_module(block, tp, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                           "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
        return model

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch  # (B, T) each
        logits = self.model(inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]
                        ) -> Mapping[str, torch.Tensor]:
        inputs, targets = batch
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())
        # Linear in the loss, so saferun's batch-size-weighted mean of it is exact.
        return {"loss": loss, "bpc": loss / math.log(2)}

    def after_fit(self, metrics: dict[str, float]) -> None:
        """Once trained: print a sample from the model."""
        if self.sample_chars > 0:
            text = self.sample(self.sample_chars)  # under fsdp every rank runs the model
            if self.ranks.is_main:
                print(f"saferun: charlm sample:\n{self.sample_prompt}{text}", flush=True)

    def sample(self, n: int) -> str:
        """`n` characters continuing `sample_prompt`, drawn with a generator seeded by cfg.seed."""
        generator = torch.Generator(self.device).manual_seed(self.cfg.seed)
        ids = encode(self.sample_prompt).to(self.device)[None]  # (1, T)
        # Eval mode and inference_mode; every module's train/eval flag is restored afterwards.
        with saferun.modes.evaluating(self.model, self.cfg.trainer.eval_grad_mode):
            for _ in range(n):
                logits = self.model(ids[:, -self.model.context:])[0, -1]  # (V,)
                probs = F.softmax(logits / self.temperature, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)  # (1,)
                ids = torch.cat([ids, next_id[None]], dim=1)
        return decode(ids[0, len(self.sample_prompt):].tolist())
