"""The training loop, readable top to bottom; its pieces live next to it.

``setup`` builds a :class:`~rootopt.train.run.state.Run`: rank 0 first checks everything
the run depends on and only then writes (:mod:`rootopt.train.preflight`), every rank builds
its components, and each phase's failures are agreed across ranks
(:mod:`rootopt.train.run.agree`).
``train`` then resumes, checks every shard, and runs ``train_step`` and the policies
(:mod:`rootopt.train.policies`: stop, health, log, evaluate, checkpoint, faults) until
``run.max_steps``, a signal or ``run.max_time``. A restarted run resumes from the newest
valid checkpoint and continues bit-identically (model, optimizer, scaler, schedule, clipper,
RNG, data position, the health counters, the open logging window, and an evaluation the
previous session did not finish). A known failure after step 1 writes an emergency
checkpoint when the state is consistent, then stops with one line
(:mod:`rootopt.train.run.failures`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import rootopt
from rootopt._atomic import atomic_write
from rootopt.config import Config, ConfigError, config_warnings, dump_yaml
from rootopt.data import load_manifest
from rootopt.monitor import Monitor, plot_loss
from rootopt.train import preflight
from rootopt.train.build import (
    Precision,
    ProcessInfo,
    build_optimizer,
    parallelize,
    process_info,
    resolve_device,
)
from rootopt.train.checkpoint import Checkpointer
from rootopt.train.data import batches, check_data
from rootopt.train.metrics.mfu import MFUMeter, device_peak, flops_per_token
from rootopt.train.metrics.records import account, divergence
from rootopt.train.models import build_model, with_vocab
from rootopt.train.policies import Evaluate, Log, Policies
from rootopt.train.run.agree import JobError, agreed, broadcast, gather
from rootopt.train.run.directory import (
    Locks,
    default_run_dir,
    identity_key,
    other_runs_note,
    write_tokenizer_copy,
)
from rootopt.train.run.failures import Diverged, diverged, one_line
from rootopt.train.run.signals import interruptible
from rootopt.train.run.state import Hooks, Run, TrainState
from rootopt.train.run.summary import Summary, already_complete, write_summary
from rootopt.train.schedule import GradClipper, LRMultiplier
from rootopt.train.step import evaluate, train_step
from rootopt.train.sync import grad_sync

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
) -> tuple[torch.nn.Module, str]:
    """The model of ``cfg`` (vocabulary resolved) on ``device``, and where its weights come
    from in words ('' unless a new run, ``fresh``, starts from ``model.init_from``, after
    its tokenizer and every tensor were checked). Every refusal is one ConfigError line."""
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
        source = ""
        if fresh and cfg.model.init_from:
            from rootopt.train.models.transformers_lm import init_source

            source = init_source(cfg.model, manifest)  # the tokenizer first: it reads least
        model = build_model(cfg.model, manifest, cfg.data.seq_len)
        if source:
            from rootopt.train.models.transformers_lm import load_init

            load_init(model, cfg.model)
        return model.to(device), source
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    except (MemoryError, RuntimeError) as exc:  # e.g. DefaultCPUAllocator: not enough memory
        m = cfg.model
        what = (
            f"{m.hf_config or m.init_from}'s config.json"
            if m.kind == "hf"
            else f"d_model={m.d_model}, n_layers={m.n_layers}"
        )
        raise ConfigError(
            [
                f"model: cannot allocate the model ({what}, vocab_size={m.vocab_size}): "
                f"{str(exc).splitlines()[0][:100]}"
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
    default ``runs/<name>-<key>`` (:mod:`rootopt.train.run.directory`)."""
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

    def check() -> preflight.Preflight | preflight.Complete | None:
        if not info.is_main:
            return None
        try:
            return preflight.check(cfg, chosen, data_path, say)
        except preflight.AlreadyComplete as done:  # a read-only directory, nothing to do
            return done.done

    checked = agreed(info, check, what="checks before writing")
    done = broadcast(info, checked if isinstance(checked, preflight.Complete) else None, "complete")
    if done is not None:
        raise preflight.AlreadyComplete(done)
    checks = checked if isinstance(checked, preflight.Preflight) else None
    locks = checks.locks if checks is not None else Locks()
    try:
        return _build(cfg, info, checks, say), locks
    except BaseException:
        preflight.abandon(checks)  # the data it staged, when it stopped before writing
        locks.abandon()
        raise


