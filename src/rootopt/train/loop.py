"""The training loop, readable top to bottom; its pieces live next to it.

``setup`` builds a :class:`~rootopt.train.state.Run` (components are built outside the loop);
``train`` takes ownership of the checkpoint directory, resumes, checks every shard, then runs
``train_step`` → ``account`` → divergence policy → log → evaluate → checkpoint until
``run.max_steps``, a signal or ``run.max_time``. A restarted run resumes from the newest
valid checkpoint and continues bit-identically (model, optimizer, scaler, schedule, clipper,
RNG, data position and the open logging window). A fatal error after step 1 writes an
emergency checkpoint when the state is consistent, then stops with one line.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rootopt
from rootopt import checkpoint
from rootopt.config import Config, ConfigError, dump_yaml
from rootopt.data import CorpusError, ShardError, load_manifest
from rootopt.dist import CollectiveError, CollectiveTimeoutError
from rootopt.monitor import Monitor, plot_loss, read_jsonl
from rootopt.train.build import (
    Precision,
    TrainingError,
    barrier,
    build_optimizer,
    parallelize,
    process_info,
    resolve_device,
)
from rootopt.train.data import batches, check_data, resolve_data
from rootopt.train.model import build_model
from rootopt.train.records import (
    Clock,
    Diverged,
    account,
    build_record,
    close_window,
    divergence,
    healthy,
)
from rootopt.train.resume import (
    StopFlag,
    last_good,
    last_good_after_divergence,
    maybe_resume,
    params_finite,
    run_identity,
    save_checkpoint,
    take_ownership,
)
from rootopt.train.schedule import GradClipper, LRMultiplier
from rootopt.train.state import Hooks, Run, Summary, TrainState
from rootopt.train.step import evaluate, train_step

__all__ = ["Hooks", "Run", "Summary", "TrainState", "evaluate", "resolve_data", "setup", "train"]


# --------------------------------------------------------------------------- setup


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


def _make_run_dir(run_dir: Path, rank: int = 0) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"--log_dir {str(run_dir)!r} exists and is not a directory"])
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / (".rootopt-write-test" + (f"-{rank}" if rank else ""))
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            [f"--log_dir {str(run_dir)!r} is not writable ({exc.strerror or exc})"]
        ) from None


def _model(cfg: Config, manifest: dict[str, Any], device: torch.device) -> torch.nn.Module:
    vocab = manifest.get("vocab_size")
    if cfg.model.kind == "llama" and isinstance(vocab, int) and cfg.model.vocab_size < vocab:
        raise ConfigError(
            [
                f"model.vocab_size: {cfg.model.vocab_size} is smaller than the data's vocabulary "
                f"({vocab} tokens); set model.vocab_size >= {vocab}"
            ]
        )
    try:
        need = _training_bytes(cfg, manifest)
        have = _physical_memory()
        if device.type == "cpu" and have and need > have:
            m = cfg.model
            raise ConfigError(
                [
                    f"model: d_model={m.d_model}, n_layers={m.n_layers} needs about "
                    f"{need / 2**30:.1f} GiB for parameters, gradients and optimizer state; "
                    f"this machine has {have / 2**30:.1f} GiB"
                ]
            )
        return build_model(cfg.model, manifest, cfg.data.seq_len).to(device)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    except (MemoryError, RuntimeError) as exc:  # e.g. DefaultCPUAllocator: not enough memory
        m = cfg.model
        raise ConfigError(
            [
                f"model: cannot allocate the model (d_model={m.d_model}, n_layers={m.n_layers}, "
                f"vocab_size={m.vocab_size}): {str(exc).splitlines()[0][:100]}"
            ]
        ) from None


def _training_bytes(cfg: Config, manifest: dict[str, Any]) -> int:
    """fp32 parameters + gradients + two optimizer moments, counted on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg.model, manifest, cfg.data.seq_len)
    return 16 * sum(p.numel() for p in model.parameters())


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _monitor(cfg: Config, run_dir: Path, is_main: bool) -> Monitor:
    m = cfg.monitoring
    prom = (m.prometheus.host, m.prometheus.port) if m.prometheus.enabled else None
    try:
        return Monitor(
            run_dir, jsonl=m.jsonl, tensorboard=m.tensorboard, prometheus=prom, enabled=is_main
        )
    except OSError as exc:
        if prom is None:
            raise
        raise ConfigError(
            [
                f"monitoring.prometheus: cannot serve on {prom[0]}:{prom[1]} "
                f"({exc.strerror or exc}); choose another port (0 = any free port) or host"
            ]
        ) from None


