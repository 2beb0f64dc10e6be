"""Which parameter gets ROOT and which gets AdamW: explicit rules, first match wins.

:func:`param_groups` walks a model once, applies :data:`DEFAULT_RULES` (or yours) to
every parameter, groups them, and returns a :class:`RoutingReport` that prints as a
table. Every parameter lands in exactly one group (frozen ones too: they are simply
skipped while their ``grad`` is ``None``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from rootopt.optim.functional import LrScale, NDView, lr_scale_factor, matrix_view

HEAD_NAMES = ("lm_head", "head", "output", "classifier")
LORA_PATTERN = r"(^|\.)lora_(A|B|down|up|embedding_A|embedding_B)(\.|$)"


@dataclass(frozen=True)
class ParamInfo:
    """What a rule sees about one parameter."""

    name: str
    param: Tensor
    module: nn.Module
    tied_to_embedding: bool


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


def default_rules(
    *,
    head_names: Sequence[str] = HEAD_NAMES,
    lora_lr_multiplier: float = 5.0,
    lora_pattern: str = LORA_PATTERN,
) -> list[Rule]:
    """The shipped routing table, in order."""
    head_re = re.compile(r"(^|\.)(" + "|".join(re.escape(h) for h in head_names) + r")$")
    lora_re = re.compile(lora_pattern)
    return [
        Rule(
            "embedding",
            lambda i: isinstance(i.module, (nn.Embedding, nn.EmbeddingBag)),
            "adamw",
        ),
        Rule(
            "output_head",
            lambda i: i.tied_to_embedding or bool(head_re.search(_leaf_name(i.name))),
            "adamw",
        ),
        Rule("lora", lambda i: bool(lora_re.search(i.name)), "adamw", lr_mult=lora_lr_multiplier),
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
    name: str
    shape: tuple[int, ...]
    algorithm: str
    rule: str
    lr_mult: float
    lr_scale: float | None  # ROOT's shape multiplier s(rows, cols); None for AdamW
    matrix: str  # how ROOT sees it, e.g. "4x(64x32)"; "" for AdamW


@dataclass
class RoutingReport:
    routes: list[Route]

    def counts(self) -> dict[str, int]:
        """Number of parameter elements per algorithm."""
        out: dict[str, int] = {}
        for r in self.routes:
            out[r.algorithm] = out.get(r.algorithm, 0) + math.prod(r.shape)
        return out

    def as_dict(self) -> list[dict[str, Any]]:
        return [r.__dict__.copy() for r in self.routes]

    def __str__(self) -> str:
        head = ("name", "shape", "algorithm", "rule", "lr x", "ROOT scale", "matrix")
        rows = [
            (
                r.name,
                "x".join(map(str, r.shape)) or "scalar",
                r.algorithm,
                r.rule,
                f"{r.lr_mult:g}",
                "" if r.lr_scale is None else f"{r.lr_scale:.3f}",
                r.matrix,
            )
            for r in self.routes
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        line = "  ".join("{:<" + str(w) + "}" for w in widths)
        out = [line.format(*head), line.format(*("-" * w for w in widths))]
        out += [line.format(*row) for row in rows]
        c = self.counts()
        total = sum(c.values()) or 1
        summary = ", ".join(f"{k}: {v:,} ({100 * v / total:.1f}%)" for k, v in sorted(c.items()))
        out.append(f"{len(self.routes)} tensors; elements by algorithm: {summary}")
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
    **group_options: Any,
) -> tuple[list[dict[str, Any]], RoutingReport]:
    """Route a model's parameters to ROOT / AdamW groups.

    Default rules (first match wins): ``nn.Embedding`` weights → AdamW; the output head
    (tied to an embedding, or under a module named one of ``head_names``) → AdamW; LoRA
    adapters (``lora_A``/``lora_B``…) → AdamW at ``lr * lora_lr_multiplier``; every
    tensor with < 2 dims → AdamW; conv weights → ROOT flattened to ``(out, rest)``; every
    other matrix → ROOT. ``group_options`` (any ROOT option, e.g. ``ns_steps``) are put
    into every group. Returns ``(groups, report)``; pass ``groups`` to :class:`ROOT`.
    """
    rules = (
        list(rules)
        if rules is not None
        else default_rules(head_names=head_names, lora_lr_multiplier=lora_lr_multiplier)
    )
    embedding_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
    }
    seen: set[int] = set()
    buckets: dict[tuple[str, float, tuple[tuple[str, Any], ...]], list[tuple[str, Tensor]]] = {}
    routes: list[Route] = []
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # a tied parameter is routed once, at its first owner
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            info = ParamInfo(
                name,
                p,
                module,
                id(p) in embedding_ids and not isinstance(module, (nn.Embedding, nn.EmbeddingBag)),
            )
            rule = next((r for r in rules if r.when(info)), None)
            if rule is None:
                raise ValueError(
                    f"no routing rule matches parameter {name} (shape {tuple(p.shape)})"
                )
            opts = tuple(sorted(rule.options.items()))
            buckets.setdefault((rule.algorithm, rule.lr_mult, opts), []).append((name, p))
            scale, matrix = None, ""
            if rule.algorithm == "root":
                nd: NDView = rule.options.get("nd_view", group_options.get("nd_view", "auto"))
                v = matrix_view(p.shape, nd)
                scale = lr_scale_factor(v.rows, v.cols, lr_scale)
                matrix = f"{v.rows}x{v.cols}" if v.batch == 1 else f"{v.batch}x({v.rows}x{v.cols})"
            routes.append(
                Route(name, tuple(p.shape), rule.algorithm, rule.name, rule.lr_mult, scale, matrix)
            )
    groups: list[dict[str, Any]] = []
    for (algorithm, mult, opts), named in buckets.items():
        group: dict[str, Any] = {
            **group_options,
            "params": [p for _, p in named],
            "param_names": [n for n, _ in named],
            "algorithm": algorithm,
            "lr": lr * mult,
            "lr_scale": lr_scale,
            **dict(opts),
        }
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
        groups.append(group)
    return groups, RoutingReport(routes)
