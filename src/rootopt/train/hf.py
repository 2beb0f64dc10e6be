"""Causal LMs from ``transformers`` in the training system, and the way out to it.

* :class:`HFCausalLM` wraps any ``AutoModelForCausalLM`` architecture built with
  ``from_config`` from ``model.hf_config`` (nothing is downloaded), so the loop still sees
  ``model(tokens) -> logits``; :func:`decoder_blocks` finds its decoder layers from the
  model's own structure (its ``_no_split_modules`` declaration, else its repeated-block
  ``ModuleList``) for FSDP2, and activation checkpointing is the model's own switch
  (``activation_checkpointing_enable``).
* The built-in byte Llama (:class:`rootopt.train.model.LlamaLM`) maps onto
  ``LlamaForCausalLM`` exactly (:func:`llama_to_hf`, :func:`hf_to_llama`).
* :func:`load_init` reads the safetensors weights of a Hugging Face model directory
  (``model.init_from``) after checking every name and shape against the model.

``transformers`` is imported only when one of these is used (``import rootopt`` stays light).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rootopt.config import ModelConfig
from rootopt.config.load import SAFETENSORS_FILES, read_hf_config

# Keys of a config.json that name its producer or runtime options, not the model: two
# configs differing only in these describe the same parameters and the same function.
_NOT_THE_MODEL = frozenset(
    {
        "transformers_version",
        "architectures",
        "_name_or_path",
        "torch_dtype",
        "dtype",
        "use_cache",
        "_attn_implementation",
        "attn_implementation",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


class HFCausalLM(nn.Module):
    """``forward(tokens (B, T)) -> logits (B, T, vocab)`` of a ``transformers`` causal LM.

    ``spec`` is the config mapping it was built from (the user's ``config.json`` with the
    run's vocabulary and token ids); checkpoints record it, so an export or a resume does
    not depend on the file staying where it was. Parameter names carry the prefix ``hf.``.
    """

    def __init__(self, model: nn.Module, spec: dict[str, Any]) -> None:
        super().__init__()
        self.hf = model
        self.spec = spec

    @property
    def config(self) -> Any:
        return self.hf.config

    def get_input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()  # type: ignore[operator, no-any-return]

    def get_output_embeddings(self) -> nn.Module | None:
        return self.hf.get_output_embeddings()  # type: ignore[operator, no-any-return]

    def forward(self, tokens: Tensor) -> Tensor:
        logits: Tensor = self.hf(input_ids=tokens, use_cache=False).logits
        return logits


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of ``model`` (FSDP2 units, activation checkpointing).

    A ``transformers`` model names its layer classes in ``_no_split_modules`` (the units
    that must stay whole on one device); otherwise the longest ``ModuleList`` of modules of
    one type is taken. No per-architecture list of names."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    lists: list[nn.ModuleList] = [
        ml
        for ml in model.modules()
        if isinstance(ml, nn.ModuleList) and len(ml) and len({type(c) for c in ml}) == 1
    ]
    sizes = [len(ml) for ml in lists]
    return list(lists[sizes.index(max(sizes))]) if lists else []


# --------------------------------------------------------------------------- building


def hf_spec(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` mapping of ``model.hf_config`` (or of ``model.init_from``)."""
    if cfg.hf_config:
        return read_hf_config(cfg.hf_config)
    return read_hf_config(cfg.init_from, "model.init_from")


def named_vocab(cfg: ModelConfig) -> tuple[int, str]:
    """The vocabulary a config names, and where: ``model.vocab_size`` when set, else (kind
    hf) the ``vocab_size`` its ``config.json`` states; ``(0, "")`` when none is named."""
    if cfg.vocab_size:
        return cfg.vocab_size, "model.vocab_size"
    if cfg.kind == "hf":
        v = hf_spec(cfg).get("vocab_size")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            where = "model.hf_config" if cfg.hf_config else "model.init_from"
            return v, f"the vocab_size of {where}'s config.json"
    return 0, ""


def _causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def hf_config_object(spec: dict[str, Any], where: str = "model.hf_config") -> Any:
    """A ``transformers`` config of a causal LM from ``spec``; :class:`ValueError` (one
    line) when its ``model_type`` is no causal LM or a value is refused."""
    from transformers import AutoConfig

    kind = spec["model_type"]
    causal = _causal_lm_types()
    if kind not in causal:
        raise ValueError(
            f"{where}: model_type {kind!r} is not a causal language model architecture of "
            f"transformers (AutoModelForCausalLM knows e.g. llama, gpt2, mistral, qwen2)"
        )
    args = {k: v for k, v in spec.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(kind, **args)
    except Exception as exc:  # transformers validates fields with its own exception types
        first = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(f"{where}: transformers refuses this {kind} config: {first}") from None


def build_hf(cfg: ModelConfig, seq_len: int, token_ids: dict[str, int | None]) -> HFCausalLM:
    """The causal LM ``model.hf_config`` describes, with ``cfg.vocab_size`` tokens (already
    resolved) and the tokenizer's ``bos``/``eos``/``pad`` ids, in float32 (mixed precision
    autocasts the forward pass)."""
    from transformers import AutoModelForCausalLM

    where = "model.hf_config" if cfg.hf_config else "model.init_from"
    spec = dict(hf_spec(cfg))
    spec["vocab_size"] = cfg.vocab_size
    for key in ("bos", "eos", "pad"):
        spec[f"{key}_token_id"] = token_ids.get(key)
    config = hf_config_object(spec, where)
    limit = _max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"data.seq_len: {seq_len} is longer than the {limit} positions of {where} "
            "(max_position_embeddings / n_positions); shorten data.seq_len or raise it there"
        )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    if cfg.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"model.activation_checkpointing: {type(model).__name__} does not support "
                "gradient checkpointing in transformers; set it to false"
            )
        # transformers' own switch (named gradient_checkpointing_enable before v5.25)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    return HFCausalLM(model, spec)