@dataclass
class _Parts:
    """What :func:`_components` built on every rank, before rank 0 writes."""

    controller: Any
    device: torch.device
    model: torch.nn.Module  # parallelized (DDP, FSDP2) at world size > 1
    optimizer: torch.optim.Optimizer
    routing: str
    source: str  # where the weights come from (model.init_from), or ''
    flops_per_token: float


def _build(
    cfg0: Config, info: ProcessInfo, checks: preflight.Preflight | None, say: Callable[[str], None]
) -> Run:
    """Every rank builds its components; once each check passed on every rank, rank 0
    writes the run; then the rest of the run is assembled and resumed."""
    public: dict[str, Any] = broadcast(info, checks.public() if checks else None, "run checks")
    if info.is_main and checks is not None:
        for line in checks.start.report(checks.ckpt_dir):
            say(line)
    cfg = agreed(info, lambda: _resolved(cfg0, public["meta"]), what="building the model")
    if public["prepared"]:  # data that exists already is checked before any write
        data_dir = Path(public["data_dir"])
        agreed(info, lambda: _validate(cfg, data_dir), what="checking the data")
    parts = _components(cfg, info, public)
    # ---- every check passed on every rank: rank 0 writes (run.json, data, ...)
    agreed(info, lambda: preflight.commit(checks) if checks else None, what="writing the run")
    if checks is not None:
        checks.locks.committed = True  # from here on the run's directory holds its files
    run = _assemble(cfg, info, public, parts, checks.start.lines if checks else [])
    try:
        state = checks.choice.state if checks is not None and checks.choice is not None else None
        resume = run.checkpointer.load
        agreed(info, lambda: resume(run, public["choice"], state, say), what="resuming")
        if not public["prepared"]:  # prepared just now (by commit)
            agreed(info, lambda: check_data(run), what="checking the data")
        if info.is_main:
            _write_run_files(run)
    except BaseException:
        with contextlib.suppress(Exception):
            run.monitor.close()
        raise
    return run


def _components(cfg: Config, info: ProcessInfo, public: dict[str, Any]) -> _Parts:
    """The controller, device, model (parallelized) and optimizer, each phase agreed
    across ranks; nothing is written."""

    def model() -> tuple[Any, torch.device, tuple[torch.nn.Module, str]]:
        controller = _controller(cfg, info)  # loaded (or refused) before anything is created
        device = resolve_device(cfg, info)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)  # the same initial parameters on every rank
        fresh = public["choice"] is None
        return controller, device, _model(cfg, public["meta"], device, fresh=fresh)

    controller, device, (bare, source) = agreed(info, model, what="building the model")
    flops_token = flops_per_token(
        bare, cfg.data.seq_len if public["meta"].get("task") == "lm" else 1
    )
    parallel = parallelize(cfg, bare, info)  # a collective at world size > 1 (DDP/FSDP2)
    optimizer, routing = agreed(
        info, lambda: build_optimizer(cfg, parallel, info.world_size), what="building the optimizer"
    )
    return _Parts(controller, device, parallel, optimizer, routing, source, flops_token)


def _controller(cfg: Config, info: ProcessInfo) -> Any:
    """The learned lr controller (``optimization.controller``), or None."""
    o = cfg.optimization
    if not o.controller:
        return None
    if info.world_size > 1:  # it reads ROOT telemetry, which the sharded step does not gather
        raise ConfigError(
            ["optimization.controller runs in one process only; unset it or launch one process"]
        )
    from rootopt.rl.controller import load_controller

    return load_controller(o.controller, total_steps=cfg.run.max_steps, optimizer=o.optimizer)


