"""One optimizer step and one validation pass.

A step reads the same in every mode of gradient synchronisation (:mod:`rootopt.train.sync`):
``grad_accum_steps`` micro-batches (all but the last under ``no_sync``) → ``finish``
(unscaled; the global grad norm) → the loss reduced with the stop votes → (non-finite? skip,
count : clip ``clip_targets`` → optimizer step) → lr schedule. With ROOT or Muon at world size
> 1 under ddp the optimizer synchronises the gradients itself: unscaling, the norm and
clipping act on the parts each rank owns (docs/distributed.md, "Training under torchrun").
The loss stays on the device across the micro-batches; the step makes one host
synchronisation (the skip decision reads the grad norm and the loss together), and the
log-step statistics are per-tensor reductions read in one more synchronisation at log steps
only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

import torch
from torch import nn

from rootopt.distributed import unwrap_model
from rootopt.train.data import val_stream
from rootopt.train.models import loss_fn
from rootopt.train.run.state import Hooks, Run
from rootopt.train.schedule import _is_dtensor
from rootopt.train.sync import _local

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
    stop: tuple[bool, bool] = (False, False)  # any rank voted: (signal, max_time)


def train_step(
    run: Run, data: Iterator[dict[str, torch.Tensor]], hooks: Hooks, *, log_now: bool
) -> StepResult:
    """Run one optimizer step (``log_now``: collect the log-step statistics).

    ``run.phase`` says how far it got, so that a failure knows whether the state is intact
    (:mod:`rootopt.train.run.failures`): ``data`` while reading and computing, ``update`` once
    the model, optimizer or scaler may change, ``between`` when the step is complete."""
    run.phase = "data"
    out = _step(run, data, hooks, log_now=log_now)
    run.phase = "between"
    return out


def _step(
    run: Run, data: Iterator[dict[str, torch.Tensor]], hooks: Hooks, *, log_now: bool
) -> StepResult:
    opt, sync = run.optimizer, run.sync
    opt.zero_grad(set_to_none=True)
    loss_sum, tokens = _accumulate(run, data)
    if hooks.after_backward is not None:
        hooks.after_backward(run.state.step, run.model)
    run.phase = "update"  # from here on the model/optimizer/scaler may change
    norm = sync.finish(run.precision)  # before any other collective of the step
    loss_sum, votes = _reduce_loss(run, loss_sum)
    grad_norm, step_loss, vote_signal, vote_time = torch.cat(
        [torch.stack([norm.double().cpu(), loss_sum.cpu()]), votes.cpu()]
    ).tolist()
    stop = (vote_signal > 0, vote_time > 0)
    lrs = [float(g["lr"]) for g in opt.param_groups]
    if not (math.isfinite(grad_norm) and math.isfinite(step_loss)):
        _skip(run)
        return StepResult(step_loss, grad_norm, False, lrs, tokens, stop=stop)
    grads = sync.clip_targets()
    clip_scale = run.clipper(grads, norm)
    stats: dict[str, Any] = {}
    before: dict[str, tuple[torch.Tensor, int]] = {}
    if log_now:  # what the update reads (reduced over the ranks where each holds a part)
        stats = {**grad_stats_of(grads, reduce=sync.partial), "clip_scale": clip_scale}
        before = param_sample(unwrap_model(run.model))
    _update(run, step_loss, grad_norm, log_now=log_now)
    comm = sync.comm_bytes() if log_now else None
    if comm is not None:
        stats["comm_bytes"] = comm
    ratios = update_ratios(before, unwrap_model(run.model)) if log_now else {}
    return StepResult(step_loss, grad_norm, True, lrs, tokens, stats, ratios, stop)


def _accumulate(run: Run, data: Iterator[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
    """Forward and backward of the step's micro-batches, gradients synchronised on the last
    one only: the sum of their weighted losses (on the device) and the tokens of the global
    micro-batches (every rank counts them)."""
    cfg, sync, st = run.cfg, run.sync, run.state
    accum = cfg.optimization.grad_accum_steps
    seq = cfg.data.seq_len if run.manifest["task"] == "lm" else 1
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    for i in range(accum):
        batch = next(data)
        st.batches += 1
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        with sync.no_sync(last=i == accum - 1):
            with sync.collectives("forward"), run.precision.autocast():
                loss = loss_fn(run.model(x), y) * (run.loss_weight / accum)
            with sync.collectives("backward"):
                run.precision.backward(loss)
        loss_sum += loss.detach().double()
    tokens = accum * cfg.data.batch_size * seq
    st.tokens += tokens
    return loss_sum, tokens


def _skip(run: Run) -> None:
    """A step whose gradient or loss is non-finite: nothing applied, the dynamic loss scale
    backs off, the schedule advances."""
    run.precision.skip(agreed=run.sync.agreed)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if run.controller is not None:
        run.controller.skipped_step(run.optimizer)


def _update(run: Run, step_loss: float, grad_norm: float, *, log_now: bool) -> None:
    """The optimizer step (with the loss scale's update), then the lr schedule."""
    opt, ctl = run.optimizer, run.controller
    if run.telemetry or ctl is not None:
        opt.telemetry_enabled = log_now or (ctl is not None and ctl.wants_telemetry)  # type: ignore[attr-defined]
    run.precision.step(opt, agreed=run.sync.agreed)
    run.scheduler.step()
    if ctl is not None:  # the learned controller scales the lr the schedule just set
        ctl.after_step(opt, step_loss, grad_norm)


def _reduce_loss(run: Run, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of the ranks' (weighted) losses = the global-batch loss, and the stop votes,
    in one small all-reduce. Every rank then takes the same skip, divergence, checkpoint
    and stop decisions (docs/distributed.md, "Training under torchrun"). One process: its
    loss, no votes."""
    if run.world_size == 1:
        return loss_sum, torch.zeros(2, dtype=torch.float64)
    from rootopt.distributed import collective

    t = torch.stack(
        [
            loss_sum,
            torch.tensor(run.vote[0], dtype=torch.float64, device=loss_sum.device),
            torch.tensor(run.vote[1], dtype=torch.float64, device=loss_sum.device),
        ]
    )
    collective("all_reduce step loss", torch.distributed.all_reduce, t)
    return t[0] / run.world_size, t[1:]


def grad_stats(params: list[torch.Tensor]) -> dict[str, float]:
    """Max |g| and min non-zero |g| over the parameters' gradients (FSDP2: over every
    rank's shards)."""
    grads = [_local(p.grad.detach()) for p in params if p.grad is not None]
    return grad_stats_of(grads, reduce=any(_is_dtensor(p) for p in params))


def grad_stats_of(grads: list[torch.Tensor], *, reduce: bool) -> dict[str, float]:
    """Max |g| and min non-zero |g| over the gradient tensors ``grads``, one tensor at a time
    (no concatenation); ``reduce``: each rank holds a part of them (FSDP2 shards, the parts
    an optimizer owns), so the two are reduced over the ranks."""
    if not grads and not reduce:
        return {}
    inf = torch.tensor(float("inf"), device=grads[0].device if grads else "cpu")
    maxes = torch.stack(
        [g.detach().abs().amax().float() if g.numel() else -inf for g in grads] or [-inf]
    )
    mins = torch.stack(
        [
            torch.where(g != 0, g.detach().abs(), inf).amin().float() if g.numel() else inf
            for g in grads
        ]
        or [inf]
    )
    both = torch.stack([maxes.max(), -mins.min()])
    if reduce:
        from rootopt.distributed import collective

        collective(
            "all_reduce grad stats",
            torch.distributed.all_reduce,
            both,
            op=torch.distributed.ReduceOp.MAX,
        )
    gmax, neg_min = both.tolist()
    gmin = -neg_min
    return {"grad_abs_max": gmax, "grad_abs_min": gmin if math.isfinite(gmin) else 0.0}


def param_sample(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """A strided sample of each parameter (exact for tensors up to RATIO_SAMPLE entries)."""
    out = {}
    for name, p in model.named_parameters():
        flat = _local(p.detach()).reshape(-1)  # FSDP2: this rank's shard
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
        new = _local(p.detach()).reshape(-1)[::stride].float()
        names.append(name)
        pairs.append(torch.stack([(new - old).norm(), old.norm()]))
    if not pairs:
        return {}
    values = torch.stack(pairs).tolist()
    return {n: d / max(b, 1e-12) for n, (d, b) in zip(names, values)}


@overload
def evaluate(run: Run, *, token_bytes: torch.Tensor | None = None) -> dict[str, float]: ...


@overload
def evaluate(
    run: Run, interrupt: Callable[[], bool] | None, *, token_bytes: torch.Tensor | None = None
) -> dict[str, float] | None: ...


@torch.no_grad()
def evaluate(
    run: Run,
    interrupt: Callable[[], bool] | None = None,
    *,
    token_bytes: torch.Tensor | None = None,
) -> dict[str, float] | None:
    """Validation loss (and bits per byte where ``token_bytes`` gives the UTF-8 bytes each
    token id stands for, or accuracy) over ``run.eval_batches`` batches;
    ``{}`` without a validation split; None when ``interrupt()`` turned true between
    batches (the model is back in training mode either way)."""
    stream = val_stream(run)
    if stream is None:
        return {}
    run.model.eval()
    try:
        return _evaluate(run, stream, interrupt, token_bytes)
    finally:
        run.model.train()


def _evaluate(
    run: Run,
    stream: Any,
    interrupt: Callable[[], bool] | None,
    token_bytes: torch.Tensor | None,
) -> dict[str, float] | None:
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    text_bytes = torch.zeros((), dtype=torch.int64, device=run.device)
    count = tokens = 0
    for i, batch in enumerate(stream):
        if i >= run.cfg.run.eval_batches:
            break
        if interrupt is not None and interrupt():
            return None
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        with run.precision.autocast():
            logits = run.model(x)
        total += loss_fn(logits, y).double() * y.size(0)
        count += y.size(0)
        if logits.ndim == 2:
            correct += (logits.argmax(-1) == y).sum()
        elif token_bytes is not None:
            text_bytes += token_bytes[y].sum()
            tokens += y.numel()
    if count == 0:
        return {}
    out = {"val_loss": float(total) / count}
    if run.manifest["task"] == "classify":
        out["val_accuracy"] = int(correct) / count
    elif tokens and int(text_bytes) > 0:
        # lm-evaluation-harness's bits_per_byte: the summed loss of the scored tokens in
        # bits over the UTF-8 bytes of the text they encode (every batch has the same
        # tokens per sample, so the mean loss times the tokens is the sum)
        out["val_bits_per_byte"] = out["val_loss"] * tokens / (math.log(2) * int(text_bytes))
    return out
