"""The training loop, readable top to bottom; its pieces live next to it.

``setup`` builds a :class:`~rootopt.train.state.Run`: rank 0 first checks everything the run
depends on and only then writes (:mod:`rootopt.train.plan`), every rank builds its
components, and each phase's failures are agreed across ranks (:mod:`rootopt.train.agree`).
``train`` then resumes, checks every shard, and runs ``train_step`` → ``account`` →
divergence policy → log → evaluate → checkpoint until ``run.max_steps``, a signal or
``run.max_time``. A restarted run resumes from the newest valid checkpoint and continues
bit-identically (model, optimizer, scaler, schedule, clipper, RNG, data position, the open
logging window, and an evaluation the previous session did not finish). A fatal error after
step 1 writes an emergency checkpoint when the state is consistent, then stops with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import rootopt
from rootopt import checkpoint
from rootopt._atomic import atomic_write
from rootopt.config import Config, ConfigError, config_warnings, dump_yaml
from rootopt.data import CorpusError, ShardError, load_manifest
from rootopt.distributed import CollectiveError, CollectiveTimeoutError
from rootopt.monitor import Monitor, plot_loss, read_jsonl
from rootopt.train import ckpts
from rootopt.train import plan as planning
from rootopt.train.agree import JobError, agreed, broadcast, gather
from rootopt.train.build import (
    Precision,
    ProcessInfo,
    TrainingError,
    build_optimizer,
    parallelize,
    process_info,
    resolve_device,
)
from rootopt.train.data import batches, check_data
from rootopt.train.mfu import device_peak, flops_per_token
from rootopt.train.model import build_model, with_vocab
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
    interruptible,
    last_good,
    last_good_after_divergence,
    params_finite,
    resume,
    save_checkpoint,
)
from rootopt.train.rundir import Locks, default_run_dir, identity_key, other_runs_note
from rootopt.train.schedule import GradClipper, LRMultiplier
from rootopt.train.state import Hooks, Run, Summary, TrainState
from rootopt.train.step import evaluate, train_step

__all__ = ["Hooks", "Run", "Summary", "TrainState", "evaluate", "setup", "train"]

# True from the first step of a session on (the command line words an interruption by it)
TRAINING = False


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
        # the vector ISA torch's CPU kernels use: without AVX-512 bf16 hardware a bfloat16
        # matmul is emulated and several times slower than float32 (docs/performance.md)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }


def _model(
    cfg: Config, manifest: dict[str, Any], device: torch.device, *, fresh: bool = True
) -> torch.nn.Module:
    """The model of ``cfg`` (vocabulary resolved) on ``device``; a new run (``fresh``)
    starts from ``model.init_from``'s weights when set. Every refusal is one ConfigError line."""
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
        model = build_model(cfg.model, manifest, cfg.data.seq_len)
        if fresh and cfg.model.init_from:
            from rootopt.train.hf import load_init

            load_init(model, cfg.model)
        return model.to(device)
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


def _resolved(cfg: Config, manifest: dict[str, Any]) -> Config:
    """``cfg`` with the model's vocabulary resolved from the data's tokenizer: what the
    run records (config.yaml, checkpoints)."""
    try:
        return with_vocab(cfg, manifest)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


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


def _agree_on_run(
    info: ProcessInfo, cfg: Config, data_path: str | None, run_dir: Path, explicit: bool
) -> None:
    """Every rank must describe the same run: the same resolved config and data (and so,
    without ``--log_dir``, the same default run directory). Rank 0 reports a mismatch."""
    mine = (identity_key(cfg, data_path), "" if explicit else str(run_dir))
    seen = gather(info, mine, "run identity")
    for rank, other in enumerate(seen):
        if other != seen[0]:
            what = (
                f"run directory {other[1]!r} instead of {seen[0][1]!r}"
                if other[1] != seen[0][1]
                else "another config"
            )
            raise JobError(
                2,
                [
                    f"rank {rank}/{info.world_size} was started for {what} (config or "
                    "--data_path differ from rank 0's); start every rank with the same command"
                ],
                speak=info.is_main,
            )