def _assemble(
    cfg: Config, info: ProcessInfo, public: dict[str, Any], parts: _Parts, skipped: list[str]
) -> Run:
    """The run around the components: data, schedule, clipping, precision, gradient
    synchronisation, metrics and the checkpointer (after rank 0 wrote the run;
    ``skipped``: its lines about checkpoints the resume passes over)."""
    data_dir, run_dir = Path(public["data_dir"]), Path(public["run_dir"])
    manifest, token_bytes = agreed(
        info, lambda: _read_data(data_dir, parts.device), what="reading the data"
    )
    o, c = cfg.optimization, cfg.optimization.clip
    schedule = LRMultiplier(
        o.schedule, warmup=o.warmup_steps, total=cfg.run.max_steps, min_ratio=o.min_lr_ratio
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(parts.optimizer, schedule)
    clipper = GradClipper(
        c.mode, max_norm=c.max_norm, value=c.value, beta=c.adaptive_beta, factor=c.adaptive_factor
    )
    precision = _precision(cfg, info, parts.device)
    mfu = MFUMeter(parts.flops_per_token)
    if info.is_main:  # rank 0 measures or looks up the peak; the others record no mfu
        mfu.peak = device_peak(parts.device, precision.name, configured_tflops=cfg.run.peak_tflops)
    monitor = agreed(info, lambda: _monitor(cfg, run_dir, info.is_main), what="opening metrics")
    ckpt_dir = Path(public["ckpt_dir"])
    return Run(
        cfg=cfg,
        info=info,
        device=parts.device,
        run_dir=run_dir,
        data_dir=data_dir,
        manifest=manifest,
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=scheduler,
        clipper=clipper,
        precision=precision,
        sync=grad_sync(cfg, parts.model, parts.optimizer, info.world_size),
        monitor=monitor,
        routing=parts.routing,
        checkpointer=Checkpointer.for_run(cfg, ckpt_dir, public["run_id"], info.is_main, skipped),
        telemetry=hasattr(parts.optimizer, "telemetry_enabled")
        and o.telemetry
        and info.world_size == 1,
        controller=parts.controller,
        mfu=mfu,
        # looked up now: a caller may wrap loop.evaluate
        evaluation=Evaluate(cfg.run, evaluate, token_bytes),
        initialised_from=parts.source,
    )


def _precision(cfg: Config, info: ProcessInfo, device: torch.device) -> Precision:
    """Autocast and loss scaling, described with the processes at world size > 1."""
    precision = Precision(cfg, device)
    if info.world_size > 1:
        precision.description += (
            f"; {info.world_size} processes ({cfg.distributed.parallel}, "
            f"{torch.distributed.get_backend()}), global batch {cfg.data.batch_size}"
        )
        if cfg.optimization.telemetry and cfg.optimization.optimizer.lower() in ("root", "muon"):
            precision.description += "; ROOT telemetry is off at world size > 1"
    return precision


def _read_data(data_dir: Path, device: torch.device) -> tuple[dict[str, Any], Any]:
    """The data's manifest and the bytes its token ids stand for (:func:`_token_bytes`)."""
    manifest = load_manifest(data_dir)
    return manifest, _token_bytes(data_dir, manifest, device)


def _token_bytes(data_dir: Path, manifest: dict[str, Any], device: torch.device) -> Any:
    """The UTF-8 bytes each token id stands for, on ``device``, for ``val_bits_per_byte``
    (:func:`rootopt.data.tokenizer.byte_lengths_of`); None when the validation shards do
    not count their bytes."""
    from rootopt.data.tokenizer import byte_lengths_of

    lengths = byte_lengths_of(data_dir, manifest, "val")
    return None if lengths is None else torch.as_tensor(lengths, device=device)


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
    env.update(run.mfu.env())  # what the mfu metric divides by (rank 0)
    atomic_write(run.run_dir / "env.json", (json.dumps(env, indent=1) + "\n").encode())
    if run.routing:
        atomic_write(run.run_dir / "routing.txt", (run.routing + "\n").encode())
    if run.manifest.get("task") == "lm":  # the tokenizer travels with the run (rootopt export)
        from rootopt.data.tokenizer import run_files

        write_tokenizer_copy(run.run_dir, run_files(run.data_dir, run.manifest))


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
        except preflight.AlreadyComplete as exc:
            return already_complete(cfg, exc.done)
    try:
        summary = _train(run, hooks, say)
    except BaseException as exc:
        # The failure is what the user must see: closing files on a full disk fails too,
        # and must not replace it.
        if run.info.is_main and not isinstance(exc, Diverged):
            with contextlib.suppress(Exception):
                interrupted = isinstance(exc, KeyboardInterrupt)
                write_summary(
                    run, "interrupted" if interrupted else "failed", -1, detail=one_line(exc)
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


def _train(run: Run, hooks: Hooks, say: Callable[[str], None]) -> Summary:
    _start(run, say)
    policies = Policies.start(run, hooks)  # the clock, signal handlers, bar
    run.model.train()
    global TRAINING
    TRAINING = True
    try:
        status = _loop(run, policies)
        return _finish(run, policies, status)
    finally:
        policies.close()


def _start(run: Run, say: Callable[[str], None]) -> None:
    """Before the session's first step: what runs, the log continued where the checkpoint
    left it, and an evaluation the previous session did not finish."""
    if run.info.is_main:
        if run.routing:
            say(run.routing)
        say(f"{run.precision.description}; data: {run.data_dir} ({run.manifest['corpus']})")
    if run.checkpointer.resumed_from:
        run.monitor.event("resume", step=run.state.step, path=run.checkpointer.resumed_from)
    if run.initialised_from:
        if run.info.is_main:
            say(f"initialised from {run.initialised_from}")
        run.monitor.event(
            "init_from",
            step=run.state.step,
            path=run.cfg.model.init_from,
            detail=run.initialised_from,
        )
    run.monitor.supersede_after(run.state.step)
    Log.recover(run)
    if run.info.is_main:
        write_summary(run, "running", 0)
    run.evaluation.redo(run)
    run.monitor.event("start", step=run.state.step, precision=run.precision.name)


def _loop(run: Run, p: Policies) -> str:
    """Steps until a stop rule says why not (the status)."""
    data = batches(run)
    while not (status := p.stop.before_step(run)):
        with p.faults.guard(run):  # a known failure: emergency checkpoint, one line
            out = train_step(run, data, p.hooks, log_now=p.log.due(run.state.step + 1))
            account(run.state, out)  # the position and the health counters
            reason = divergence(run, out)
            p.log.after_step(run, out, diverging=bool(reason))
            if reason:
                diverged(run, reason)
            p.evaluate.after_step(run)
            run.checkpointer.after_step(run, p.clock)
        p.stop.after_step(run, out)
    return status


def _finish(run: Run, p: Policies, status: str) -> Summary:
    """Final checkpoint, final evaluation, summary.

    The signal handlers stay installed: a SIGINT/SIGTERM during the final evaluation stops
    it (one process) after the final checkpoint exists, the summary says so, and the rerun
    runs the evaluation (it is due whenever the last step has no validation record)."""
    session_steps = run.state.step - p.clock.step0
    run.checkpointer.final(run, status, p.clock)
    val: dict[str, float] = {}
    detail = ""
    if status == "completed":
        interrupt = (lambda: p.stop.signal is not None) if run.world_size == 1 else None
        got = p.evaluate.final(run, interrupt)
        if got is None:
            status = "interrupted"
            detail = (
                f"stopped by signal during the final evaluation, after the final checkpoint "
                f"{run.checkpointer.last}; run the same command to evaluate"
            )
        else:
            val = got
    if status == "interrupted" and not run.checkpointer.last:
        detail = "stopped by signal before the first step completed (nothing to save); run the same command to start"
    if run.info.is_main and run.cfg.monitoring.plot:
        plot_loss(run.run_dir)
    signum = p.stop.signal if status == "interrupted" else None
    return write_summary(run, status, session_steps, val, p.clock, signum, detail=detail)
