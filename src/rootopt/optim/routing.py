"""Which parameter gets ROOT and which gets AdamW: explicit rules, first match wins.

:func:`param_groups` walks a model once, looks at its structure (which layer is the
output layer, which weights are stored transposed, which projections are fused), applies
:data:`default_rules` (or yours) to every trainable parameter, groups them, and returns a
:class:`RoutingReport` that prints as a table. Every trainable parameter lands in exactly
one group; frozen ones (``requires_grad=False``, e.g. a PEFT base model) are left out and
listed in the report unless ``include_frozen=True``.

Why these routes: Muon-family updates are meant for hidden weight matrices; the input
embedding, the output layer, gains and biases take a standard adaptive method (Jordan et
al., "Muon"; Moonlight, arXiv 2502.16982, Sec. 2; the official ROOT code does the same).
The structural detection and the PEFT cases are described in ``docs/integrations.md``.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from rootopt.optim.functional import LrScale, NDView, lr_scale_factor, matrix_view

HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score", "out")
LORA_PATTERN = r"(^|\.)lora_(A|B|down|up|embedding_A|embedding_B)(\.|$)"
DORA_PATTERN = r"(^|\.)lora_magnitude_vector(\.|$)"
# PEFT's trainable-token deltas are rows of an embedding table.
EMBEDDING_DELTA_PATTERN = r"(^|\.)trainable_tokens_delta(\.|$)"
# PEFT wrapper segments: ``x.base_layer`` (LoRA), ``x.original_module`` and
# ``x.modules_to_save.<adapter>`` (modules_to_save copies) all stand for module ``x``.
_WRAPPER_RE = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.|$)")
_ADAPTER_RE = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")

# Leaf module names of fused projections → what they fuse (reported, see Route.fused).
FUSED_NAMES: dict[str, str] = {
    "c_attn": "qkv",  # GPT-2 (transformers Conv1D, stored (in, out))
    "qkv_proj": "qkv",  # Phi-3
    "query_key_value": "qkv",  # Falcon, GPT-NeoX, BLOOM
    "qkv": "qkv",
    "wqkv": "qkv",
    "Wqkv": "qkv",
    "W_pack": "qkv",  # Baichuan
    "in_proj": "qkv",
    "gate_up_proj": "gate_up",  # Phi-3, fused SwiGLU
    "w12": "gate_up",
}


@dataclass(frozen=True)
class ParamInfo:
    """What a rule sees about one parameter.

    ``module_name`` is the owning module's path with PEFT wrapper segments removed
    (``lm_head.modules_to_save.default`` → ``lm_head``), so a copy is seen like its
    original. ``head`` is why the structure says the module is an output layer ("" when
    it is not); ``transposed`` is true for weights stored ``(in, out)`` (``transformers``
    ``Conv1D``)."""

    name: str
    param: Tensor
    module: nn.Module
    tied_to_embedding: bool
    module_name: str = ""
    head: str = ""
    transposed: bool = False


@dataclass(frozen=True)
class Rule:
    """``when(info)`` true → ``algorithm`` with ``lr_mult`` and extra group ``options``."""

    name: str
    when: Callable[[ParamInfo], bool]
    algorithm: str
    lr_mult: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)


def _leaf_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def canonical_module_name(name: str) -> str:
    """``name`` without PEFT wrapper segments (``base_layer``, ``original_module``,
    ``modules_to_save.<adapter>``)."""
    return _WRAPPER_RE.sub("", name)


def _conv1d_type() -> type | None:
    # transformers' Conv1D, only if transformers is already imported: routing must not
    # import it (``import rootopt`` stays light), and a model using Conv1D has imported it.
    mod = sys.modules.get("transformers.pytorch_utils")
    t = getattr(mod, "Conv1D", None) if mod is not None else None
    return t if isinstance(t, type) else None


def is_transposed_linear(module: nn.Module) -> bool:
    """True for modules whose ``weight`` is stored ``(in, out)``: ``transformers``'
    ``Conv1D`` (GPT-2 and relatives), ``y = x @ W + b``."""
    t = _conv1d_type()
    return t is not None and isinstance(module, t)


def _linear_out(module: nn.Module) -> int | None:
    """Output features of a Linear-like module, else None."""
    if isinstance(module, nn.Linear):
        return int(module.out_features)
    if is_transposed_linear(module):
        return int(getattr(module, "nf"))  # noqa: B009 (Conv1D's output features)
    return None


def _input_embeddings(model: nn.Module) -> list[nn.Embedding | nn.EmbeddingBag]:
    return [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


def _vocab_sizes(model: nn.Module) -> set[int]:
    """The token vocabulary: ``get_input_embeddings()`` (Hugging Face), else the largest
    embedding table (position tables are smaller and often equal ``d_model``), plus
    ``config.vocab_size``."""
    sizes: set[int] = set()
    get_in = getattr(model, "get_input_embeddings", None)
    emb = None
    if callable(get_in):
        try:
            emb = get_in()
        except (NotImplementedError, AttributeError):
            emb = None
    if isinstance(emb, (nn.Embedding, nn.EmbeddingBag)):
        sizes.add(emb.num_embeddings)
    else:
        tables = [m.num_embeddings for m in _input_embeddings(model)]
        if tables:
            sizes.add(max(tables))
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and not isinstance(v, bool):
        sizes.add(v)
    return sizes


def _owners(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules that own parameters directly, in registration order, adapters excluded."""
    for name, m in model.named_modules():
        if _ADAPTER_RE.search(name):
            continue
        if next(m.parameters(recurse=False), None) is not None:
            yield name, m