def setup(
    cfg: Config,
    run_dir: Path | None,
    data_path: str | None = None,
    *,
    say: Callable[[str], None] = print,
    config_path: str | None = None,
) -> tuple[Run, Locks]:
    """Check, then write, then build: see the module docstring. ``run_dir`` None is the
    default ``runs/<name>-<key>`` (:mod:`rootopt.train.rundir`)."""
    info = process_info(cfg)
    explicit = run_dir is not None
    chosen = run_dir if run_dir is not None else default_run_dir(cfg, data_path, config_path)
    if info.world_size > 1:
        _agree_on_run(info, cfg, data_path, chosen, explicit)
    if info.is_main:
        if info.note:
            say(info.note)
        for line in config_warnings(cfg):
            say(f"warning: {line}")
        say(f"run dir: {chosen}")
        if not explicit:
            note = other_runs_note(cfg, data_path, config_path, chosen)
            if note:
                say(f"note: {note}")

    def check() -> planning.Plan | planning.Complete | None:
        if not info.is_main:
            return None
        try:
            return planning.check(cfg, chosen, data_path, say)
        except planning.AlreadyComplete as done:  # a read-only directory, nothing to do
            return done.done

    checked = agreed(info, check, what="checks before writing")
    done = broadcast(info, checked if isinstance(checked, planning.Complete) else None, "complete")
    if done is not None:
        raise planning.AlreadyComplete(done)
    plan = checked if isinstance(checked, planning.Plan) else None
    locks = plan.locks if plan is not None else Locks()
    try:
        return _build(cfg, info, plan, say), locks
    except BaseException:
        planning.abandon(plan)  # the data it staged, when it stopped before writing
        locks.abandon()
        raise


