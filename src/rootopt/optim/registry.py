"""The one optimizer registry: ROOT, its ablations, and the family it is compared to.

Adding an optimizer is one :func:`register` call here. The config validation
(``optimization.optimizer``), :func:`rootopt.optim.make_optimizer`, the training factory and
the ``rootopt bench`` help all read :data:`REGISTRY`.

Where ``torch.optim`` or pytorch-optimizer has the algorithm, the entry builds theirs; only
SGLD (neither library has it) and the Muon/AdamW pairing are written here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from rootopt.optim.root import ROOT
from rootopt.optim.routing import RoutingReport, param_groups

Built = tuple[torch.optim.Optimizer, RoutingReport | None]
# builder(model, *, lr, weight_decay, betas, eps, **options) -> (optimizer, routing report)
Builder = Callable[..., Built]


@dataclass(frozen=True)
class OptimizerSpec:
    """One registered optimizer.

    ``lr``: a typical peak learning rate (the centre of the benchmark's lr grid).
    ``decoupled_weight_decay``: whether ``weight_decay`` is AdamW-style (decoupled) or an L2
    term added to the gradient; the benchmark gives L2-style optimizers no decay.
    ``config_options``: ``optimization.*`` config keys forwarded as keyword options.
    ``fixed``: options this entry always sets (the ablations); they override config and caller.
    """

    name: str
    summary: str
    build: Builder
    lr: float
    decoupled_weight_decay: bool = True
    config_options: tuple[str, ...] = ()
    fixed: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""


REGISTRY: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    key = spec.name.lower()
    if key in REGISTRY:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    REGISTRY[key] = OptimizerSpec(
        key,
        spec.summary,
        spec.build,
        spec.lr,
        spec.decoupled_weight_decay,
        spec.config_options,
        MappingProxyType(dict(spec.fixed)),
        spec.source,
    )
    return REGISTRY[key]


def names() -> tuple[str, ...]:
    """Registered names, in registration order (ROOT first)."""
    return tuple(REGISTRY)


def get(name: str) -> OptimizerSpec:
    """The spec for ``name`` (case-insensitive); ``ValueError`` naming the choices otherwise."""
    spec = REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"Invalid optimizer: {name!r} (choose one of {', '.join(REGISTRY)})")
    return spec


def help_text() -> str:
    """One line per optimizer, for command-line help."""
    width = max(map(len, REGISTRY))
    return "\n".join(f"  {s.name:<{width}}  {s.summary}" for s in REGISTRY.values())


# --------------------------------------------------------------------------- helpers


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _pytorch_optimizer() -> Any:
    try:
        import pytorch_optimizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "this optimizer needs pytorch-optimizer: pip install 'rootopt[bench]'"
        ) from exc
    return pytorch_optimizer


class SGLD(torch.optim.Optimizer):
    """Stochastic gradient Langevin dynamics (Welling & Teh, ICML 2011).

    ``θ ← θ − lr·(g + weight_decay·θ) + ξ``, ``ξ ~ N(0, 2·lr·temperature)`` per element.
    ``temperature`` scales the injected noise; with the loss averaged over a batch (not
    summed over the data set) the posterior temperature is effectively much higher, so the
    default is small. Noise is drawn from torch's global generator (seed it for repeatability).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 0.1,
        temperature: float = 1e-5,
        weight_decay: float = 0.0,
    ) -> None:
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"Invalid learning rate: {lr!r}")
        if not temperature >= 0:
            raise ValueError(f"Invalid temperature: {temperature!r}")
        if not weight_decay >= 0:
            raise ValueError(f"Invalid weight_decay: {weight_decay!r}")
        super().__init__(params, dict(lr=lr, temperature=temperature, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, temp, wd = group["lr"], group["temperature"], group["weight_decay"]
            std = math.sqrt(2.0 * lr * temp)
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                p.add_(g, alpha=-lr)
                if std > 0:
                    p.add_(torch.randn_like(p), alpha=std)
        return loss


class OptimizerChain(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped together as one.

    ``param_groups`` holds the children's own group dicts, so an lr scheduler on the chain
    changes the children's learning rates. ``state_dict`` nests the children's.
    """

    def __init__(self, children: list[torch.optim.Optimizer]) -> None:
        if not children:
            raise ValueError("OptimizerChain needs at least one optimizer")
        self.children = children
        groups = [g for c in children for g in c.param_groups]
        super().__init__(groups, {})
        # Keep the very same dicts as the children (add_param_group may have copied them).
        self.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> dict[Tensor, Any]:  # the children's per-parameter state, merged
        merged: dict[Tensor, Any] = {}
        for c in self.children:
            merged.update(c.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:  # the base class assigns an empty state once
        pass

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for c in self.children:
            c.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"children": [c.state_dict() for c in self.children]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kids = state_dict.get("children")
        if not isinstance(kids, list) or len(kids) != len(self.children):
            raise ValueError(
                f"optimizer state holds {len(kids) if isinstance(kids, list) else 'no'} "
                f"child optimizers; this chain has {len(self.children)}"
            )
        for c, s in zip(self.children, kids):
            c.load_state_dict(s)


# --------------------------------------------------------------------------- builders


def _root(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    **options: Any,
) -> Built:
    """:class:`ROOT` on :func:`param_groups` (matrices → ROOT, the rest → internal AdamW)."""
    groups, report = param_groups(
        model, lr=lr, weight_decay=weight_decay, adamw_betas=betas, adamw_eps=eps
    )
    opt = ROOT(
        groups, lr=lr, weight_decay=weight_decay, adamw_betas=betas, adamw_eps=eps, **options
    )
    return opt, report


def _muon(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
) -> Built:
    """``torch.optim.Muon`` on the matrices ROOT's routing sends to ROOT, AdamW on the rest.

    Muon's lr is scaled like ROOT's default (``match_rms_adamw``: 0.2·√max(m, n), Moonlight),
    so both take AdamW-sized learning rates. ``torch.optim.Muon`` accepts only 2-D tensors;
    conv kernels (routed to ROOT flattened to ``(out, in·kh·kw)``) get ROOT's Muon mode —
    Muon's tuple, no outlier suppression — the same update on the flattened matrix.
    """
    groups, report = param_groups(model, lr=lr, weight_decay=weight_decay)
    muon_groups: list[dict[str, Any]] = []
    nd_groups: list[dict[str, Any]] = []
    adamw_groups: list[dict[str, Any]] = []
    for g in groups:
        base = {"lr": g["lr"], "weight_decay": g.get("weight_decay", weight_decay)}
        if g["algorithm"] == "root":
            flat = [p for p in g["params"] if p.ndim == 2]
            nd = [p for p in g["params"] if p.ndim != 2]
            if flat:
                muon_groups.append({**base, "params": flat})
            if nd:
                nd_groups.append({**base, "params": nd, "algorithm": "root"})
        else:
            adamw_groups.append({**base, "params": list(g["params"])})
    children: list[torch.optim.Optimizer] = []
    if muon_groups:
        children.append(
            torch.optim.Muon(
                muon_groups,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn="match_rms_adamw",
            )
        )
    if nd_groups:
        children.append(
            ROOT(
                nd_groups,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_coefficients="muon",
                outlier_quantile=None,
                lr_scale="moonlight",
            )
        )
    if adamw_groups:
        children.append(torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps))
    return OptimizerChain(children), report


def _torch(cls_name: str, **fixed: Any) -> Builder:
    def build(
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        **options: Any,
    ) -> Built:
        cls = getattr(torch.optim, cls_name)
        kw: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, **fixed, **options}
        if cls_name in ("Adam", "AdamW"):
            kw.update(betas=betas, eps=eps)
        elif cls_name == "Adagrad":
            kw["eps"] = eps
        return cls(_trainable(model), **kw), None

    return build


def _lamb(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    **options: Any,
) -> Built:
    po = _pytorch_optimizer()
    return po.Lamb(
        _trainable(model), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **options
    ), None


def _adafactor(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    **options: Any,
) -> Built:
    """Factored second moment with first-moment momentum β1; fixed (external) lr schedule."""
    po = _pytorch_optimizer()
    kw: dict[str, Any] = dict(
        lr=lr,
        betas=(betas[0], betas[1]),
        weight_decay=weight_decay,
        relative_step=False,
        scale_parameter=False,
        warmup_init=False,
    )
    return po.AdaFactor(_trainable(model), **{**kw, **options}), None


def _shampoo(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    **options: Any,
) -> Built:
    po = _pytorch_optimizer()
    kw: dict[str, Any] = dict(lr=lr, momentum=0.9, weight_decay=weight_decay)
    return po.Shampoo(_trainable(model), **{**kw, **options}), None


def _sgld(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    **options: Any,
) -> Built:
    return SGLD(_trainable(model), lr=lr, weight_decay=weight_decay, **options), None


_ROOT_OPTIONS = (
    "momentum",
    "nesterov",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "outlier_quantile",
    "lr_scale",
    "ortho_method",
    "telemetry",
)
_PAPER = "arXiv 2511.20626"

register(
    OptimizerSpec(
        "root",
        "ROOT: outlier soft-threshold + adaptive Newton–Schulz orthogonalization; AdamW for the rest",
        _root,
        3e-3,
        config_options=_ROOT_OPTIONS,
        source=_PAPER,
    )
)
register(OptimizerSpec("adamw", "AdamW (torch.optim)", _torch("AdamW"), 3e-3, source="torch.optim"))
register(
    OptimizerSpec(
        "adam",
        "Adam with L2 weight decay (torch.optim)",
        _torch("Adam"),
        3e-3,
        decoupled_weight_decay=False,
        source="torch.optim",
    )
)
register(
    OptimizerSpec(
        "sgd",
        "plain SGD, no momentum (torch.optim)",
        _torch("SGD"),
        0.3,
        decoupled_weight_decay=False,
        source="torch.optim",
    )
)
register(
    OptimizerSpec(
        "momentum",
        "SGD with Nesterov momentum (torch.optim)",
        _torch("SGD", nesterov=True, momentum=0.9),
        0.03,
        decoupled_weight_decay=False,
        config_options=("momentum",),
        source="torch.optim",
    )
)
register(
    OptimizerSpec(
        "adagrad",
        "Adagrad (torch.optim)",
        _torch("Adagrad"),
        0.03,
        decoupled_weight_decay=False,
        source="torch.optim",
    )
)
register(
    OptimizerSpec(
        "lamb",
        "LAMB: layer-wise trust ratio over Adam (pytorch-optimizer)",
        _lamb,
        3e-3,
        source="pytorch-optimizer",
    )
)
register(
    OptimizerSpec(
        "adafactor",
        "Adafactor: factored second moment (pytorch-optimizer)",
        _adafactor,
        3e-3,
        source="pytorch-optimizer",
    )
)
register(
    OptimizerSpec(
        "shampoo",
        "Shampoo: Kronecker-factored preconditioner (pytorch-optimizer)",
        _shampoo,
        0.03,
        decoupled_weight_decay=False,
        source="pytorch-optimizer",
    )
)
register(
    OptimizerSpec(
        "muon",
        "Muon (torch.optim.Muon) on ROOT-routed matrices + AdamW for the rest",
        _muon,
        3e-3,
        config_options=("momentum", "nesterov", "ns_steps"),
        source="torch.optim",
    )
)
register(
    OptimizerSpec(
        "sgld",
        "SGLD: SGD + Gaussian noise N(0, 2·lr·T) (Welling & Teh 2011)",
        _sgld,
        0.3,
        decoupled_weight_decay=False,
        source="rootopt",
    )
)
register(
    OptimizerSpec(
        "root-no-suppression",
        "ROOT ablation: no outlier soft-threshold",
        _root,
        3e-3,
        config_options=_ROOT_OPTIONS,
        fixed={"outlier_quantile": None},
        source=_PAPER,
    )
)
register(
    OptimizerSpec(
        "root-official",
        "ROOT ablation: the official code's coefficients",
        _root,
        3e-3,
        config_options=_ROOT_OPTIONS,
        fixed={"ns_coefficients": "official"},
        source=_PAPER,
    )
)
register(
    OptimizerSpec(
        "root-muon-coeffs",
        "ROOT ablation: Muon's fixed Newton–Schulz tuple",
        _root,
        3e-3,
        config_options=_ROOT_OPTIONS,
        fixed={"ns_coefficients": "muon"},
        source=_PAPER,
    )
)
register(
    OptimizerSpec(
        "root-svd",
        "ROOT ablation: exact polar factor UVᵀ by SVD",
        _root,
        3e-3,
        config_options=_ROOT_OPTIONS,
        fixed={"ortho_method": "svd"},
        source=_PAPER,
    )
)
register(
    OptimizerSpec(
        "root-robust-scaling",
        "ROOT ablation: robust_scaling=True (windowed gradient statistics)",
        _root,
        3e-3,
        config_options=_ROOT_OPTIONS,
        fixed={"robust_scaling": True},
        source=_PAPER,
    )
)


def make_optimizer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    **options: Any,
) -> Built:
    """Build registered optimizer ``name`` for ``model``: ``(optimizer, routing report or None)``.

    ``options`` go to the optimizer (e.g. ROOT's ``ns_steps``); an ablation's fixed options
    win over them.
    """
    spec = get(name)
    return spec.build(
        model, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, **{**options, **spec.fixed}
    )