def _max_positions(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(text, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def same_model(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``key: old → new`` for every key in which two config mappings describe different
    models (producer and runtime keys are ignored)."""
    keys = sorted((set(saved) | set(wanted)) - _NOT_THE_MODEL)
    return [
        f"{k}: {saved.get(k)!r} → {wanted.get(k)!r}" for k in keys if saved.get(k) != wanted.get(k)
    ]


def spec_changes(saved: Any, cfg: ModelConfig) -> list[str]:
    """How ``model.hf_config`` now differs from the config a checkpoint recorded (its
    vocabulary and token ids are compared elsewhere: ``model.vocab_size``, the data)."""
    if not isinstance(saved, dict):
        return ["(the checkpoint records none)"]
    skip = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    now = {k: v for k, v in hf_spec(cfg).items() if k not in skip}
    return same_model({k: v for k, v in saved.items() if k not in skip}, now)


# --------------------------------------------------------------------------- the built-in Llama


def llama_ffn_hidden(cfg: ModelConfig) -> int:
    return cfg.ffn_hidden or 32 * math.ceil(8 * cfg.d_model / 3 / 32)


def llama_hf_spec(
    cfg: ModelConfig, vocab: int, seq_len: int, token_ids: dict[str, int | None]
) -> dict[str, Any]:
    """The ``LlamaForCausalLM`` config of the built-in model (every value that decides the
    function is stated: transformers' Llama defaults differ, e.g. eps 1e-6, untied head)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": llama_ffn_hidden(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": token_ids.get("bos"),
        "eos_token_id": token_ids.get("eos"),
        "pad_token_id": token_ids.get("pad"),
    }


def _rope_order(head_dim: int) -> Tensor:
    """Row order taking one head's interleaved RoPE pairs ``(0, 1), (2, 3), ...`` (ours:
    :func:`rootopt.train.model.apply_rope`) to transformers' halves ``(i, i + d/2)``
    (``rotate_half``): even rows first, then odd rows. q·k is unchanged when queries and
    keys are permuted alike; this is the Meta → Hugging Face Llama conversion's permutation."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _permute_heads(w: Tensor, heads: int, order: Tensor) -> Tensor:
    rows, cols = w.shape
    return w.reshape(heads, rows // heads, cols)[:, order, :].reshape(rows, cols)


_LLAMA_LAYER = {  # ours → transformers, inside blocks.{i} / model.layers.{i}
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w_gate.weight": "mlp.gate_proj.weight",
    "ffn.w_up.weight": "mlp.up_proj.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
}


def llama_to_hf(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The built-in Llama's state dict under ``LlamaForCausalLM``'s names (q/k rows
    permuted per head, see :func:`_rope_order`). A tied head is written once, as the
    embedding (``tie_word_embeddings`` ties it again on load)."""
    hd = cfg.d_model // cfg.n_heads
    order = _rope_order(hd)
    out = {
        "model.embed_tokens.weight": state["embed.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in _LLAMA_LAYER.items():
            w = state[f"blocks.{i}.{ours}"]
            if ours == "attn.wq.weight":
                w = _permute_heads(w, cfg.n_heads, order)
            elif ours == "attn.wk.weight":
                w = _permute_heads(w, cfg.n_kv_heads, order)
            out[f"model.layers.{i}.{theirs}"] = w
    return out


def hf_to_llama(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`llama_to_hf`: a ``LlamaForCausalLM`` state dict (e.g. an
    export of this system) under the built-in Llama's names. A missing name raises
    :class:`KeyError`; shapes are checked by the caller."""
    hd = cfg.d_model // cfg.n_heads
    back = torch.argsort(_rope_order(hd))
    out = {
        "embed.weight": state["model.embed_tokens.weight"],
        "norm.weight": state["model.norm.weight"],
    }
    out["lm_head.weight"] = state.get("lm_head.weight", out["embed.weight"])
    if not cfg.tie_embeddings and "lm_head.weight" not in state:
        raise KeyError("lm_head.weight")
    for i in range(cfg.n_layers):
        for ours, theirs in _LLAMA_LAYER.items():
            w = state[f"model.layers.{i}.{theirs}"]
            if ours == "attn.wq.weight" and w.ndim == 2 and w.shape[0] % cfg.n_heads == 0:
                w = _permute_heads(w, cfg.n_heads, back)
            elif ours == "attn.wk.weight" and w.ndim == 2 and w.shape[0] % cfg.n_kv_heads == 0:
                w = _permute_heads(w, cfg.n_kv_heads, back)
            out[f"blocks.{i}.{ours}"] = w
    return out


# --------------------------------------------------------------------------- weights in


def read_safetensors(directory: str | Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face model directory's safetensors weights (one file, or
    the shards its ``model.safetensors.index.json`` lists)."""
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / SAFETENSORS_FILES[0]).is_file():
        return dict(load_file(str(d / SAFETENSORS_FILES[0])))
    index = json.loads((d / SAFETENSORS_FILES[1]).read_text(encoding="utf-8"))
    files = sorted(set(index["weight_map"].values()))
    out: dict[str, Tensor] = {}
    for name in files:
        if Path(name).name != name:
            raise ValueError(f"model.init_from: the index names {name!r}, not a file beside it")
        out.update(load_file(str(d / name)))
    return out


def load_init(model: nn.Module, cfg: ModelConfig) -> int:
    """Load ``model.init_from``'s weights into ``model`` (a fresh :class:`HFCausalLM` or
    :class:`~rootopt.train.model.LlamaLM`); returns the number of tensors loaded.

    Every parameter must be present (a tied head may be omitted) with the model's shape,
    and no weight may be left over: otherwise :class:`ValueError` with one line, before
    any tensor of the model is changed."""
    where = "model.init_from"
    try:
        state = read_safetensors(cfg.init_from)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise ValueError(
            f"{where}: cannot read the safetensors weights of {cfg.init_from!r} ({first})"
        ) from None
    if isinstance(model, HFCausalLM):
        target: nn.Module = model.hf
    else:
        target = model
        try:
            state = hf_to_llama(state, cfg)
        except KeyError as exc:
            raise ValueError(
                f"{where}: {cfg.init_from!r} is not a LlamaForCausalLM of this shape "
                f"(no tensor {exc.args[0]!r}); model.kind=llama starts from an export of the "
                "built-in model, use model.kind=hf for other architectures"
            ) from None
    own = target.state_dict()
    tied = _tied_names(target)
    missing = [k for k in own if k not in state and k not in tied]
    extra = [k for k in state if k not in own]
    if missing or extra:
        what = f"no tensor {missing[0]!r}" if missing else f"a tensor {extra[0]!r} the model lacks"
        n = len(missing) + len(extra)
        raise ValueError(
            f"{where}: {cfg.init_from!r} does not match the configured model: {what}"
            + (f" (and {n - 1} more)" if n > 1 else "")
        )
    for k in (k for k in own if k in state):  # the model's order: the first layer first
        t = state[k]
        if tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(
                f"{where}: {k} has shape {tuple(t.shape)} in {cfg.init_from!r}, the configured "
                f"model's is {tuple(own[k].shape)}; the model settings (or model.vocab_size) "
                "must match the weights"
            )
    with torch.no_grad():
        for k, t in state.items():
            own[k].copy_(t.to(own[k].dtype))
    return len(state)


def _tied_names(model: nn.Module) -> set[str]:
    """State-dict names that share storage with an earlier name (a tied head)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for k, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key in seen:
            tied.add(k)
        else:
            seen[key] = k
    return tied