def _build(
    cfg0: Config, info: ProcessInfo, plan: planning.Plan | None, say: Callable[[str], None]
) -> Run:
    public: dict[str, Any] = broadcast(info, plan.public() if plan else None, "run plan")
    run_dir, ckpt_dir = Path(public["run_dir"]), Path(public["ckpt_dir"])
    data_dir = Path(public["data_dir"])
    if info.is_main and plan is not None:
        kept = plan.ckpt_dir / ckpts.INVALID
        for line in plan.skipped:
            moved = any(line.startswith(f"{e.name}:") for e in plan.invalid)
            say(f"skipping invalid checkpoint: {line}" + (f" (kept in {kept})" if moved else ""))
        if plan.choice is not None and plan.choice.note:
            say(f"note: {plan.choice.note}")

    cfg = agreed(info, lambda: _resolved(cfg0, public["meta"]), what="building the model")

    def components() -> tuple[Any, torch.device, torch.nn.Module]:
        controller = None
        if cfg.optimization.controller:  # loaded (or refused) before anything is created
            if (
                info.world_size > 1
            ):  # it reads ROOT telemetry, which the sharded step does not gather
                raise ConfigError(
                    [
                        "optimization.controller runs in one process only; unset it or "
                        "launch one process"
                    ]
                )
            from rootopt.rl.controller import load_controller

            o = cfg.optimization
            controller = load_controller(
                o.controller, total_steps=cfg.run.max_steps, optimizer=o.optimizer
            )
        device = resolve_device(cfg, info)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)  # the same initial parameters on every rank
        fresh = public["choice"] is None
        return controller, device, _model(cfg, public["meta"], device, fresh=fresh)

    if public["prepared"]:  # data that exists already is checked before any write
        agreed(info, lambda: _validate(cfg, data_dir), what="checking the data")
    controller, device, bare = agreed(info, components, what="building the model")
    flops_token = flops_per_token(
        bare, cfg.data.seq_len if public["meta"].get("task") == "lm" else 1
    )
    model = parallelize(cfg, bare, info)  # a collective at world size > 1 (DDP/FSDP2)
    optimizer, routing = agreed(
        info, lambda: build_optimizer(cfg, model, info.world_size), what="building the optimizer"
    )
    # ---- every check passed on every rank: rank 0 writes (run.json, data, ...)
    agreed(info, lambda: planning.commit(plan) if plan else None, what="writing the run")
    if plan is not None:
        plan.locks.committed = True  # from here on the run's directory holds its files
    manifest = agreed(info, lambda: load_manifest(data_dir), what="reading the data")
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
    peak = (
        device_peak(device, precision.name, configured_tflops=cfg.run.peak_tflops)
        if info.is_main
        else None
    )
    if info.world_size > 1:
        precision.description += (
            f"; {info.world_size} processes ({cfg.distributed.parallel}, "
            f"{torch.distributed.get_backend()}), global batch {cfg.data.batch_size}"
        )
        if o.telemetry and o.optimizer.lower() in ("root", "muon"):
            precision.description += "; ROOT telemetry is off at world size > 1"
    monitor = agreed(info, lambda: _monitor(cfg, run_dir, info.is_main), what="opening metrics")
    for line in plan.skipped if plan else []:
        monitor.event("checkpoint_invalid", detail=line)
    run = Run(
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
        run_id=str(public["run_id"]),
        params=[p for p in model.parameters() if p.requires_grad],
        telemetry=hasattr(optimizer, "telemetry_enabled") and o.telemetry and info.world_size == 1,
        controller=controller,
        flops_per_token=flops_token,
        peak=peak,
    )
    try:
        state = plan.choice.state if plan is not None and plan.choice is not None else None
        agreed(info, lambda: resume(run, public["choice"], state, say), what="resuming")
        if not public["prepared"]:  # prepared just now (by commit)
            agreed(info, lambda: check_data(run), what="checking the data")
        if info.is_main:
            _write_run_files(run)
    except BaseException:
        with contextlib.suppress(Exception):
            monitor.close()
        raise
    return run


def _validate(cfg: Config, data_dir: Path) -> int:
    """Every shard of every split: present, readable, its sample count and (with
    ``data.verify_checksums``) its sha256; before step 1, so a damaged validation split
    stops the run before any work (:func:`rootopt.train.data.check_data`)."""
    from rootopt.data import validate_data

    return validate_data(data_dir, checksum=cfg.data.verify_checksums)


def _write_run_files(run: Run) -> None:
    """The resolved config, the environment, the routing table and the tokenizer's files
    (rank 0), each a new file renamed into place (never written through a link planted at
    its name)."""
    atomic_write(run.run_dir / "config.yaml", dump_yaml(run.cfg).encode())
    env = environment()
    if run.peak is not None:  # what the mfu metric divides by (rootopt.train.mfu)
        env["peak"] = run.peak.record()
        env["flops_per_token"] = run.flops_per_token
    atomic_write(run.run_dir / "env.json", (json.dumps(env, indent=1) + "\n").encode())
    if run.routing:
        atomic_write(run.run_dir / "routing.txt", (run.routing + "\n").encode())
    if run.manifest.get("task") == "lm":  # the tokenizer travels with the run (rootopt export)
        from rootopt.data.tokenizer import hf_files
        from rootopt.train.export import write_tokenizer_copy

        write_tokenizer_copy(run.run_dir, hf_files(run.data_dir, run.manifest))


# --------------------------------------------------------------------------- the loop


