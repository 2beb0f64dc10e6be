"""The training loop, readable top to bottom. Components are built by :func:`setup`.

One optimizer step = ``grad_accum_steps`` micro-batches → unscale → global grad norm →
(non-finite? skip, count, log : clip → optimizer step) → lr schedule. Metrics every
``log_every`` steps, validation every ``eval_every``, checkpoints every ``checkpoint.every``
and at the end, on SIGTERM/SIGINT and at ``max_time``. A restarted run resumes from the
newest valid checkpoint and continues bit-identically (same model, optimizer, scaler,
schedule, clipper, RNG and data position).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import rootopt
from rootopt import checkpoint
from rootopt.config import Config, dump_yaml, to_dict
from rootopt.data import ShardStream, load_manifest, make_loader, prepare
from rootopt.monitor import Monitor, memory_bytes, plot_loss
from rootopt.train.build import (
    Precision,
    ProcessInfo,
    TrainingError,
    build_optimizer,
    process_info,
    resolve_device,
)
from rootopt.train.model import build_model, loss_fn
from rootopt.train.schedule import GradClipper, LRMultiplier, global_grad_norm

# --------------------------------------------------------------------------- state


@dataclass
class TrainState:
    """Counters that, with the components' state dicts, define where a run is."""

    step: int = 0  # optimizer steps attempted (applied + skipped)
    batches: int = 0  # micro-batches consumed by this rank: the data position
    tokens: int = 0  # tokens (or samples) consumed by this rank
    nonfinite_steps: int = 0
    elapsed: float = 0.0  # training seconds over all sessions

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Hooks:
    """Test and extension points; ``after_step`` returning True stops like a signal."""

    after_backward: Callable[[int, nn.Module], None] | None = None
    after_step: Callable[[int], bool] | None = None


