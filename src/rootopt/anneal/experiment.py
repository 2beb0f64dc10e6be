"""A quantized-head experiment: the block update by QUBO vs sign-SGD vs a rounded ROOT step.

Task ``bbc`` (BBC News topics, TF-IDF → MLP with a narrow hidden layer) or ``digits`` (8×8
digits, small CNN). The block is the classifier head's weight matrix, initialised to zero, so
with every update in ``{−s, 0, +s}`` it stays on the grid ``s·ℤ`` (a quantized head). The
rest of the model (and the head's bias) trains with ROOT at its tuned lr and cosine schedule.

Block methods (same ``s``, same data, same seeds):

* ``qubo``: ``argmin_δ gᵀδ + ½ δᵀHδ`` over ``{−s,0,s}ⁿ`` by a ``dimod`` sampler, ``H`` from
  per-sample gradients of the block (:func:`rootopt.anneal.qubo.curvature`).
* ``sign``: sign-SGD, ``δ = −s·sign(g)``.
* ``rounded-root``: a ROOT step on the block (its own momentum state), ternarised with the
  threshold ``0.7·mean|Δ|`` of Ternary Weight Networks (Li et al., 2016, arXiv 1605.04711):
  ``δ = s·sign(Δ)·[|Δ| > 0.7·mean|Δ|]``.
* ``float-root``: the unquantized ROOT head (a reference, not on the grid).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rootopt._threads import one_thread
from rootopt.anneal.qubo import (
    check_size,
    curvature,
    make_sampler,
    quadratic_model,
    solve_ternary,
)

METHODS = ("qubo", "sign", "rounded-root", "float-root")


@dataclass(frozen=True)
class HeadConfig:
    task: str = "bbc"
    method: str = "qubo"
    steps: int = 100
    seed: int = 0
    s: float = 0.02  # grid step of the head
    rank: int = 8  # low-rank part of the curvature
    damping: float = 1e-4
    sampler: str = "sa"
    num_reads: int = 8
    num_sweeps: int = 300
    base_lr: float = 0.03  # ROOT's tuned lr (docs/benchmarks.md)
    hidden: int = 32  # bbc: MLP hidden width (head = 5 × hidden); digits: CNN width


def _model(cfg: HeadConfig) -> tuple[nn.Module, nn.Linear, Any]:
    from rootopt.tasks import BBC_CLASSES, BBC_FEATURES, load_task_data
    from rootopt.train.models import DigitsCNN, MLPClassifier

    data = load_task_data(cfg.task)
    if cfg.task == "bbc":
        m: nn.Module = MLPClassifier(BBC_FEATURES, cfg.hidden, BBC_CLASSES)
        head = m.net[-1]  # type: ignore[index]
    elif cfg.task == "digits":
        m = DigitsCNN(10, width=cfg.hidden)
        head = m.head
    else:
        raise ValueError(f"unknown task {cfg.task!r} (bbc, digits)")
    assert isinstance(head, nn.Linear)
    return m, head, data


def block_size(cfg: HeadConfig) -> int:
    from rootopt.tasks import BBC_CLASSES

    if cfg.task == "bbc":
        return BBC_CLASSES * cfg.hidden
    return 10 * 2 * cfg.hidden * 16


def _per_sample_grads(model: nn.Module, weight: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """(B, n) gradients of each sample's loss w.r.t. ``weight`` (torch.func.vmap over grad)."""
    from torch.func import functional_call, grad, vmap

    from rootopt.train.models import loss_fn

    params = {k: v.detach() for k, v in model.named_parameters()}
    name = next(k for k, v in model.named_parameters() if v is weight)

    def one(w: Tensor, xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, {**params, name: w}, (xi[None],))
        return loss_fn(out, yi[None])

    gs: Tensor = vmap(grad(one), in_dims=(None, 0, 0))(weight.detach(), x, y)
    return gs.reshape(x.size(0), -1)


def run_head(cfg: HeadConfig) -> dict[str, Any]:
    """One quantized-head run on one thread (the caller's thread count is restored)."""
    with one_thread():
        return _run_head(cfg)


