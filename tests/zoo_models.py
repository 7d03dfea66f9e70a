"""A zoo of real architectures: Hugging Face `transformers` models built from tiny configs with
random weights (nothing downloaded), each trained as its users train it: `self.model(**batch)`,
the loss the model computes from `labels`.

`ZooTrainer.arch` names the architecture; `zoo_trainer(arch)` makes a Trainer class for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

import saferun

VOCAB, SEQ, CLASSES = 64, 8, 3
TEXT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64)


@dataclass
class Arch:
    model: str
    """transformers class name."""
    config: Callable[[], Any]
    sample: Callable[[torch.Generator, int], dict[str, torch.Tensor]]
    """One sample (a dict of tensors, no batch dimension) from a generator and the index."""
    call: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the model call besides the batch's fields."""


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(3, VOCAB, (SEQ,), generator=g)


def _classify(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
    ids = _tokens(g)
    return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": ids[0] % CLASSES}


def _lm(mask: bool) -> Callable[[torch.Generator, int], dict[str, torch.Tensor]]:
    def sample(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
        ids = _tokens(g)
        out = {"input_ids": ids, "labels": ids.clone()}
        if mask:
            out["attention_mask"] = torch.ones(SEQ, dtype=torch.long)
        return out
    return sample


def _seq2seq(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
    ids = _tokens(g)
    return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": ids.flip(0)}


def _image(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
    label = int(torch.randint(0, CLASSES, (), generator=g))
    x = torch.randn(3, 16, 16, generator=g) * 0.5 + (label - 1)
    return {"pixel_values": x, "labels": torch.tensor(label)}


def _whisper(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
    ids = _tokens(g)[:4]
    return {"input_features": torch.randn(8, 16, generator=g) + ids[0].float() / VOCAB,
            "labels": ids}


def _audio(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
    label = int(torch.randint(0, CLASSES, (), generator=g))
    return {"input_values": torch.randn(400, generator=g) * (1 + label), "labels": torch.tensor(label)}


def _clip(g: torch.Generator, i: int) -> dict[str, torch.Tensor]:
    return {"input_ids": _tokens(g), "pixel_values": torch.randn(3, 16, 16, generator=g)}


def _cfg(name: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        import transformers

        return getattr(transformers, name)(**kw)
    return make


_LLAMA = dict(TEXT, num_key_value_heads=1, max_position_embeddings=64)
ARCHS: dict[str, Arch] = {
    "bert": Arch("BertForSequenceClassification",
                 _cfg("BertConfig", **TEXT, num_labels=CLASSES), _classify),
    "distilbert": Arch("DistilBertForSequenceClassification",
                       _cfg("DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2,
                            hidden_dim=64, num_labels=CLASSES), _classify),
    "roberta": Arch("RobertaForSequenceClassification",
                    _cfg("RobertaConfig", **TEXT, num_labels=CLASSES, max_position_embeddings=32),
                    _classify),
    "gpt2": Arch("GPT2LMHeadModel", _cfg("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2,
                                         n_head=2, n_positions=32), _lm(mask=False)),
    "llama": Arch("LlamaForCausalLM", _cfg("LlamaConfig", **_LLAMA), _lm(mask=True)),
    "llama-nomask": Arch("LlamaForCausalLM", _cfg("LlamaConfig", **_LLAMA), _lm(mask=False)),
    "qwen2": Arch("Qwen2ForCausalLM", _cfg("Qwen2Config", **_LLAMA), _lm(mask=True)),
    "mixtral": Arch("MixtralForCausalLM", _cfg("MixtralConfig", **_LLAMA, num_local_experts=4,
                                               num_experts_per_tok=2), _lm(mask=True)),
    "switch": Arch("SwitchTransformersForConditionalGeneration",
                   _cfg("SwitchTransformersConfig", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64,
                        num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=4,
                        encoder_sparse_step=1, decoder_sparse_step=1, decoder_start_token_id=0,
                        pad_token_id=0), _seq2seq),
    "t5": Arch("T5ForConditionalGeneration",
               _cfg("T5Config", vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                    num_heads=2, decoder_start_token_id=0, pad_token_id=0), _seq2seq),
    "bart": Arch("BartForConditionalGeneration",
                 _cfg("BartConfig", vocab_size=VOCAB, d_model=32, encoder_layers=2,
                      decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                      encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32),
                 _seq2seq),
    "vit": Arch("ViTForImageClassification",
                _cfg("ViTConfig", image_size=16, patch_size=4, hidden_size=32,
                     num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     num_labels=CLASSES), _image),
    "resnet": Arch("ResNetForImageClassification",
                   _cfg("ResNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                        num_labels=CLASSES), _image),
    "whisper": Arch("WhisperForConditionalGeneration",
                    _cfg("WhisperConfig", vocab_size=VOCAB, num_mel_bins=8, d_model=32,
                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_source_positions=8, max_target_positions=16,
                         decoder_start_token_id=1, pad_token_id=0), _whisper),
    "wav2vec2": Arch("Wav2Vec2ForSequenceClassification",
                     _cfg("Wav2Vec2Config", vocab_size=VOCAB, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                          num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                          num_labels=CLASSES, classifier_proj_size=16), _audio),
    "clip": Arch("CLIPModel",
                 _cfg("CLIPConfig",
                      text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64,
                                       max_position_embeddings=SEQ),
                      vision_config=dict(image_size=16, patch_size=4, hidden_size=32,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64), projection_dim=16), _clip,
                 call={"return_loss": True}),
}


class ZooData(Dataset):
    def __init__(self, sample: Callable[[torch.Generator, int], dict[str, torch.Tensor]],
                 n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = [sample(g, i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


class ZooTrainer(saferun.Trainer):
    """Trains `ARCHS[arch]` the way a Hugging Face user does: `self.model(**batch).loss`."""

    arch = "bert"
    n_train, n_val = 32, 16

    def build_model(self) -> nn.Module:
        import transformers

        spec = ARCHS[self.arch]
        return getattr(transformers, spec.model)(spec.config())

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        sample = ARCHS[self.arch].sample
        return ZooData(sample, self.n_train, 0), ZooData(sample, self.n_val, 1)

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.model(**batch, **ARCHS[self.arch].call).loss

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": self.model(**batch, **ARCHS[self.arch].call).loss}


TRAINERS: dict[str, type[ZooTrainer]] = {}
for _arch in ARCHS:  # module-level classes: spawn workers and pickling find them by name
    _cls = type(f"Zoo_{_arch.replace('-', '_')}", (ZooTrainer,), {"arch": _arch})
    globals()[_cls.__name__] = TRAINERS[_arch] = _cls
