"""Causal LMs from ``transformers`` in the training system, and the way out to it.

* :class:`HFCausalLM` wraps any ``AutoModelForCausalLM`` architecture built with
  ``from_config`` from ``model.hf_config`` (nothing is downloaded), so the loop still sees
  ``model(tokens) -> logits``; :func:`decoder_blocks` finds its decoder layers from the
  model's own structure (its ``_no_split_modules`` declaration, else its repeated-block
  ``ModuleList``) for FSDP2, and activation checkpointing is the model's own switch
  (``activation_checkpointing_enable``).
* The built-in byte Llama (:class:`rootopt.train.models.LlamaLM`) maps onto
  ``LlamaForCausalLM`` exactly (:func:`llama_to_hf`, :func:`hf_to_llama`).
* :func:`load_init` reads the safetensors weights of a Hugging Face model directory
  (``model.init_from``) after checking every name and shape against the model.

``transformers`` is imported only when one of these is used (``import rootopt`` stays light).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rootopt.config import ModelConfig
from rootopt.config.load import SAFETENSORS_FILES, read_hf_config
from rootopt.train.models.builtin import llama_ffn_hidden

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
    line) when its ``model_type`` is unknown, no causal LM, an encoder-decoder, or a value
    is refused."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    kind = spec["model_type"]
    if kind not in CONFIG_MAPPING:
        raise ValueError(
            f"{where}: model_type {kind!r} is not a model type transformers "
            f"{transformers.__version__} knows (a misspelling, or a model of another version)"
        )
    causal = _causal_lm_types()
    if kind not in causal:
        raise ValueError(
            f"{where}: model_type {kind!r} is not a causal language model architecture of "
            f"transformers (AutoModelForCausalLM knows e.g. llama, gpt2, mistral, qwen2)"
        )
    args = {k: v for k, v in spec.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(kind, **args)
    except Exception as exc:  # transformers validates fields with its own exception types
        first = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(f"{where}: transformers refuses this {kind} config: {first}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{where}: model_type {kind!r} is an encoder-decoder architecture "
            f"({causal[kind]} is its decoder alone); rootopt trains decoder-only causal "
            "language models (e.g. llama, gpt2, mistral, qwen2)"
        )
    return config


def _culprit(spec: dict[str, Any], exc: BaseException) -> str | None:
    """The one key of ``spec`` an error of ``transformers`` or ``torch`` building the
    model points at: the value a ``KeyError`` names (an unknown activation, say), or a
    negative size its message quotes; None when no single key is named."""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):
        keys = [k for k, v in spec.items() if v == exc.args[0]]
    else:
        numbers = {int(m) for m in re.findall(r"(?<![\w.])-\d+", str(exc))}
        keys = [
            k
            for k, v in spec.items()
            if isinstance(v, int) and not isinstance(v, bool) and v in numbers
        ]
    return keys[0] if len(keys) == 1 else None


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in text or "not enough memory" in text


def check_causal(model: HFCausalLM, where: str, seq_len: int) -> None:
    """Refuse (one line naming the ``model_type``) a model whose logits at a position change
    with a later token: an encoder such as BERT or RoBERTa (their ``*LMHeadModel`` is in
    transformers' causal-LM table, and without ``is_decoder`` attends both ways) would
    train on the very tokens it is asked to predict. The probe is one forward pass of a
    short random sequence and the same sequence with its last token changed, in float32,
    in eval mode and with a generator of its own (the run's random state is untouched);
    the logits before the last position must not move at all (a causal mask gives them
    exactly zero weight), while the last position's do."""
    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return
    vocab = int(model.spec.get("vocab_size") or 0)
    if vocab < 2:
        return
    length = max(2, min(8, seq_len))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, length), generator=g, device=params[0].device)
    other = tokens.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    kind = model.spec.get("model_type")
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            a, b = model(tokens).float(), model(other).float()
    except Exception as exc:
        if _out_of_memory(exc):
            raise
        first = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise ValueError(
            f"{where}: model_type {kind!r} ({type(model.hf).__name__}) fails on a forward "
            f"pass of token ids alone, as training runs it ({first})"
        ) from None
    finally:
        model.train(was)
    earlier = float((a[:, :-1] - b[:, :-1]).abs().max())
    last = float((a[:, -1] - b[:, -1]).abs().max())
    if earlier > 1e-5 * last:
        raise ValueError(
            f"{where}: model_type {kind!r} ({type(model.hf).__name__}) is not a causal "
            "language model: its logits at a position change with a later token (it attends "
            "to the future, as an encoder does); rootopt trains decoders with a causal mask "
            "(e.g. llama, gpt2, mistral, qwen2)"
        )


