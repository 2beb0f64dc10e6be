"""One optimizer step and one validation pass.

A step is ``grad_accum_steps`` micro-batches → unscale → global grad norm → (non-finite?
skip, count : clip → optimizer step) → lr schedule. The loss stays on the device across the
micro-batches; the step makes one host synchronisation (the skip decision reads the grad
norm and the loss together), and the log-step statistics are per-tensor reductions read in
one more synchronisation at log steps only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rootopt.train.data import val_stream
from rootopt.train.model import loss_fn
from rootopt.train.schedule import global_grad_norm
from rootopt.train.state import Hooks, Run

# Log-step update ratios read at most this many entries of a tensor (a fixed stride), so the
# snapshot before the step costs O(tensors), not a second copy of the model.
RATIO_SAMPLE = 1 << 16


@dataclass
class StepResult:
    loss: float  # this step's loss (mean over its micro-batches); NaN/Inf when non-finite
    grad_norm: float
    applied: bool
    lrs: list[float]  # lr each param group used
    tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # log steps only
    ratios: dict[str, float] = field(default_factory=dict)  # log steps only


def train_step(
    run: Run, data: Iterator[dict[str, torch.Tensor]], hooks: Hooks, *, log_now: bool
) -> StepResult:
    """Run one optimizer step; sets ``run.phase`` so a failure knows whether state is intact."""
    cfg, model, opt, st = run.cfg, run.model, run.optimizer, run.state
    accum = cfg.optimization.grad_accum_steps
    seq = cfg.data.seq_len if run.manifest["task"] == "lm" else 1
    params = run.params
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    tokens = 0
    for _ in range(accum):
        batch = next(data)
        st.batches += 1
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        with run.precision.autocast():
            loss = loss_fn(model(x), y) / accum
        run.precision.backward(loss)
        loss_sum += loss.detach().double()
        tokens += y.size(0) * seq
    st.tokens += tokens
    if hooks.after_backward is not None:
        hooks.after_backward(st.step, model)

    run.phase = "update"  # from here on the model/optimizer/scaler may change
    run.precision.unscale(opt, params)
    norm = global_grad_norm(params)
    grad_norm, step_loss = torch.stack([norm.double().cpu(), loss_sum.cpu()]).tolist()
    lrs = [float(g["lr"]) for g in opt.param_groups]
    if not (math.isfinite(grad_norm) and math.isfinite(step_loss)):
        run.precision.skip()
        opt.zero_grad(set_to_none=True)
        run.scheduler.step()
        if run.controller is not None:
            run.controller.skipped_step(opt)
        return StepResult(step_loss, grad_norm, False, lrs, tokens)
    clip_scale = run.clipper(params, norm)
    stats: dict[str, Any] = {}
    before: dict[str, tuple[torch.Tensor, int]] = {}
    if log_now:
        stats = grad_stats(params)
        stats["clip_scale"] = clip_scale
        before = param_sample(model)
    ctl = run.controller
    if run.telemetry or ctl is not None:
        opt.telemetry_enabled = log_now or (ctl is not None and ctl.wants_telemetry)  # type: ignore[attr-defined]
    run.precision.step(opt)
    run.scheduler.step()
    if ctl is not None:  # the learned controller scales the lr the schedule just set
        ctl.after_step(opt, step_loss, grad_norm)
    ratios = update_ratios(before, model) if log_now else {}
    return StepResult(step_loss, grad_norm, True, lrs, tokens, stats, ratios)


def grad_stats(params: list[torch.Tensor]) -> dict[str, float]:
    """Max |g| and min non-zero |g| over all gradients, one tensor at a time (no concatenation)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return {}
    inf = torch.tensor(float("inf"), device=grads[0].device)
    maxes = torch.stack([g.abs().amax().float() for g in grads])
    mins = torch.stack([torch.where(g != 0, g.abs(), inf).amin().float() for g in grads])
    gmax, gmin = torch.stack([maxes.max(), mins.min()]).tolist()
    return {"grad_abs_max": gmax, "grad_abs_min": gmin if math.isfinite(gmin) else 0.0}


def param_sample(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """A strided sample of each parameter (exact for tensors up to RATIO_SAMPLE entries)."""
    out = {}
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        stride = max(1, -(-flat.numel() // RATIO_SAMPLE))
        out[name] = (flat[::stride].float().clone(), stride)
    return out


def update_ratios(
    before: dict[str, tuple[torch.Tensor, int]], model: nn.Module
) -> dict[str, float]:
    """||Δθ|| / ||θ|| per tensor over the sampled entries, read in one synchronisation."""
    names, pairs = [], []
    for name, p in model.named_parameters():
        if name not in before:
            continue
        old, stride = before[name]
        new = p.detach().reshape(-1)[::stride].float()
        names.append(name)
        pairs.append(torch.stack([(new - old).norm(), old.norm()]))
    if not pairs:
        return {}
    values = torch.stack(pairs).tolist()
    return {n: d / max(b, 1e-12) for n, (d, b) in zip(names, values)}


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    stream = val_stream(run)
    if stream is None:
        return {}
    run.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    count = 0
    for i, batch in enumerate(stream):
        if i >= run.cfg.run.eval_batches:
            break
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        with run.precision.autocast():
            logits = run.model(x)
        total += loss_fn(logits, y).double() * y.size(0)
        count += y.size(0)
        if logits.ndim == 2:
            correct += (logits.argmax(-1) == y).sum()
    run.model.train()
    if count == 0:
        return {}
    out = {"val_loss": float(total) / count}
    if run.manifest["task"] == "classify":
        out["val_accuracy"] = int(correct) / count
    else:
        out["val_bits_per_byte"] = out["val_loss"] / math.log(2)
    return out