def train(
    cfg: Config,
    run_dir: Path | None = None,
    data_path: str | None = None,
    *,
    hooks: Hooks | None = None,
    say: Callable[[str], None] = print,
    config_path: str | None = None,
) -> Summary:
    """Train ``cfg`` in ``run_dir`` (None: the default ``runs/<name>-<key>``), resuming it
    when it holds checkpoints of this run; return the session's summary."""
    global TRAINING
    TRAINING = False
    hooks = hooks or Hooks()
    with interruptible():
        try:
            run, locks = setup(cfg, run_dir, data_path, say=say, config_path=config_path)
        except planning.AlreadyComplete as exc:
            return _complete(cfg, exc.done)
    try:
        summary = _train(run, hooks, say)
    except BaseException as exc:
        # The failure is what the user must see: closing files on a full disk fails too,
        # and must not replace it.
        if run.info.is_main and not isinstance(exc, Diverged):
            with contextlib.suppress(Exception):
                interrupted = isinstance(exc, KeyboardInterrupt)
                _write_summary(
                    run, "interrupted" if interrupted else "failed", -1, detail=_line(exc)
                )
        with contextlib.suppress(Exception):
            run.monitor.close()
        locks.release()
        raise
    try:
        run.monitor.close()
    finally:
        locks.release()
    return summary


def _complete(cfg: Config, done: planning.Complete) -> Summary:
    """The summary of a run found complete in a directory this process cannot write."""
    nan = float("nan")
    return Summary(
        status="completed",
        steps=done.step,
        session_steps=0,
        wall_s=0.0,
        steps_per_s=0.0,
        tokens_per_s=0.0,
        initial_loss=nan,
        final_loss=nan,
        val_loss=nan,
        nonfinite_steps=0,
        checkpoint=done.checkpoint,
        run_dir=done.run_dir,
        resumed_from=done.checkpoint,
        max_steps=cfg.run.max_steps,
        detail=f"nothing was written: {done.why}",
    )


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split("\n")).strip()[:500] or type(exc).__name__


def _train(run: Run, hooks: Hooks, say: Callable[[str], None]) -> Summary:
    cfg = run.cfg
    if run.info.is_main:
        if run.routing:
            say(run.routing)
        say(f"{run.precision.description}; data: {run.data_dir} ({run.manifest['corpus']})")
    if run.resumed_from:
        run.monitor.event("resume", step=run.state.step, path=run.resumed_from)
    run.monitor.supersede_after(run.state.step)
    _flush_open_window(run)
    if run.info.is_main:
        _write_summary(run, "running", 0)
    _redo_evaluation(run)
    run.monitor.event("start", step=run.state.step, precision=run.precision.name)
    clock = Clock(run.state)
    stop = StopFlag(cfg.checkpoint.on_signal)
    bar = _progress_bar(run)
    run.model.train()
    global TRAINING
    TRAINING = True
    try:
        status = _loop(run, hooks, clock, stop, bar)
        return _finish(run, status, clock, stop)
    finally:
        stop.restore()
        if bar is not None:
            bar.close()


def _redo_evaluation(run: Run) -> None:
    """A resumed run evaluates first when the session it continues stopped at an
    evaluation step without writing that step's validation record (e.g. the validation
    data failed there and an emergency checkpoint was written)."""
    st, r = run.state, run.cfg.run
    due = bool(
        run.resumed_from
        and run.monitor.enabled
        and run.cfg.monitoring.jsonl
        and r.eval_every
        and 0 < st.step < r.max_steps
        and st.step % r.eval_every == 0
        and st.step not in run.monitor.val_steps
    )
    if broadcast(run.info, due, "evaluation due"):
        val = evaluate(run)
        if val:
            run.monitor.log({"step": st.step, **val})


def _loop(run: Run, hooks: Hooks, clock: Clock, stop: StopFlag, bar: Any) -> str:
    cfg = run.cfg
    data = batches(run)
    checkpoint_due = False
    while run.state.step < cfg.run.max_steps:
        # ---- stop conditions (checked between steps, so the state is consistent)
        # max_time limits this session (a job's time slot); a rerun continues from the checkpoint.
        # At least one step per session, so that every rerun makes progress (and the
        # checkpoint the stop promises exists) even with a tiny run.max_time.
        out_of_time = bool(
            cfg.run.max_time and clock.steps and clock.since_session() >= cfg.run.max_time
        )
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
        except (
            ShardError,
            CorpusError,
            OSError,
            torch.OutOfMemoryError,
            MemoryError,
            RuntimeError,
        ) as exc:
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
    msg = (
        f"diverged at step {st.step}: {reason}; {kept}; {hint} and rerun with "
        f"--log_dir {run.run_dir} to resume from it"
    )
    _write_summary(run, "diverged", -1, detail=msg)
    raise Diverged(msg)