def build_hf(cfg: ModelConfig, seq_len: int, token_ids: dict[str, int | None]) -> HFCausalLM:
    """The causal LM ``model.hf_config`` describes, with ``cfg.vocab_size`` tokens (already
    resolved) and the tokenizer's ``bos``/``eos``/``pad`` ids, in float32 (mixed precision
    autocasts the forward pass). A config ``transformers`` accepts but cannot build (an
    unknown activation, a negative size) and a model that is not causal
    (:func:`check_causal`) are :class:`ValueError` lines naming ``where`` and the key."""
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
    with _held_warnings() as held:  # a refusal below is the one line the user sees
        model = _from_config(AutoModelForCausalLM, config, spec, where)
        out = HFCausalLM(model, spec)
        # on the meta device (a size estimate) the probe cannot run: what transformers
        # says is said when the model is built for real
        held["replay"] = not any(p.is_meta for p in out.parameters())
        check_causal(out, where, seq_len)
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
    return out


@contextlib.contextmanager
def _held_warnings() -> Iterator[dict[str, bool]]:
    """Hold back what ``transformers`` logs inside the block, and pass it on only when the
    block succeeds and leaves ``replay`` set (e.g. BERT's advice to set ``is_decoder``,
    logged while building a model that is then refused with one line)."""
    root = logging.getLogger("transformers")
    records: list[logging.LogRecord] = []
    held = {"replay": True}

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handlers, propagate = root.handlers[:], root.propagate
    root.handlers, root.propagate = [Keep()], False
    try:
        yield held
    finally:
        root.handlers, root.propagate = handlers, propagate
    for record in records if held["replay"] else ():  # reached only without an exception
        root.handle(record)


def _from_config(auto: Any, config: Any, spec: dict[str, Any], where: str) -> Any:
    """``auto.from_config(config)`` in float32; an error building it (other than a lack of
    memory) is a :class:`ValueError` line naming the key it points at (:func:`_culprit`)."""
    try:
        return auto.from_config(config, dtype=torch.float32)
    except Exception as exc:
        if _out_of_memory(exc):
            raise
        kind = spec["model_type"]
        first = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        culprit = _culprit(spec, exc)
        if culprit is not None:
            raise ValueError(
                f"{where}: {culprit}: transformers cannot build a {kind} model with "
                f"{culprit}={spec[culprit]!r} ({first})"
            ) from None
        raise ValueError(
            f"{where}: transformers cannot build this {kind} model ({first})"
        ) from None


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
    :func:`rootopt.train.models.builtin.apply_rope`) to transformers' halves ``(i, i + d/2)``
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

