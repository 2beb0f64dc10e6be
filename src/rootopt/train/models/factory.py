"""The model a config asks for: built-in or ``transformers``, its vocabulary resolved from
the data's tokenizer, the settings a resume must match, and its repeated blocks (FSDP2)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from rootopt.config import Config, ModelConfig
from rootopt.train.models.builtin import LlamaLM, MLPClassifier


def data_vocab(manifest: dict[str, Any]) -> int:
    """The vocabulary of the data's tokenizer (byte tokens and older manifests: 256)."""
    from rootopt.data.tokenizer import vocab_size_of

    return vocab_size_of(manifest)


def token_ids(manifest: dict[str, Any]) -> dict[str, int | None]:
    """The tokenizer's special token ids a model config records (``eos``: the
    end-of-document id; None when the tokenizer has none, as byte tokens)."""
    from rootopt.data.tokenizer import record_of

    eos = record_of(manifest).get("eos_id")
    ok = isinstance(eos, int) and not isinstance(eos, bool)
    return {"bos": None, "eos": eos if ok else None, "pad": None}


def resolve_vocab(cfg: ModelConfig, manifest: dict[str, Any]) -> int:
    """The model's vocabulary: the data tokenizer's, unless the config names a larger one
    (``model.vocab_size``, or for kind hf the ``vocab_size`` of its config.json); a
    smaller one is a :class:`ValueError` naming where it was set."""
    if cfg.kind == "mlp":
        return cfg.vocab_size
    have = data_vocab(manifest)
    from rootopt.train.models.transformers_lm import named_vocab

    named, where = named_vocab(cfg)
    if named and named < have:
        raise ValueError(
            f"{where}: {named} is smaller than the data's vocabulary ({have} tokens, from "
            f"its tokenizer); name {have} or more, or set model.vocab_size=0 for the tokenizer's"
        )
    return named or have


def with_vocab(cfg: Config, manifest: dict[str, Any]) -> Config:
    """``cfg`` with ``model.vocab_size`` resolved (:func:`resolve_vocab`): what the run's
    config.yaml and every checkpoint record, so a checkpoint of the byte default (256)
    resumes under a config that leaves the vocabulary to the tokenizer."""
    if cfg.model.kind == "mlp":
        return cfg
    model = dataclasses.replace(cfg.model, vocab_size=resolve_vocab(cfg.model, manifest))
    return dataclasses.replace(cfg, model=model)


def resume_key(model: dict[str, Any]) -> dict[str, Any]:
    """The model settings a checkpoint must match to be resumed: every key that shapes the
    parameters or the function, with this build's default for keys an older checkpoint
    lacks. Not part of it: recomputation (``activation_checkpointing``), the weights a new
    run starts from (``init_from``), the path of ``hf_config`` (checkpoints of kind hf
    record its content, compared separately), and the vocabulary of a classifier."""
    out = {**dataclasses.asdict(ModelConfig()), **model}
    for key in ("activation_checkpointing", "init_from", "hf_config"):
        out.pop(key, None)
    if out.get("kind") == "mlp":
        out.pop("vocab_size", None)
    return out


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a model (FSDP2 wraps each), [] for others."""
    if isinstance(model, LlamaLM):
        return list(model.blocks)
    from rootopt.train.models.transformers_lm import HFCausalLM, decoder_blocks

    if isinstance(model, HFCausalLM):
        return decoder_blocks(model.hf)
    return []


def build_model(cfg: ModelConfig, manifest: dict[str, Any], seq_len: int) -> nn.Module:
    """The model ``cfg`` describes for this data (its vocabulary resolved from the data's
    tokenizer, :func:`resolve_vocab`); :class:`ValueError` with one line when they do not fit."""
    if cfg.kind in ("llama", "hf"):
        if manifest.get("task") != "lm":
            raise ValueError(
                f"model.kind={cfg.kind} needs language-model shards; these are "
                f"{manifest.get('task')!r}"
            )
        cfg = dataclasses.replace(cfg, vocab_size=resolve_vocab(cfg, manifest))
        if cfg.kind == "hf":
            from rootopt.train.models.transformers_lm import build_hf

            return build_hf(cfg, seq_len, token_ids(manifest))
        return LlamaLM(cfg, seq_len)
    if manifest.get("task") != "classify":
        raise ValueError(
            f"model.kind=mlp needs classification shards; these are {manifest.get('task')!r}"
        )
    feat = manifest["feature_dim"]
    classes = manifest["num_classes"]
    assert isinstance(feat, int) and isinstance(classes, int)
    return MLPClassifier(feat, cfg.mlp_hidden, classes)