def find_output_layers(model: nn.Module) -> dict[str, str]:
    """Output layers found from the model's structure: ``{canonical module name: why}``.

    In order: (1) the module ``model.get_output_embeddings()`` returns (Hugging Face
    models, PEFT models pass it through); (2) the last Linear-like module projecting to
    the vocabulary (the token embedding's ``num_embeddings`` or ``config.vocab_size``);
    (3) the model's last parameter-owning module, when it is Linear-like (the last layer
    of an MLP classifier, a ``fc``/``out`` head). Weights tied to an input embedding are
    recognised per parameter (:attr:`ParamInfo.tied_to_embedding`). Adapter modules
    (``lora_*``) are never output layers.
    """
    names = {id(m): canonical_module_name(n) for n, m in model.named_modules()}
    found: dict[str, str] = {}
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            out = get_out()
        except (NotImplementedError, AttributeError):  # models without an LM head
            out = None
        if isinstance(out, nn.Module) and id(out) in names:
            found.setdefault(names[id(out)], "output embeddings")
    owners = list(_owners(model))
    vocab = _vocab_sizes(model)
    for n, m in reversed(owners):
        o = _linear_out(m)
        if o is not None and o in vocab:
            found.setdefault(canonical_module_name(n), f"projects to vocabulary ({o})")
            break
    if owners:
        n, m = owners[-1]
        if _linear_out(m) is not None:
            found.setdefault(canonical_module_name(n), "last layer")
    return found


# transformers models whose ``query_key_value`` rows hold each head's query, key and value
# in turn (``view(..., num_heads, 3, head_dim)`` in their attention): GPT-NeoX, GPT-NeoX
# Japanese, BLOOM, Persimmon, and Falcon without multi-query or the new decoder architecture.
PER_HEAD_QKV = frozenset({"gpt_neox", "gpt_neox_japanese", "bloom", "persimmon", "falcon"})


def _int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _grouped(heads: int | None, kv: int | None, head_dim: int | None) -> str:
    """The row layout of a QKV fused per key/value head: each group holds its queries,
    then its key and its value."""
    if heads and kv and head_dim and heads % kv == 0:
        unit = f"{heads // kv * head_dim}+{head_dim}+{head_dim}"
        return f"grouped per key/value head: {kv}×[{unit}] (its queries, k, v)"
    return "grouped per key/value head"