_WHERE = "model.init_from"
# float dtypes numpy-free isfinite handles directly (others, e.g. float8, are widened first)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _read_capped(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (a link to one is followed: model directories
    of the Hugging Face cache are links into its blobs), refused past ``limit`` bytes: a
    link to a device or a huge file is one line, not an endless read."""
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a regular file"
        raise ValueError(f"{_WHERE}: {str(path)!r} {what}")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise ValueError(
            f"{_WHERE}: {str(path)!r} cannot be read ({exc.strerror or exc})"
        ) from None
    if len(raw) > limit:
        raise ValueError(f"{_WHERE}: {str(path)!r} is larger than {limit >> 20} MiB")
    return raw


def _weight_files(d: Path) -> list[Path]:
    """The safetensors files of a model directory: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists (plain file names beside it)."""
    single = d / SAFETENSORS_FILES[0]
    if os.path.lexists(single):
        return [single]
    index = d / SAFETENSORS_FILES[1]
    raw = _read_capped(index, 64 << 20)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{_WHERE}: {str(index)!r} is not valid JSON ({exc})") from None
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise ValueError(
            f"{_WHERE}: {str(index)!r} holds no weight_map of tensor names to file names"
        )
    files = sorted(set(wmap.values()))
    for name in files:
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{_WHERE}: the index names {name!r}, not a file beside it")
    return [d / name for name in files]


def read_safetensors(directory: str | Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face model directory's safetensors weights (one file, or
    the shards its ``model.safetensors.index.json`` lists), each checked as it is read:
    a header ``safetensors`` can read, a floating-point dtype (an integer or boolean tensor
    is not a weight to cast), each name in one file only. :class:`ValueError` with one line
    naming the file and the tensor."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, Tensor] = {}
    for path in _weight_files(Path(directory)):
        if not path.is_file():
            what = "is missing" if not path.exists() else "is not a regular file"
            raise ValueError(f"{_WHERE}: {str(path)!r} {what}")
        try:
            with safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
                names = list(f.keys())
                for name in names:
                    dtype = f.get_slice(name).get_dtype()
                    if dtype not in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"):
                        raise ValueError(
                            f"{_WHERE}: tensor {name!r} in {str(path)!r} is {dtype}, not "
                            "floating point: a model's weights are floats (nothing is cast)"
                        )
                    if name in out:
                        raise ValueError(
                            f"{_WHERE}: tensor {name!r} is stored twice ({str(path)!r})"
                        )
                    out[name] = f.get_tensor(name)
        except SafetensorError as exc:
            first = " ".join(str(exc).split())[:160] or type(exc).__name__
            raise ValueError(
                f"{_WHERE}: {str(path)!r} is not a readable safetensors file ({first})"
            ) from None
        except OSError as exc:
            raise ValueError(
                f"{_WHERE}: {str(path)!r} cannot be read ({exc.strerror or exc})"
            ) from None
    return out


# What `rootopt export` records about where a model directory came from (read by
# model.init_from: the tokenizer check and the "initialised from" line).
SOURCE_FILE = "rootopt.json"
SOURCE_FORMAT = "rootopt-export"


def source_record(
    run_dir: Path, run_id: str, checkpoint: str, step: int, tokenizer: dict[str, Any]
) -> bytes:
    """The :data:`SOURCE_FILE` of an export: the run, its checkpoint and step, and the
    tokenizer its data was prepared with (kind, spec, vocabulary, sha256)."""
    tok = {k: tokenizer.get(k) for k in ("kind", "spec", "vocab_size", "sha256")}
    data = {
        "format": SOURCE_FORMAT,
        "run_dir": str(run_dir),
        "run_id": run_id,
        "checkpoint": checkpoint,
        "step": step,
        "tokenizer": tok,
    }
    return (json.dumps(data, indent=1) + "\n").encode("utf-8")


def _read_source(d: Path) -> dict[str, Any] | None:
    """The export record of model directory ``d``; None when it has none (a model saved
    by other tools), :class:`ValueError` when one is there and cannot be read."""
    path = d / SOURCE_FILE
    if not os.path.lexists(path):
        return None
    try:
        data = json.loads(_read_capped(path, 1 << 20).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{_WHERE}: {str(path)!r} cannot be read ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != SOURCE_FORMAT:
        return None  # another tool's file of that name
    if not isinstance(data.get("tokenizer"), dict):
        raise ValueError(f"{_WHERE}: {str(path)!r} records no tokenizer")
    return data


def _tokenizer_sha(record: dict[str, Any]) -> str:
    """The sha256 of the ``tokenizer.json`` a tokenizer record stands for: the file's for
    ``bpe:N`` and tokenizer files, for byte tokens the one ``rootopt export`` writes
    (:func:`rootopt.data.tokenizer.bytes_tokenizer_json`)."""
    import hashlib

    from rootopt.data.tokenizer import BYTES, bytes_tokenizer_json

    if record.get("kind", BYTES) == BYTES:
        return hashlib.sha256(bytes_tokenizer_json().encode("utf-8")).hexdigest()
    return str(record.get("sha256") or "")


def _is_byte_tokenizer(raw: bytes) -> bool:
    """``raw`` is a ``tokenizer.json`` whose ids are the byte values (byte tokens as an
    export writes them, whatever the tokenizers version that serialized it): a BPE model
    over GPT-2's 256 byte symbols in byte order, no merges, no added tokens."""
    from rootopt.data.tokenizer import _byte_symbols

    try:
        data = json.loads(raw.decode("utf-8"))
        model = data["model"]
        vocab, merges, added = model["vocab"], model.get("merges") or [], data.get("added_tokens")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return False
    want = {s: b for b, s in enumerate(_byte_symbols())}
    return model.get("type") == "BPE" and vocab == want and not merges and not added