def _fatal(run: Run, exc: BaseException, at_start: tuple[TrainState, dict[str, Any]]) -> None:
    """Write an emergency checkpoint when the state is consistent, then raise one line."""
    st = run.state
    step_no = st.step + 1 if run.phase != "between" else st.step
    kind, detail = _describe(exc)
    if kind == "runtime":
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
            f"out of memory at step {step_no} ({detail}; batch_size={b}); reduce "
            "data.batch_size (use optimization.grad_accum_steps to keep the global batch) or set "
            f"model.activation_checkpointing=true; {note}"
        )
    elif kind == "worker":
        msg = (
            f"{detail} (at step {step_no}); each of the data.num_workers="
            f"{run.cfg.data.num_workers} workers holds decoded shards in memory: lower "
            f"data.num_workers, or look for the out-of-memory killer in the system log; {note}"
        )
    else:
        msg = f"{detail} (at step {step_no}); {note}"
    if isinstance(exc, (ShardError, CorpusError)):
        raise ShardError(msg) from None
    raise TrainingError(msg) from None


_WORKER = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.")
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")


def _first(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _from_worker(text: str) -> str:
    """The original error of a data-loader worker, without the traceback torch's message
    carries (``Caught ShardError in DataLoader worker process 1. Original Traceback ...``)."""
    m = _WORKER.match(text)
    if not m or "Original Traceback" not in text:
        return _first(text)
    last = [line for line in text.strip().splitlines() if line.strip()][-1].strip()
    last = re.sub(r"^[\w.]+: ", "", last, count=1)  # "rootopt.data.shards.ShardError: ..."
    return f"{last} (in data-loader worker {m.group(2)})"


def _describe(exc: BaseException) -> tuple[str, str]:
    text = str(exc)
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and any(s in text for s in _CPU_OOM)
    ):
        line = _first(text) or "out of memory"
        line = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", line)
        return "oom", line[:160]
    if isinstance(exc, (ShardError, CorpusError)):
        return "data_error", _from_worker(text)
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return "io_error", f"I/O error: {exc.strerror or exc}{where}"
    # rootopt.distributed's errors name rank, operation and timeout; the kind is the exception's
    # type (decided from the elapsed time there), never its text
    if isinstance(exc, CollectiveTimeoutError):
        return "timeout", _first(text)
    if isinstance(exc, (CollectiveError, torch.distributed.DistError)):
        return "collective", _first(text)
    if isinstance(exc, RuntimeError) and text.startswith("DataLoader worker"):
        return "worker", f"a data-loader worker died ({_first(text)})"
    if _WORKER.match(text):
        return "runtime", text
    return "runtime", _first(text) or type(exc).__name__


def _emergency(run: Run) -> str:
    st = run.state
    if run.last_checkpoint and _step_of(run.last_checkpoint) == st.step:
        return f"checkpoint {run.last_checkpoint} holds step {st.step}; rerun to resume"
    if st.step == 0:
        return "no step was completed, nothing to save"
    if not (healthy(st) and params_finite(run)):
        return f"a divergence streak is open, no emergency checkpoint; {last_good(run)}"
    try:
        path = save_checkpoint(run, "emergency")
    except (TrainingError, OSError, RuntimeError, MemoryError) as err:
        return f"emergency checkpoint failed ({_first(str(err)).split(';')[0]}); {last_good(run)}"
    return f"emergency checkpoint {path.name} written; rerun to resume"