def _run_head(cfg: HeadConfig) -> dict[str, Any]:
    from rootopt.optim import ROOT
    from rootopt.optim.registry import make_optimizer
    from rootopt.train.models import loss_fn
    from rootopt.train.schedule import LRMultiplier

    if cfg.method not in METHODS:
        raise ValueError(f"unknown method {cfg.method!r} (choose from {', '.join(METHODS)})")
    sampler, limit = None, None
    if cfg.method == "qubo":  # fail before any training on a bad sampler or block
        sampler, limit, _ = make_sampler(cfg.sampler)
        check_size(2 * block_size(cfg), limit, cfg.sampler)
    torch.manual_seed(cfg.seed)
    model, head, data = _model(cfg)
    with torch.no_grad():
        head.weight.zero_()
    head.weight.requires_grad_(False)  # the rest (incl. the head bias) trains with ROOT
    opt, _ = make_optimizer("root", model, lr=cfg.base_lr, weight_decay=0.1)
    head.weight.requires_grad_(True)
    warm = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, LRMultiplier("cosine", warmup=warm, total=cfg.steps, min_ratio=0.1)
    )
    head_opt = None
    if cfg.method in ("rounded-root", "float-root"):
        head_opt = ROOT([head.weight], lr=cfg.base_lr, weight_decay=0.0)
        head_sched = torch.optim.lr_scheduler.LambdaLR(
            head_opt, LRMultiplier("cosine", warmup=warm, total=cfg.steps, min_ratio=0.1)
        )
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    bs = 32 if cfg.task == "bbc" else 64
    solve_s: list[float] = []
    moved: list[float] = []
    gains: list[tuple[float, float]] = []  # (model at the QUBO δ, model at the sign step)
    couplings = 0
    params = [p for p in model.parameters()]
    for _ in range(cfg.steps):
        idx = torch.randint(0, len(data.train_y), (bs,), generator=gen)
        x, y = data.train_x[idx], data.train_y[idx]
        loss = loss_fn(model(x), y)
        for p in params:
            p.grad = None
        loss.backward()  # type: ignore[no-untyped-call]
        g_head = head.weight.grad
        assert g_head is not None
        head.weight.grad = None  # the ROOT optimizer of the rest must not see it
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], 1.0)
        opt.step()
        sched.step()
        w = head.weight
        with torch.no_grad():
            if cfg.method == "sign":
                delta = -cfg.s * torch.sign(g_head)
            elif cfg.method == "qubo":
                ps = _per_sample_grads(model, w, x, y).numpy()
                d, v = curvature(ps, cfg.rank, cfg.damping)
                kw: dict[str, Any] = {}
                if cfg.sampler == "sa":
                    kw = {
                        "num_reads": cfg.num_reads,
                        "num_sweeps": cfg.num_sweeps,
                        "seed": cfg.seed,
                    }
                elif cfg.sampler == "tabu":
                    kw = {"num_reads": cfg.num_reads, "seed": cfg.seed}
                sol = solve_ternary(
                    sampler,
                    g_head.reshape(-1).numpy(),
                    d,
                    v,
                    cfg.s,
                    limit=limit,
                    name=cfg.sampler,
                    **kw,
                )
                solve_s.append(sol.seconds)
                gflat = g_head.reshape(-1).numpy()
                gains.append((sol.energy, quadratic_model(-cfg.s * np.sign(gflat), gflat, d, v)))
                couplings = sol.couplings
                delta = torch.from_numpy(sol.delta).to(w.dtype).reshape(w.shape)
            else:
                assert head_opt is not None
                before = w.detach().clone()
                w.grad = g_head
                head_opt.step()
                head_sched.step()
                w.grad = None
                if cfg.method == "float-root":
                    delta = w - before
                else:
                    step = w - before
                    thr = 0.7 * step.abs().mean()
                    delta = cfg.s * torch.sign(step) * (step.abs() > thr)
                w.copy_(before)
            w.add_(delta)
            moved.append(float((delta != 0).float().mean()))
    with torch.no_grad():
        model.eval()
        out = model(data.val_x)
        val = float(loss_fn(out, data.val_y))
        acc = float((out.argmax(-1) == data.val_y).float().mean())
    on_grid = bool(torch.allclose(head.weight / cfg.s, torch.round(head.weight / cfg.s), atol=1e-4))
    n = block_size(cfg)
    return {
        **asdict(cfg),
        "final_val_loss": val if math.isfinite(val) else float("nan"),
        "final_val_acc": acc,
        "block_vars": n,
        "binaries": 2 * n if cfg.method == "qubo" else 0,
        "couplings": couplings,
        "solver_s_per_step": float(np.mean(solve_s)) if solve_s else 0.0,
        "moved_fraction": float(np.mean(moved)),
        # Mean local-model value gᵀδ + ½δᵀHδ of the chosen δ and of the sign step (qubo only).
        "model_qubo": float(np.mean([a for a, _ in gains])) if gains else None,
        "model_sign": float(np.mean([b for _, b in gains])) if gains else None,
        "head_on_grid": on_grid,
        "distinct_levels": int(torch.unique(torch.round(head.weight / cfg.s)).numel()),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| task | method | block vars | binaries | couplings | val loss | val acc | "
        "solver s/step | entries moved/step | head on grid | model value: QUBO δ / sign δ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = dict.fromkeys(
        (r["task"], r["method"], r["sampler"] if r["method"] == "qubo" else "") for r in rows
    )
    for task, method, smp in keys:
        rs = [
            r
            for r in rows
            if r["task"] == task and r["method"] == method and (not smp or r["sampler"] == smp)
        ]
        vl = np.array([r["final_val_loss"] for r in rs])
        va = np.array([r["final_val_acc"] for r in rs])
        label = f"{method} ({smp})" if smp else method
        lines.append(
            f"| {task} | {label} (n={len(rs)}) | {rs[0]['block_vars']} | {rs[0]['binaries']} | "
            f"{rs[0]['couplings']} | {vl.mean():.4f} ± {vl.std():.4f} | {va.mean():.4f} ± {va.std():.4f} | "
            f"{np.mean([r['solver_s_per_step'] for r in rs]):.3f} | "
            f"{np.mean([r['moved_fraction'] for r in rs]):.2f} | {all(r['head_on_grid'] for r in rs)} | "
            + (
                f"{np.mean([r['model_qubo'] for r in rs]):.4g} / {np.mean([r['model_sign'] for r in rs]):.4g} |"
                if rs[0].get("model_qubo") is not None
                else "— |"
            )
        )
    return "\n".join(lines)