def init_source(cfg: ModelConfig, manifest: dict[str, Any]) -> str:
    """Where ``model.init_from`` comes from, in words (``DIR (step N of RUN)``), after
    checking that it was trained with the data's tokenizer: the tokenizer its export
    recorded (:data:`SOURCE_FILE`), else the sha256 of its ``tokenizer.json``, against the
    data's. A mismatch is a :class:`ValueError` line (same-sized vocabularies too: a model
    of another tokenizer reads every id as another piece of text). A directory without
    either is not checked, and the words say so."""
    import hashlib

    from rootopt.data.tokenizer import FILE_NAME, MAX_FILE_BYTES, label, record_of

    d = Path(cfg.init_from)
    data_tok = record_of(manifest)
    want = _tokenizer_sha(data_tok)
    source = _read_source(d)
    if source is not None:
        theirs, have = label(source["tokenizer"]), _tokenizer_sha(source["tokenizer"])
        same = have == want
    elif os.path.lexists(d / FILE_NAME):
        raw = _read_capped(d / FILE_NAME, MAX_FILE_BYTES)
        have = hashlib.sha256(raw).hexdigest()
        theirs = f"the tokenizer.json there (sha256 {have[:12]})"
        same = have == want or (
            data_tok.get("kind", "bytes") == "bytes" and _is_byte_tokenizer(raw)
        )
    else:
        return f"{d} (it holds no tokenizer: not checked against the data's)"
    if not same:
        raise ValueError(
            f"{_WHERE}: {str(d)!r} was trained with another tokenizer ({theirs}) than this "
            f"run's data ({label(data_tok)}): its ids would stand for other text. Prepare the "
            f"data with its tokenizer (rootopt data prepare --tokenizer {d}), or start "
            "without model.init_from"
        )
    if source is not None:
        return f"{d} (step {source.get('step')} of {source.get('run_dir')})"
    return f"{d} (a model directory with the data's tokenizer)"


def _non_finite(t: Tensor) -> int:
    """The number of NaN or infinite values of ``t``."""
    x = t if t.dtype in _FLOATS else t.float()
    return int(x.numel() - torch.isfinite(x).sum())


def load_init(model: nn.Module, cfg: ModelConfig) -> int:
    """Load ``model.init_from``'s weights into ``model`` (a fresh :class:`HFCausalLM` or
    :class:`~rootopt.train.models.LlamaLM`); returns the number of tensors loaded.

    Every tensor is checked before any tensor of the model is changed, each failure one
    :class:`ValueError` line naming it: a readable header and a floating-point dtype
    (:func:`read_safetensors`); every parameter present (a tied head may be omitted) with
    the model's shape, and none left over; every value finite (a NaN would only show as a
    divergence steps later)."""
    where = _WHERE
    state = read_safetensors(cfg.init_from)
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
    for k in (k for k in own if k in state):
        bad = _non_finite(state[k])
        if bad:
            raise ValueError(
                f"{where}: {k} in {cfg.init_from!r} holds {bad} non-finite value"
                f"{'s' if bad > 1 else ''} (NaN or inf) of {state[k].numel()}; a model to "
                "start from must be finite"
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