def _qkv_rows(module_name: str, out: int, config: Any) -> tuple[tuple[int, ...], str] | None:
    """``(split, rows)`` of a ``query_key_value`` or ``wqkv`` weight whose rows are not three
    blocks: ``split`` ``()`` and ``rows`` how they are laid out. None for a layout of three
    contiguous blocks (handled by :func:`fused_projection`)."""
    leaf = module_name.rsplit(".", 1)[-1]
    model_type = str(getattr(config, "model_type", "") or "")
    heads = _int(config, "num_attention_heads") or _int(config, "n_head")
    hidden = _int(config, "hidden_size")
    head_dim = _int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    if leaf == "wqkv" and model_type.startswith("internlm"):
        # InternLM2: "b q (h gs d)" with gs = queries per key/value head + 2
        return (), _grouped(heads, _int(config, "num_key_value_heads") or heads, head_dim)
    if leaf != "query_key_value":
        return None
    if model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
        return (), _grouped(heads, _int(config, "num_kv_heads") or heads, head_dim)
    if model_type == "falcon" and getattr(config, "multi_query", False):
        return None  # all queries, then one key and one value head: three blocks
    if model_type in PER_HEAD_QKV:
        if heads and head_dim and 3 * heads * head_dim == out:
            return (), f"interleaved per head: {heads}×[{head_dim}+{head_dim}+{head_dim}] (q, k, v)"
        return (), "interleaved per head (q, k, v)"
    return (), f"row layout unknown (model type {model_type or '?'!r})"