@dataclass
class Run:
    """Everything the loop uses, built by :func:`setup`."""

    cfg: Config
    info: ProcessInfo
    device: torch.device
    run_dir: Path
    ckpt_dir: Path
    data_dir: Path
    manifest: dict[str, Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    clipper: GradClipper
    precision: Precision
    monitor: Monitor
    routing: str
    state: TrainState = field(default_factory=TrainState)
    resumed_from: str = ""


@dataclass
class Summary:
    status: str  # completed | interrupted | max_time
    steps: int
    wall_s: float
    steps_per_s: float
    tokens_per_s: float
    initial_loss: float
    final_loss: float
    val_loss: float
    nonfinite_steps: int
    checkpoint: str
    run_dir: str
    resumed_from: str


# --------------------------------------------------------------------------- setup


def resolve_data(cfg: Config, run_dir: Path, data_path: str | None, info: ProcessInfo) -> Path:
    """Prepared shards: ``--data_path``, else ``data.path``, else ``data.corpus`` prepared into the run dir."""
    path = data_path or cfg.data.path
    if path:
        load_manifest(path)  # fail early, with the shard error, if it is not a prepared directory
        return Path(path)
    out = run_dir / "data"
    want = {"corpus": cfg.data.corpus, "seq_len": cfg.data.seq_len, "seed": cfg.run.seed}
    try:
        have = load_manifest(out)
        if (
            all(have.get(k) == v for k, v in want.items())
            and have.get("text_bytes", cfg.data.max_bytes) <= cfg.data.max_bytes
        ):
            return out
    except ValueError:
        pass
    if info.is_main:
        prepare(
            cfg.data.corpus,
            out,
            seq_len=cfg.data.seq_len,
            max_bytes=cfg.data.max_bytes,
            samples_per_shard=cfg.data.samples_per_shard,
            val_fraction=cfg.data.val_fraction,
            seed=cfg.run.seed,
        )
    return out


def environment() -> dict[str, Any]:
    import numpy

    return {
        "rootopt": rootopt.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }


def setup(cfg: Config, run_dir: Path, data_path: str | None = None) -> Run:
    info = process_info(cfg)
    device = resolve_device(cfg, info)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    data_dir = resolve_data(cfg, run_dir, data_path, info)
    manifest = load_manifest(data_dir)
    torch.manual_seed(cfg.run.seed)
    try:
        model = build_model(cfg.model, manifest, cfg.data.seq_len).to(device)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    optimizer, routing = build_optimizer(cfg, model)
    o = cfg.optimization
    schedule = LRMultiplier(
        o.schedule, warmup=o.warmup_steps, total=cfg.run.max_steps, min_ratio=o.min_lr_ratio
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    c = o.clip
    clipper = GradClipper(
        c.mode, max_norm=c.max_norm, value=c.value, beta=c.adaptive_beta, factor=c.adaptive_factor
    )
    precision = Precision(cfg, device)
    m = cfg.monitoring
    prom = (m.prometheus.host, m.prometheus.port) if m.prometheus.enabled else None
    monitor = Monitor(
        run_dir, jsonl=m.jsonl, tensorboard=m.tensorboard, prometheus=prom, enabled=info.is_main
    )
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    if info.is_main:
        (run_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
        (run_dir / "env.json").write_text(
            json.dumps(environment(), indent=1) + "\n", encoding="utf-8"
        )
        if routing:
            (run_dir / "routing.txt").write_text(routing + "\n", encoding="utf-8")
    return Run(
        cfg,
        info,
        device,
        run_dir,
        ckpt_dir,
        data_dir,
        manifest,
        model,
        optimizer,
        scheduler,
        clipper,
        precision,
        monitor,
        routing,
    )


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(run: Run, reason: str) -> Path:
    payload = {
        "reason": reason,
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.precision.state_dict(),
        "clipper": run.clipper.state_dict(),
        "rng": checkpoint.rng_state(),
        "state": run.state.to_dict(),
        "config": to_dict(run.cfg),
        "data": {
            "manifest_sha256": _manifest_digest(run.manifest),
            "rank": run.info.rank,
            "world_size": run.info.world_size,
        },
    }
    path = checkpoint.save(
        run.ckpt_dir, run.state.step, payload, keep_last=run.cfg.checkpoint.keep_last
    )
    run.monitor.event("checkpoint", step=run.state.step, reason=reason, path=path.name)
    return path


def _manifest_digest(manifest: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(manifest["splits"], sort_keys=True).encode()).hexdigest()


def maybe_resume(run: Run, say: Callable[[str], None]) -> None:
    """Restore the newest valid checkpoint (``checkpoint.resume``), reporting corrupt ones."""
    mode = run.cfg.checkpoint.resume
    if mode == "never":
        return
    if mode == "auto":
        found, skipped = checkpoint.newest_valid(run.ckpt_dir)
        for line in skipped:
            say(f"skipping invalid checkpoint: {line}")
            run.monitor.event("checkpoint_invalid", detail=line)
        if found is None:
            return
        path, state = found.path, found.state
    else:
        path = Path(mode)
        try:
            state = checkpoint.load(path)
        except checkpoint.CheckpointError as exc:
            raise TrainingError(f"checkpoint.resume: {exc}") from None
    # Everything that shapes the parameters must match; recomputation settings may change.
    saved_model = {
        k: v for k, v in state["config"]["model"].items() if k != "activation_checkpointing"
    }
    wanted = {k: v for k, v in to_dict(run.cfg)["model"].items() if k != "activation_checkpointing"}
    if saved_model != wanted:
        diff = [
            f"model.{k}: {saved_model.get(k)!r} → {v!r}"
            for k, v in wanted.items()
            if saved_model.get(k) != v
        ]
        raise TrainingError(
            f"{path.name} was written for a different model ({'; '.join(diff)}); "
            "use a new --log_dir or checkpoint.resume=never"
        )
    if state["data"]["manifest_sha256"] != _manifest_digest(run.manifest):
        raise TrainingError(
            f"{path.name} was written for different data shards; resume needs the same --data_path"
        )
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    # LambdaLR also restores the multiplier's fields; keep the schedule of *this* config so a
    # run extended with a larger run.max_steps decays over the new length (unchanged config:
    # identical values, so resume stays exact).
    current = [dict(fn.__dict__) for fn in run.scheduler.lr_lambdas]
    run.scheduler.load_state_dict(state["scheduler"])
    for fn, fields in zip(run.scheduler.lr_lambdas, current):
        fn.__dict__.update(fields)
    run.precision.load_state_dict(state["scaler"])
    run.clipper.load_state_dict(state["clipper"])
    checkpoint.set_rng_state(state["rng"])
    run.state.__dict__.update(
        TrainState(**state["state"]).__dict__
    )  # in place: the loop holds a reference
    run.resumed_from = path.name
    run.monitor.event("resume", step=run.state.step, path=path.name)
    say(f"resumed from {path.name} at step {run.state.step}")


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    stream = ShardStream(
        run.data_dir,
        "val",
        batch_size=run.cfg.data.batch_size,
        seq_len=run.cfg.data.seq_len,
        verify=run.cfg.data.verify_checksums,
        loop=False,
    )
    run.model.eval()
    total, correct, count = 0.0, 0, 0
    for i, batch in enumerate(stream):
        if i >= run.cfg.run.eval_batches:
            break
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        with run.precision.autocast():
            logits = run.model(x)
        total += float(loss_fn(logits, y)) * y.size(0)
        count += y.size(0)
        if logits.ndim == 2:
            correct += int((logits.argmax(-1) == y).sum())
    run.model.train()
    if count == 0:
        return {}
    out = {"val_loss": total / count}
    if run.manifest["task"] == "classify":
        out["val_accuracy"] = correct / count
    else:
        out["val_bits_per_byte"] = out["val_loss"] / math.log(2)
    return out


# --------------------------------------------------------------------------- the loop


class StopFlag:
    """Set by SIGTERM/SIGINT (checkpoint, then stop) or a hook."""

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(ValueError):  # not the main thread: no handlers
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # second signal: give up immediately
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _batches(run: Run) -> Iterator[dict[str, torch.Tensor]]:
    d = run.cfg.data
    stream = ShardStream(
        run.data_dir,
        "train",
        batch_size=d.batch_size,
        seq_len=d.seq_len,
        rank=run.info.rank,
        world_size=run.info.world_size,
        seed=run.cfg.run.seed,
        shuffle=d.shuffle,
        verify=d.verify_checksums,
        start_batch=run.state.batches,
        num_workers=d.num_workers,
    )
    return iter(make_loader(stream, d.num_workers))


def _update_ratios(before: dict[str, torch.Tensor], model: nn.Module) -> dict[str, float]:
    out = {}
    for name, p in model.named_parameters():
        if name in before:
            denom = float(before[name].norm())
            out[name] = float((p.detach().float() - before[name]).norm()) / max(denom, 1e-12)
    return out


def train(
    cfg: Config,
    run_dir: Path,
    data_path: str | None = None,
    *,
    hooks: Hooks | None = None,
    say: Callable[[str], None] = print,
) -> Summary:
    hooks = hooks or Hooks()
    run = setup(cfg, run_dir, data_path)
    try:
        return _train(run, hooks, say)
    finally:
        run.monitor.close()


def _train(run: Run, hooks: Hooks, say: Callable[[str], None]) -> Summary:
    cfg, model, opt, st = run.cfg, run.model, run.optimizer, run.state
    main = run.info.is_main
    if main and run.routing:
        say(run.routing)
    if main:
        say(
            f"{run.precision.description}; data: {run.data_dir} ({run.manifest['corpus']}); run dir: {run.run_dir}"
        )
    maybe_resume(run, say)
    params = [p for p in model.parameters() if p.requires_grad]
    telemetry = hasattr(opt, "telemetry_enabled") and cfg.optimization.telemetry
    seq = cfg.data.seq_len if run.manifest["task"] == "lm" else 1
    batches = _batches(run)
    stop = StopFlag(cfg.checkpoint.on_signal)
    status, last_ckpt, val = "completed", "", {}
    first_loss = float("nan")
    window: list[float] = []
    t_session, t_window, steps_window, tokens_window = (
        time.perf_counter(),
        time.perf_counter(),
        0,
        0,
    )
    elapsed_before = st.elapsed
    bar = None
    if main and cfg.monitoring.progress_bar:
        from tqdm import tqdm

        bar = tqdm(
            total=cfg.run.max_steps,
            initial=st.step,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )
    model.train()
    try:
        while st.step < cfg.run.max_steps:
            # ---- stop conditions (checked between steps, so the state is consistent)
            if stop.signal is not None:
                status = "interrupted"
                break
            # max_time limits this session (a job's time slot); a rerun continues from the checkpoint.
            if cfg.run.max_time and time.perf_counter() - t_session >= cfg.run.max_time:
                status = "max_time"
                break
            log_now = (st.step + 1) % cfg.run.log_every == 0 or st.step + 1 == cfg.run.max_steps

            # ---- forward / backward over the micro-batches
            opt.zero_grad(set_to_none=True)
            step_loss = 0.0
            for _ in range(cfg.optimization.grad_accum_steps):
                batch = next(batches)
                st.batches += 1
                x, y = batch["input"].to(run.device), batch["target"].to(run.device)
                with run.precision.autocast():
                    loss = loss_fn(model(x), y) / cfg.optimization.grad_accum_steps
                run.precision.backward(loss)
                step_loss += float(loss.detach())
                st.tokens += y.size(0) * seq
                tokens_window += y.size(0) * seq
            if hooks.after_backward is not None:
                hooks.after_backward(st.step, model)

            # ---- unscale, check, clip, step
            run.precision.unscale(opt, params)
            grad_norm = float(global_grad_norm(params))
            record: dict[str, Any] = {}
            if not math.isfinite(grad_norm) or not math.isfinite(step_loss):
                st.nonfinite_steps += 1
                run.precision.skip()
                run.monitor.nonfinite_step()
                run.monitor.event(
                    "nonfinite_step",
                    step=st.step + 1,
                    grad_norm=grad_norm,
                    loss=step_loss,
                    loss_scale=run.precision.scale,
                )
                opt.zero_grad(set_to_none=True)
            else:
                run.monitor.grad_norm(grad_norm)
                clip_scale = run.clipper(params, torch.tensor(grad_norm))
                before = (
                    {n: p.detach().float().clone() for n, p in model.named_parameters()}
                    if log_now
                    else {}
                )
                if log_now:
                    g = torch.cat(
                        [
                            p.grad.detach().abs().flatten().float()
                            for p in params
                            if p.grad is not None
                        ]
                    )
                    nz = g[g > 0]
                    record.update(
                        grad_abs_max=float(g.max()),
                        grad_abs_min=float(nz.min()) if nz.numel() else 0.0,
                        clip_scale=clip_scale,
                    )
                if telemetry:
                    opt.telemetry_enabled = log_now  # type: ignore[attr-defined]
                run.precision.step(opt)
                if log_now:
                    ratios = _update_ratios(before, model)
            lr_used = opt.param_groups[0]["lr"]
            run.scheduler.step()
            st.step += 1
            steps_window += 1
            window.append(step_loss)
            if math.isnan(first_loss):
                first_loss = step_loss

            # ---- metrics
            if log_now:
                now = time.perf_counter()
                dt = max(now - t_window, 1e-9)
                finite = [v for v in window if math.isfinite(v)]
                memory = memory_bytes()
                record = {
                    "step": st.step,
                    "loss": statistics.fmean(finite) if finite else float("nan"),
                    "lr": lr_used,
                    "grad_norm": grad_norm,
                    "steps_per_s": steps_window / dt,
                    "tokens_per_s": tokens_window / dt,
                    "step_time_s": dt / steps_window,
                    "loss_scale": run.precision.scale,
                    "nonfinite_steps": st.nonfinite_steps,
                    "tokens": st.tokens,
                    **record,
                    "memory_rss_bytes": memory["rss"],
                }
                labelled: dict[str, dict[str, float]] = {"rootopt_memory_bytes": memory}
                if "grad_abs_max" in record:
                    labelled["rootopt_update_param_ratio"] = ratios
                    vals = sorted(ratios.values())
                    record["update_ratio_median"] = vals[len(vals) // 2]
                    record["update_ratio_max"] = vals[-1]
                tel = getattr(opt, "telemetry", None) if telemetry else None
                if tel:
                    labelled["rootopt_root_clip_fraction"] = {
                        k: float(v["clip_fraction"]) for k, v in tel.items()
                    }
                    labelled["rootopt_root_eps"] = {k: float(v["eps"]) for k, v in tel.items()}
                    record["root_clip_fraction"] = statistics.fmean(
                        labelled["rootopt_root_clip_fraction"].values()
                    )
                    record["root_eps_mean"] = statistics.fmean(
                        labelled["rootopt_root_eps"].values()
                    )
                    record["root_ortho_residual"] = statistics.fmean(
                        float(v["ortho_residual"]) for v in tel.values()
                    )
                run.monitor.log(record, labelled)
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{record['loss']:.3f}",
                        lr=f"{record['lr']:.1e}",
                        tok_s=f"{record['tokens_per_s']:.0f}",
                        refresh=False,
                    )
                window, t_window, steps_window, tokens_window = [], now, 0, 0
            hist = cfg.monitoring.histogram_every
            if hist and st.step % hist == 0:
                run.monitor.histograms(st.step, model)
            if (
                cfg.run.eval_every
                and st.step % cfg.run.eval_every == 0
                and st.step < cfg.run.max_steps
            ):
                val = evaluate(run)
                run.monitor.log({"step": st.step, **val})
            if bar is not None:
                bar.update(1)
            st.elapsed = elapsed_before + time.perf_counter() - t_session
            if st.step % cfg.checkpoint.every == 0 and st.step < cfg.run.max_steps:
                last_ckpt = save_checkpoint(run, "periodic").name
            if hooks.after_step is not None and hooks.after_step(st.step):
                stop.signal = stop.signal or -1  # same path as SIGTERM: checkpoint, then stop
    except torch.OutOfMemoryError:
        run.monitor.event("oom", step=st.step + 1, batch_size=cfg.data.batch_size)
        raise TrainingError(
            f"out of memory at step {st.step + 1} (batch_size={cfg.data.batch_size}); reduce data.batch_size "
            "(use optimization.grad_accum_steps to keep the global batch) or set model.activation_checkpointing=true"
        ) from None
    except RuntimeError as exc:
        if "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower():
            run.monitor.event("timeout", step=st.step + 1, detail=str(exc).splitlines()[0])
            raise TrainingError(
                f"collective timed out at step {st.step + 1}: {str(exc).splitlines()[0]}"
            ) from None
        raise
    finally:
        stop.restore()
        if bar is not None:
            bar.close()

    # ---- the end: evaluate, checkpoint, summarise
    st.elapsed = elapsed_before + time.perf_counter() - t_session
    if status == "completed":
        val = evaluate(run)
        if val:
            run.monitor.log({"step": st.step, **val})
    last_ckpt = save_checkpoint(run, status if status != "completed" else "final").name
    session_s = time.perf_counter() - t_session
    if main and cfg.monitoring.plot:
        plot_loss(run.run_dir)
    from rootopt.monitor import read_jsonl

    losses = [r["loss"] for r in read_jsonl(run.run_dir / "metrics.jsonl") if "loss" in r]
    summary = Summary(
        status=status,
        steps=st.step,
        wall_s=session_s,
        steps_per_s=st.step / st.elapsed if st.elapsed else 0.0,
        tokens_per_s=st.tokens / st.elapsed if st.elapsed else 0.0,
        initial_loss=losses[0] if losses else first_loss,
        final_loss=losses[-1] if losses else float("nan"),
        val_loss=val.get("val_loss", float("nan")),
        nonfinite_steps=st.nonfinite_steps,
        checkpoint=last_ckpt,
        run_dir=str(run.run_dir),
        resumed_from=run.resumed_from,
    )
    if main:
        (run.run_dir / "summary.json").write_text(
            json.dumps(summary.__dict__, indent=1) + "\n", encoding="utf-8"
        )
    return summary