def _step_of(name: str) -> int:
    """The step in a checkpoint name (``ckpt-00000040.pt``, ``dcp-00000040``)."""
    m = re.match(r"^(?:ckpt|dcp)-(\d{8})", name)
    return int(m.group(1)) if m else -1


# --------------------------------------------------------------------------- the end


def _finish(run: Run, status: str, clock: Clock, stop: StopFlag) -> Summary:
    """Final checkpoint, final evaluation, summary.

    The signal handlers stay installed: a SIGINT/SIGTERM during the final evaluation stops
    it (one process) after the final checkpoint exists, the summary says so, and the rerun
    runs the evaluation (it is due whenever the last step has no validation record)."""
    st, cfg = run.state, run.cfg
    session_steps = st.step - clock.step0
    st.elapsed = clock.elapsed0 + clock.since_session()
    val: dict[str, float] = {}
    detail = ""
    if st.step > 0 and _step_of(run.last_checkpoint) != st.step:
        if not params_finite(run):
            _diverged(run, "parameters became non-finite")
        save_checkpoint(run, status if status != "completed" else "final")
    if status == "completed" and _final_evaluation_due(run):
        interrupt = (lambda: stop.signal is not None) if run.world_size == 1 else None
        got = evaluate(run, interrupt=interrupt)
        if got is None:
            status = "interrupted"
            detail = (
                f"stopped by signal during the final evaluation, after the final checkpoint "
                f"{run.last_checkpoint}; run the same command to evaluate"
            )
        elif got:
            val = got
            run.monitor.log({"step": st.step, **val})
    if status == "interrupted" and not run.last_checkpoint:
        detail = "stopped by signal before the first step completed (nothing to save); run the same command to start"
    if run.info.is_main and cfg.monitoring.plot:
        plot_loss(run.run_dir)
    signum = stop.signal if status == "interrupted" else None
    return _write_summary(run, status, session_steps, val, clock, signum, detail=detail)


def _final_evaluation_due(run: Run) -> bool:
    """The last step has no validation record yet (rank 0 knows; every rank evaluates)."""
    mon = run.monitor
    due = not (mon.enabled and run.cfg.monitoring.jsonl and run.state.step in mon.val_steps)
    return bool(broadcast(run.info, due, "final evaluation due"))


def _write_summary(
    run: Run,
    status: str,
    session_steps: int,
    val: dict[str, float] | None = None,
    clock: Clock | None = None,
    signum: int | None = None,
    *,
    detail: str = "",
) -> Summary:
    st = run.state
    wall = clock.since_session() if clock is not None else 0.0
    rows = read_jsonl(run.run_dir / "metrics.jsonl") if run.info.is_main else []
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    vals = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), (int, float))]
    summary = Summary(
        status=status,
        steps=st.step,
        session_steps=session_steps,
        wall_s=wall,
        steps_per_s=session_steps / wall if wall and session_steps > 0 else 0.0,
        tokens_per_s=(st.tokens - clock.tokens0) / wall if clock is not None and wall else 0.0,
        initial_loss=losses[0] if losses else float("nan"),
        final_loss=losses[-1] if losses else float("nan"),
        val_loss=(val or {}).get("val_loss", vals[-1] if vals else float("nan")),
        nonfinite_steps=st.nonfinite_steps,
        checkpoint=run.last_checkpoint,
        run_dir=str(run.run_dir),
        resumed_from=run.resumed_from,
        signal=signum if signum and signum > 0 else 0,
        max_steps=run.cfg.run.max_steps,
        detail=detail,
        metrics_records=run.monitor.records if run.cfg.monitoring.jsonl else None,
    )
    if run.info.is_main:
        from rootopt._atomic import atomic_write
        from rootopt.monitor import strict

        text = json.dumps(strict(summary.__dict__), indent=1, allow_nan=False) + "\n"
        atomic_write(run.run_dir / "summary.json", text.encode())
    return summary