def fused_projection(
    module_name: str, module: nn.Module, param_name: str, shape: Sequence[int], config: Any
) -> tuple[str, tuple[int, ...], str]:
    """``(kind, output split sizes, rows)`` of a fused projection weight, or ``("", (), "")``.

    Recognised by ``nn.MultiheadAttention.in_proj_weight`` and by the leaf names in
    :data:`FUSED_NAMES`. Split sizes follow the output dimension (dim 0, or dim 1 for a
    transposed weight); for QKV they come from the model config's head counts when it
    has them (grouped-query attention), else three equal parts; ``()`` when unknown.
    ``rows`` says how the rows are laid out where they are not contiguous blocks
    (GPT-NeoX's ``query_key_value`` holds each head's q, k, v in turn); the split is then
    ``()``, because a split into three blocks would mix heads."""
    if param_name == "in_proj_weight" and isinstance(module, nn.MultiheadAttention):
        kind = "qkv"
    else:
        kind = FUSED_NAMES.get(module_name.rsplit(".", 1)[-1], "")
    if not kind or len(shape) != 2 or not param_name.endswith("weight"):
        return "", (), ""
    out = int(shape[1] if is_transposed_linear(module) else shape[0])
    if kind == "gate_up":
        return kind, (out // 2, out // 2) if out % 2 == 0 else (), ""
    laid = _qkv_rows(module_name, out, config)
    if laid is not None:
        return kind, laid[0], laid[1]
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    )
    if isinstance(heads, int) and isinstance(kv, int) and isinstance(head_dim, int):
        split = (heads * head_dim, kv * head_dim, kv * head_dim)
        if sum(split) == out:
            return kind, split, ""
    if out % 3 == 0:
        return kind, (out // 3,) * 3, ""
    return kind, (), ""


def default_rules(
    *,
    head_names: Sequence[str] = HEAD_NAMES,
    lora_lr_multiplier: float = 5.0,
    lora_pattern: str = LORA_PATTERN,
) -> list[Rule]:
    """The shipped routing table, in order.

    1. ``lora``: LoRA adapters (``lora_A``/``lora_B``/``lora_embedding_A``/``_B``…) →
       AdamW at ``lr * lora_lr_multiplier``. Low-rank factors are not matrices to
       orthogonalize (rank ``r`` is tiny), and adapters are usually trained at a higher
       rate than full fine-tuning.
    2. ``dora_magnitude``: DoRA's ``lora_magnitude_vector`` → AdamW at the adapter rate.
    3. ``embedding``: ``nn.Embedding`` weights and PEFT trainable-token deltas → AdamW.
    4. ``output_head``: output layers (tied to an input embedding, found by
       :func:`find_output_layers`, or a module named one of ``head_names``) → AdamW.
    5. ``non_matrix``: every tensor with < 2 dims → AdamW.
    6. ``conv``: convolution weights → ROOT, flattened to ``(out, rest)``.
    7. ``matrix``: every other matrix → ROOT.
    """
    head_re = re.compile(r"(^|\.)(" + "|".join(re.escape(h) for h in head_names) + r")$")
    lora_re = re.compile(lora_pattern)
    dora_re = re.compile(DORA_PATTERN)
    delta_re = re.compile(EMBEDDING_DELTA_PATTERN)
    return [
        Rule("lora", lambda i: bool(lora_re.search(i.name)), "adamw", lr_mult=lora_lr_multiplier),
        Rule(
            "dora_magnitude",
            lambda i: bool(dora_re.search(i.name)),
            "adamw",
            lr_mult=lora_lr_multiplier,
        ),
        Rule(
            "embedding",
            lambda i: (
                isinstance(i.module, (nn.Embedding, nn.EmbeddingBag))
                or bool(delta_re.search(i.name))
            ),
            "adamw",
        ),
        Rule(
            "output_head",
            lambda i: (
                i.tied_to_embedding
                or bool(i.head)
                or bool(head_re.search(i.module_name or _leaf_name(i.name)))
            ),
            "adamw",
        ),
        Rule("non_matrix", lambda i: i.param.ndim < 2, "adamw"),
        Rule(
            "conv",
            lambda i: isinstance(i.module, nn.modules.conv._ConvNd),
            "root",
            options={"nd_view": "flatten"},
        ),
        Rule("matrix", lambda i: i.param.ndim >= 2, "root"),
    ]


@dataclass(frozen=True)
class Route:
    """One parameter's route.

    ``transposed``: the weight is stored ``(in, out)`` (``transformers`` ``Conv1D``); its
    group carries ``"transposed": True`` and ``lr_scale`` here is computed with rows =
    fan-out. ``fused``/``split``: a fused projection (``"qkv"``, ``"gate_up"``) and its
    block sizes along the output dimension; ``rows``: how its rows are laid out where they
    are not contiguous blocks (then ``split`` is ``()``). ``trainable``: False only for frozen
    parameters kept with ``include_frozen=True``."""

    name: str
    shape: tuple[int, ...]
    algorithm: str
    rule: str
    lr_mult: float
    lr_scale: float | None  # ROOT's shape multiplier s(rows, cols); None for AdamW
    matrix: str  # how ROOT sees it, e.g. "4x(64x32)"; "" for AdamW
    transposed: bool = False
    fused: str = ""
    split: tuple[int, ...] = ()
    rows: str = ""  # a fused weight's row layout when it is not contiguous blocks
    head: str = ""  # why the output_head rule matched ("tied to embedding", "name", ...)
    trainable: bool = True

    @property
    def layout(self) -> str:
        """How the 2-D weight is stored: ``"out,in"`` (``nn.Linear``) or ``"in,out"``."""
        return "in,out" if self.transposed else "out,in"

    def notes(self) -> str:
        parts = []
        if self.head:
            parts.append(f"head: {self.head}")
        if self.transposed:
            parts.append("stored (in,out)")
        if self.fused and self.rows:
            parts.append(f"fused {self.fused}, {self.rows}")
        elif self.fused:
            sizes = "+".join(map(str, self.split)) if self.split else "?"
            parts.append(f"fused {self.fused} [{sizes}]")
        if not self.trainable:
            parts.append("frozen")
        return "; ".join(parts)


@dataclass
class RoutingReport:
    routes: list[Route]
    frozen: list[tuple[str, int]] = field(default_factory=list)  # left out: (name, elements)

    def counts(self) -> dict[str, int]:
        """Number of trainable parameter elements per algorithm."""
        out: dict[str, int] = {}
        for r in self.routes:
            if r.trainable:
                out[r.algorithm] = out.get(r.algorithm, 0) + math.prod(r.shape)
        return out

    def by_name(self) -> dict[str, Route]:
        return {r.name: r for r in self.routes}

    def as_dict(self) -> list[dict[str, Any]]:
        return [dict(r.__dict__, layout=r.layout) for r in self.routes]

    def __str__(self) -> str:
        head = ("name", "shape", "algorithm", "rule", "lr x", "ROOT scale", "matrix", "notes")
        rows = [
            (
                r.name,
                "x".join(map(str, r.shape)) or "scalar",
                r.algorithm,
                r.rule,
                f"{r.lr_mult:g}",
                "" if r.lr_scale is None else f"{r.lr_scale:.3f}",
                r.matrix,
                r.notes(),
            )
            for r in self.routes
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        line = "  ".join("{:<" + str(w) + "}" for w in widths)
        out = [line.format(*head).rstrip(), line.format(*("-" * w for w in widths))]
        out += [line.format(*row).rstrip() for row in rows]
        c = self.counts()
        total = sum(c.values()) or 1
        summary = ", ".join(f"{k}: {v:,} ({100 * v / total:.1f}%)" for k, v in sorted(c.items()))
        n_train = sum(r.trainable for r in self.routes)
        out.append(f"{n_train} trainable tensors; elements by algorithm: {summary}")
        kept = [r for r in self.routes if not r.trainable]
        if kept:
            n = sum(math.prod(r.shape) for r in kept)
            out.append(f"{len(kept)} frozen tensors ({n:,} elements) kept in groups, not counted")
        if self.frozen:
            n = sum(k for _, k in self.frozen)
            out.append(
                f"{len(self.frozen)} frozen tensors ({n:,} elements) left out "
                "(include_frozen=True keeps them)"
            )
        return "\n".join(out)


def param_groups(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    weight_decay: float | None = None,
    lora_lr_multiplier: float = 5.0,
    head_names: Sequence[str] = HEAD_NAMES,
    rules: Sequence[Rule] | None = None,
    lr_scale: LrScale = "moonlight",
    include_frozen: bool = False,
    detect_heads: bool = True,
    **group_options: Any,
) -> tuple[list[dict[str, Any]], RoutingReport]:
    """Route a model's parameters to ROOT / AdamW groups.

    Default rules (first match wins, see :func:`default_rules`): LoRA adapters →
    AdamW at ``lr * lora_lr_multiplier`` (DoRA magnitudes too); embeddings → AdamW; the
    output layer → AdamW (tied to an embedding, found from the structure by
    :func:`find_output_layers` unless ``detect_heads=False``, or named one of
    ``head_names``); every tensor with < 2 dims → AdamW; conv weights → ROOT flattened to
    ``(out, rest)``; every other matrix → ROOT. PEFT ``modules_to_save`` copies are routed
    like their originals.

    Frozen parameters are left out (listed in ``report.frozen``) unless
    ``include_frozen=True``. Weights stored ``(in, out)`` (``transformers`` ``Conv1D``)
    go to groups marked ``"transposed": True``. ``group_options`` (any ROOT option, e.g.
    ``ns_steps``) are put into every group. Returns ``(groups, report)``; pass ``groups``
    to :class:`ROOT`. This is the one way to build ROOT's groups for a PEFT model:
    ``ROOT(filter(lambda p: p.requires_grad, model.parameters()))`` would send LoRA
    factors to ROOT.
    """
    rules = (
        list(rules)
        if rules is not None
        else default_rules(head_names=head_names, lora_lr_multiplier=lora_lr_multiplier)
    )
    embedding_ids = {id(m.weight) for m in _input_embeddings(model)}
    heads = find_output_layers(model) if detect_heads else {}
    config = getattr(model, "config", None)
    seen: set[int] = set()
    buckets: dict[
        tuple[str, float, bool, tuple[tuple[str, Any], ...]], list[tuple[str, Tensor]]
    ] = {}
    routes: list[Route] = []
    frozen: list[tuple[str, int]] = []
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied parameter is routed once, at its first owner
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if not p.requires_grad and not include_frozen:
                frozen.append((name, p.numel()))
                continue
            canon = canonical_module_name(mod_name)
            tied = id(p) in embedding_ids and not isinstance(
                module, (nn.Embedding, nn.EmbeddingBag)
            )
            transposed = p_name == "weight" and p.ndim == 2 and is_transposed_linear(module)
            info = ParamInfo(name, p, module, tied, canon, heads.get(canon, ""), transposed)
            rule = next((r for r in rules if r.when(info)), None)
            if rule is None:
                raise ValueError(
                    f"no routing rule matches parameter {name} (shape {tuple(p.shape)})"
                )
            opts = tuple(sorted(rule.options.items()))
            key = (rule.algorithm, rule.lr_mult, transposed and rule.algorithm == "root", opts)
            buckets.setdefault(key, []).append((name, p))
            scale, matrix = None, ""
            if rule.algorithm == "root":
                nd: NDView = rule.options.get("nd_view", group_options.get("nd_view", "auto"))
                v = matrix_view(p.shape, nd)
                rows, cols = (v.cols, v.rows) if transposed else (v.rows, v.cols)
                scale = lr_scale_factor(rows, cols, lr_scale)
                matrix = f"{v.rows}x{v.cols}" if v.batch == 1 else f"{v.batch}x({v.rows}x{v.cols})"
            why = ""
            if rule.name == "output_head":
                why = (
                    "tied to embedding"
                    if tied
                    else info.head or f"name '{canon.rsplit('.', 1)[-1] or name}'"
                )
            fused, split, laid = fused_projection(canon, module, p_name, tuple(p.shape), config)
            routes.append(
                Route(
                    name,
                    tuple(p.shape),
                    rule.algorithm,
                    rule.name,
                    rule.lr_mult,
                    scale,
                    matrix,
                    transposed=transposed,
                    fused=fused,
                    split=split,
                    rows=laid,
                    head=why,
                    trainable=p.requires_grad,
                )
            )
    if not routes:
        raise ValueError(
            f"the model has no trainable parameters ({len(frozen)} frozen; "
            "pass include_frozen=True to route them anyway)"
        )
    groups: list[dict[str, Any]] = []
    for (algorithm, mult, transposed, opts), named in buckets.items():
        group: dict[str, Any] = {
            **group_options,
            "params": [p for _, p in named],
            "param_names": [n for n, _ in named],
            "algorithm": algorithm,
            "lr": lr * mult,
            "lr_scale": lr_scale,
            **dict(opts),
        }
        if transposed:
            # Read by ROOT to take rows = fan-out (dim 1) in lr_scale_factor.
            group["transposed"] = True
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
        groups.append(group)
    return groups, RoutingReport(routes, frozen)


# ------------------------------------------------------------------------------------------
# fused projections and LoRA factors in groups handed to ROOT
# ------------------------------------------------------------------------------------------
def fused_splits(groups: list[dict[str, Any]], report: RoutingReport) -> list[dict[str, Any]]:
    """Copies of ``groups`` (from :func:`param_groups`) in which every fused projection the
    routing ``report`` found with known block sizes (``Route.split``: GPT-2 ``c_attn``,
    ``qkv_proj``, ``gate_up_proj``, ...) gets ``ns_split``, so that ROOT orthogonalizes its
    Q/K/V (or gate/up) blocks separately."""
    by_name = report.by_name()
    out = []
    for g in groups:
        g = dict(g)
        names = g.get("param_names")
        if names is not None and g.get("algorithm") == "root":
            splits = [tuple(by_name[n].split) if by_name[n].split else None for n in names]
            if any(x is not None for x in splits):
                g["ns_split"] = splits
        out.append(g)
    return out


def check_splits(group: dict[str, Any], params: list[Tensor], robust: bool) -> None:
    """Validate ``ns_split``: one entry per parameter, ``None`` or output block sizes of a
    2-D weight that add up to its fan-out (dim 0, dim 1 for a transposed group)."""
    splits = group.get("ns_split")
    if splits is None:
        return
    if not isinstance(splits, (list, tuple)) or len(splits) != len(params):
        raise ValueError(
            f"Invalid ns_split: needs one entry (None or block sizes) per parameter, "
            f"got {splits!r} for {len(params)} parameters"
        )
    dim = 1 if group.get("transposed", False) else 0
    for sizes, p in zip(splits, params):
        if sizes is None:
            continue
        if (
            p.ndim != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
            or sum(sizes) != p.shape[dim]
        ):
            raise ValueError(
                f"Invalid ns_split: {sizes!r} for a parameter of shape {tuple(p.shape)} "
                f"(positive block sizes of a 2-D weight adding up to dim {dim})"
            )
        if robust:
            raise ValueError("Invalid ns_split: not supported together with robust_scaling")


def _is_lora_name(name: object) -> bool:
    return isinstance(name, str) and any(
        part.startswith(("lora_", "lora_embedding_")) for part in name.split(".")
    )


def warn_lora(items: list[Any], names: Any, stacklevel: int) -> None:
    """Warn (once per call site, Python's default filter) when a group routed by shape
    holds LoRA factors, which ROOT would orthogonalize. Only names can tell: a bare tensor
    from ``model.parameters()`` carries nothing that marks it as a LoRA factor, so this
    sees ``named_parameters()`` input (or ``param_names``), not bare tensors."""
    found = [
        item[0]
        for item in items
        if isinstance(item, tuple) and _is_lora_name(item[0]) and item[1].ndim >= 2
    ]
    if names is not None:
        found += [n for n, item in zip(names, items) if _is_lora_name(n) and item.ndim >= 2]
    if found:
        warnings.warn(
            f"ROOT got LoRA factors in a group routed by shape ({found[0]}"
            f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}): they would be "
            "orthogonalized. Build the groups with rootopt.param_groups(model), which puts "
            "LoRA A/B on AdamW (docs/integrations.md).",
            UserWarning,
            stacklevel=stacklevel,
        )