def setup(cfg: Config, run_dir: Path, data_path: str | None = None) -> Run:
    info = process_info(cfg)
    controller = None
    if cfg.optimization.controller:  # loaded (or refused) before anything is created
        if info.world_size > 1:  # it reads ROOT telemetry, which the sharded step does not gather
            raise ConfigError(
                ["optimization.controller runs in one process only; unset it or launch one process"]
            )
        from rootopt.rl.controller import load_controller

        o = cfg.optimization
        controller = load_controller(
            o.controller, total_steps=cfg.run.max_steps, optimizer=o.optimizer
        )
    device = resolve_device(cfg, info)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    _make_run_dir(run_dir, info.rank)
    data_dir = resolve_data(cfg, run_dir, data_path, info)
    barrier(info, "barrier after data preparation")  # rank 0 prepares the run-dir data
    manifest = load_manifest(data_dir)
    torch.manual_seed(cfg.run.seed)  # the same initial parameters on every rank
    model = parallelize(cfg, _model(cfg, manifest, device), info)
    optimizer, routing = build_optimizer(cfg, model, info.world_size)
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
    if info.world_size > 1:
        precision.description += (
            f"; {info.world_size} processes ({cfg.distributed.parallel}, "
            f"{torch.distributed.get_backend()}), global batch {cfg.data.batch_size}"
        )
        if o.telemetry and o.optimizer.lower() in ("root", "muon"):
            precision.description += "; ROOT telemetry is off at world size > 1"
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    run_id = run_identity(cfg, run_dir, ckpt_dir, data_dir) if info.is_main else ""
    monitor = _monitor(cfg, run_dir, info.is_main)
    if info.is_main:
        (run_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
        (run_dir / "env.json").write_text(
            json.dumps(environment(), indent=1) + "\n", encoding="utf-8"
        )
        if routing:
            (run_dir / "routing.txt").write_text(routing + "\n", encoding="utf-8")
    return Run(
        cfg=cfg,
        info=info,
        device=device,
        run_dir=run_dir,
        ckpt_dir=ckpt_dir,
        data_dir=data_dir,
        manifest=manifest,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        clipper=clipper,
        precision=precision,
        monitor=monitor,
        routing=routing,
        run_id=run_id,
        params=[p for p in model.parameters() if p.requires_grad],
        telemetry=hasattr(optimizer, "telemetry_enabled") and o.telemetry and info.world_size == 1,
        controller=controller,
    )


# --------------------------------------------------------------------------- the loop


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
        if run.info.is_main:  # rank 0 owns the run's files; other ranks only read them
            take_ownership(run)
        return _train(run, hooks, say)
    finally:
        run.monitor.close()
        run.release()


def _train(run: Run, hooks: Hooks, say: Callable[[str], None]) -> Summary:
    cfg = run.cfg
    if run.info.is_main:
        if run.routing:
            say(run.routing)
        say(
            f"{run.precision.description}; data: {run.data_dir} ({run.manifest['corpus']}); "
            f"run dir: {run.run_dir}"
        )
    maybe_resume(run, say)
    run.monitor.supersede_after(run.state.step)
    _flush_open_window(run)
    check_data(run)
    run.monitor.event("start", step=run.state.step, precision=run.precision.name)
    clock = Clock(run.state)
    stop = StopFlag(cfg.checkpoint.on_signal)
    bar = _progress_bar(run)
    run.model.train()
    try:
        status = _loop(run, hooks, clock, stop, bar)
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
    return _finish(run, status, clock, stop.signal)


def _loop(run: Run, hooks: Hooks, clock: Clock, stop: StopFlag, bar: Any) -> str:
    cfg = run.cfg
    data = batches(run)
    checkpoint_due = False
    while run.state.step < cfg.run.max_steps:
        # ---- stop conditions (checked between steps, so the state is consistent)
        # max_time limits this session (a job's time slot); a rerun continues from the checkpoint.
        out_of_time = bool(cfg.run.max_time and clock.since_session() >= cfg.run.max_time)
        if run.world_size == 1:
            if stop.signal is not None:
                return "interrupted"
            if out_of_time:
                return "max_time"
        else:  # several ranks: vote in the next step's reduction, stop together after it
            if run.stop_status:
                return run.stop_status
            run.vote = (float(stop.signal is not None), float(out_of_time))
        st = run.state
        log_now = (st.step + 1) % cfg.run.log_every == 0 or st.step + 1 == cfg.run.max_steps
        at_start = (st.copy(), checkpoint.rng_state())
        try:
            # ---- one optimizer step
            run.phase = "data"
            out = train_step(run, data, hooks, log_now=log_now)
            run.phase = "between"
            if out.stop[0]:
                run.stop_status, stop.signal = "interrupted", stop.signal or -1
            elif out.stop[1]:
                run.stop_status = "max_time"
            account(st, out)
            clock.steps += 1
            if out.applied:
                run.monitor.grad_norm(out.grad_norm)
            else:
                run.monitor.nonfinite_step()
                run.monitor.event(
                    "nonfinite_step",
                    step=st.step,
                    grad_norm=out.grad_norm,
                    loss=out.loss,
                    loss_scale=run.precision.scale,
                )
            reason = divergence(run, out)
            # ---- metrics
            if log_now or reason:
                record, labelled = build_record(run, out, clock)
                run.monitor.log(record, labelled)
                close_window(st, clock)
                if bar is not None:
                    loss = record["loss"]
                    bar.set_postfix(
                        loss=f"{loss:.3f}" if loss is not None else "nan",
                        lr=f"{record['lr']:.1e}",
                        refresh=False,
                    )
            if reason:
                _diverged(run, reason)
            hist = cfg.monitoring.histogram_every
            if hist and st.step % hist == 0:
                run.monitor.histograms(st.step, run.model)
            # ---- evaluation
            if (
                cfg.run.eval_every
                and st.step % cfg.run.eval_every == 0
                and st.step < cfg.run.max_steps
            ):
                val = evaluate(run)
                if val:
                    run.monitor.log({"step": st.step, **val})
            if bar is not None:
                bar.update(1)
            st.elapsed = clock.elapsed0 + clock.since_session()
            # ---- checkpoint (deferred while a divergence streak is open: never a bad one)
            checkpoint_due = checkpoint_due or st.step % cfg.checkpoint.every == 0
            if checkpoint_due and st.step < cfg.run.max_steps and healthy(st):
                if not params_finite(run):
                    _diverged(run, "parameters became non-finite")
                save_checkpoint(run, "periodic")
                checkpoint_due = False
        except (ShardError, CorpusError, OSError, torch.OutOfMemoryError, RuntimeError) as exc:
            if isinstance(exc, TrainingError):
                raise
            _fatal(run, exc, at_start)
        if hooks.after_step is not None and hooks.after_step(run.state.step):
            stop.signal = stop.signal or -1  # same path as SIGTERM: checkpoint, then stop
    return "completed"


def _flush_open_window(run: Run) -> None:
    """Write the record a failed log write left behind (emergency checkpoint at a log step)."""
    st, r = run.state, run.cfg.run
    if st.window_steps and (st.step % r.log_every == 0 or st.step == r.max_steps):
        run.monitor.log(
            {
                "step": st.step,
                "loss": st.window_loss_sum / st.window_finite if st.window_finite else None,
                "steps": st.window_steps,
                "finite_steps": st.window_finite,
                "nonfinite_steps": st.nonfinite_steps,
                "tokens": st.tokens,
                "recovered": True,
            }
        )
        close_window(st, Clock(st))


def _progress_bar(run: Run) -> Any:
    if not (run.info.is_main and run.cfg.monitoring.progress_bar):
        return None
    from tqdm import tqdm

    return tqdm(
        total=run.cfg.run.max_steps,
        initial=run.state.step,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )


# --------------------------------------------------------------------------- failures


def _diverged(run: Run, reason: str) -> None:
    st = run.state
    hint = "lower optimization.base_lr"
    if run.precision.name == "fp16":
        hint += " or check mixed_precision.loss_scale"
    run.monitor.event(
        "diverged",
        step=st.step,
        reason=reason,
        precision=run.precision.name,
        checkpoint=run.good_checkpoint,
        trouble_since=st.trouble_since,
    )
    kept = last_good_after_divergence(run)
    _write_summary(run, "diverged", -1)
    raise Diverged(f"diverged at step {st.step}: {reason}; {kept}; {hint} and rerun to resume")


def _fatal(run: Run, exc: BaseException, at_start: tuple[TrainState, dict[str, Any]]) -> None:
    """Write an emergency checkpoint when the state is consistent, then raise one line."""
    st = run.state
    step_no = st.step + 1 if run.phase != "between" else st.step
    kind, detail = _describe(exc)
    if isinstance(exc, RuntimeError) and kind == "runtime":
        raise exc  # not a known failure: keep the traceback
    run.monitor.event(kind, step=step_no, detail=detail[:300])
    note = ""
    if run.world_size > 1:  # the other ranks may not reach a collective save
        note = f"no emergency checkpoint at world size > 1; {last_good(run)}"
    elif run.phase == "update":
        note = f"the step was mid-update, no emergency checkpoint; {last_good(run)}"
    else:
        if run.phase == "data":  # roll back to the start of the unfinished step
            run.state = at_start[0]
            checkpoint.set_rng_state(at_start[1])
        run.phase = "between"
        note = _emergency(run)
    if kind == "oom":
        b = run.cfg.data.batch_size
        msg = (
            f"out of memory at step {step_no} (batch_size={b}); reduce data.batch_size "
            "(use optimization.grad_accum_steps to keep the global batch) or set "
            f"model.activation_checkpointing=true; {note}"
        )
    elif kind in ("collective", "timeout"):
        msg = f"{detail} (at step {step_no}); {note}"
    else:
        msg = f"{detail} (at step {step_no}); {note}"
    if isinstance(exc, (ShardError, CorpusError)):
        raise ShardError(msg) from None
    raise TrainingError(msg) from None


def _describe(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", str(exc).splitlines()[0] if str(exc) else "out of memory"
    if isinstance(exc, (ShardError, CorpusError)):
        return "data_error", str(exc)
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return "io_error", f"I/O error: {exc.strerror or exc}{where}"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # rootopt.dist's errors name rank, operation and timeout; the kind is the exception's
    # type (decided from the elapsed time there), never its text
    if isinstance(exc, CollectiveTimeoutError):
        return "timeout", text
    if isinstance(exc, (CollectiveError, torch.distributed.DistError)):
        return "collective", text
    return "runtime", text


def _emergency(run: Run) -> str:
    st = run.state
    if run.last_checkpoint == f"ckpt-{st.step:08d}.pt":
        return f"checkpoint {run.last_checkpoint} holds step {st.step}; rerun to resume"
    if st.step == 0:
        return "no step was completed, nothing to save"
    if not (healthy(st) and params_finite(run)):
        return f"a divergence streak is open, no emergency checkpoint; {last_good(run)}"
    try:
        path = save_checkpoint(run, "emergency")
    except TrainingError as err:
        return f"emergency checkpoint failed ({str(err).split(';')[0]}); {last_good(run)}"
    return f"emergency checkpoint {path.name} written; rerun to resume"


# --------------------------------------------------------------------------- the end


def _finish(run: Run, status: str, clock: Clock, signum: int | None) -> Summary:
    """Final checkpoint, final evaluation, summary."""
    st, cfg = run.state, run.cfg
    session_steps = st.step - clock.step0
    st.elapsed = clock.elapsed0 + clock.since_session()
    val: dict[str, float] = {}
    if session_steps or status != "completed":
        if run.last_checkpoint != f"ckpt-{st.step:08d}.pt" and st.step > 0:
            if not params_finite(run):
                _diverged(run, "parameters became non-finite")
            save_checkpoint(run, status if status != "completed" else "final")
        if status == "completed":
            val = evaluate(run)
            if val:
                run.monitor.log({"step": st.step, **val})
    if run.info.is_main and cfg.monitoring.plot:
        plot_loss(run.run_dir)
    return _write_summary(run, status, session_steps, val, clock, signum)


def _write_summary(
    run: Run,
    status: str,
    session_steps: int,
    val: dict[str, float] | None = None,
    clock: Clock | None = None,
    signum: int | None = None,
) -> Summary:
    st = run.state
    wall = clock.since_session() if clock is not None else 0.0
    rows = read_jsonl(run.run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    vals = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), (int, float))]
    summary = Summary(
        status=status,
        steps=st.step,
        session_steps=session_steps,
        wall_s=wall,
        steps_per_s=session_steps / wall if wall else 0.0,
        tokens_per_s=(st.tokens - clock.tokens0) / wall if clock is not None and wall else 0.0,
        initial_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"),
        val_loss=(val or {}).get("val_loss", vals[-1] if vals else float("nan")),
        nonfinite_steps=st.nonfinite_steps,
        checkpoint=run.last_checkpoint,
        run_dir=str(run.run_dir),
        resumed_from=run.resumed_from,
        signal=signum if signum and signum > 0 else 0,
    )
    if run.info.is_main:
        from rootopt.monitor import strict

        (run.run_dir / "summary.json").write_text(
            json.dumps(strict(summary.__dict__), indent=1, allow_nan=False) + "\n",
            encoding="utf-8",
        )
    return summary
