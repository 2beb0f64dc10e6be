"""``rootopt train`` / ``python -m rootopt.train``: argv → config → :func:`rootopt.train.train`.

    rootopt train [--config FILE] [--data_path DIR] [--log_dir DIR] [section.key=value ...]

Without ``--config`` the embedded default runs: a small Llama-style model on CPython's
standard-library source (byte tokens) with ROOT, a few minutes on a laptop CPU. Without
``--log_dir`` the run lives in ``runs/<name>-<key>``, the same directory for the same
command, so running the same command again resumes it (docs/training.md).

One line per failure: every failure is printed once, by the process that speaks for the
job — rank 0 once the ranks can talk, the first process of each machine before that, and a
rank alone when only it knows the cause (docs/distributed.md, "Failures and timeouts").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, NoReturn

from rootopt.config import ConfigError, load_config


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are printed by the speaking process only."""

    def error(self, message: str) -> NoReturn:
        if _speaks_alone():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rootopt train",
        description="Train a model with ROOT. With no --config, runs the embedded default "
        "(small Llama-style LM on real offline text). Overrides: section.key=value, "
        "e.g. optimization.base_lr=1e-3 run.max_steps=200.",
    )
    p.add_argument(
        "--config",
        help="YAML config (sections: run, distributed, model, data, optimization, "
        "mixed_precision, checkpoint, monitoring)",
    )
    p.add_argument(
        "--data_path",
        "--data-path",
        dest="data_path",
        help="prepared shard directory (rootopt data prepare); default: prepare data.corpus into the run dir",
    )
    p.add_argument(
        "--log_dir",
        "--log-dir",
        dest="log_dir",
        help="run directory (metrics, checkpoints, plots); an existing one is resumed. Default: "
        "runs/<name>-<8 hex digits of the config and --data_path>, the same for the same command",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p


def _world() -> Any:
    """:class:`rootopt.distributed.WorldInfo` of the running process group (rank 0 of 1 without)."""
    from rootopt.distributed import world

    return world()


def _speaks_alone() -> bool:
    """Before the ranks can talk: the first process of each machine speaks (under
    torchrun every rank of a machine gets the same arguments and files, so the others
    would only repeat it). A ``LOCAL_RANK`` that is not a number speaks too: it is the
    error to report."""
    raw = os.environ.get("LOCAL_RANK", "0").strip()
    try:
        return raw == "" or int(raw) == 0
    except ValueError:
        return True


# Set by torchrun and other launchers; a value that is not an integer is refused.
_LAUNCHER_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _environment_problems(cfg: Any) -> list[str]:
    """What in the environment this run cannot use, checked before anything starts."""
    problems = []
    for name in _LAUNCHER_INTS:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            int(raw)
        except ValueError:
            problems.append(
                f"environment: {name}={raw[:40]!r} is not an integer (it is set by the "
                "launcher, e.g. torchrun; unset it to run one process)"
            )
    return problems


def _environment_notes(cfg: Any) -> list[str]:
    """What the run accepts on purpose but says (docs/training.md, "Configuration"): a
    backend that cannot work here is unused by one process (a launch of several is refused
    when it starts its process group)."""
    import torch

    d = cfg.distributed
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world:
        alone = world.isdigit() and int(world) <= 1
    else:  # no launcher: one process unless another init_method starts a group
        alone = d.init_method == "env://" or d.world_size <= 1
    if d.backend == "nccl" and alone and not torch.cuda.is_available():
        return [
            "note: distributed.backend=nccl is unused by one process; it needs CUDA, which "
            "this machine lacks, so a launch of several processes here would be refused"
        ]
    return []


def _err(msg: str, *, for_the_job: bool = False) -> None:
    """One line on stderr; a rank that speaks only for itself names itself."""
    info = _world()
    mine = info.world_size > 1 and not for_the_job and not msg.startswith("rank ")
    where = f" (rank {info.rank})" if mine else ""
    print(f"rootopt train{where}: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 runtime failure (incl. divergence), 2 user error, 130 SIGINT,
    143 SIGTERM (each after a checkpoint where one could be written)."""
    from rootopt.train.run.agree import Interrupted

    def terminate(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    try:  # SIGTERM before the run's own handling: one line too (SIGINT raises anyway)
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread
        previous = None
    try:
        return _main(argv)
    except (KeyboardInterrupt, Interrupted) as exc:
        return _interrupted(exc)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupted(exc: BaseException) -> int:
    """A signal outside the loop's own handling: while starting (nothing of the run is
    lost: every write of the set-up is atomic), or a second one (stop at once)."""
    from rootopt.train.run.agree import Interrupted

    signum = exc.signum if isinstance(exc, Interrupted) else int(signal.SIGINT)
    name = signal.Signals(signum).name
    loop = sys.modules.get("rootopt.train.loop")
    if not getattr(loop, "TRAINING", False):
        msg = (
            f"interrupted ({name}) before training started; nothing of the run was lost; "
            "run the same command to start (or resume)"
        )
    else:
        msg = (
            f"interrupted ({name}); stopped at once: the newest complete checkpoint is kept, "
            "run the same command to resume from it"
        )
    info = _world()
    speak = info.is_main if info.world_size > 1 else _speaks_alone()
    if speak:
        _err(msg, for_the_job=True)
    return _leave(130 if signum == int(signal.SIGINT) else 128 + signum)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    empty = _empty_paths(args)
    if empty:
        return _fail(2, empty, speak=_speaks_alone())
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return _fail(2, [f"config error: {line}" for line in exc.problems], speak=_speaks_alone())
    problems = _environment_problems(cfg)
    if problems:
        return _fail(2, problems, speak=_speaks_alone())
    from rootopt.config import dump_yaml

    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from pathlib import Path

    from rootopt.train.loop import train
    from rootopt.train.run.agree import exit_status

    if _speaks_alone():
        for note in _environment_notes(cfg):
            print(note)
    try:
        log_dir = Path(args.log_dir) if args.log_dir else None
        summary = train(cfg, log_dir, args.data_path, config_path=args.config)
    except Exception as exc:
        known = exit_status(exc)
        if known is None:
            raise  # a bug: keep the traceback
        from rootopt.train.run.agree import JobError

        code, lines = known
        speak = _speaks_for(exc, lines[0] if lines else "")
        return _fail(code, lines, speak=speak, for_the_job=isinstance(exc, JobError))
    info = _world()
    if info.is_main:  # rank 0 reports for the run
        _report(summary)
    if info.backend is not None:  # a process group is running (any world size)
        from rootopt.distributed import finish

        finish(_status(summary))  # every file of the run is closed; see dist.finish
    return _status(summary)


def _empty_paths(args: argparse.Namespace) -> list[str]:
    """One line for an empty ``--log_dir`` or ``--data_path`` (none when both are unset or
    name something)."""
    if args.log_dir is not None and not args.log_dir.strip():
        return [
            "--log_dir: empty path; omit it for the default runs/<name>-<key>, or name a directory"
        ]
    if args.data_path is not None and not args.data_path.strip():
        return [
            "--data_path: empty path; omit it to prepare data.corpus into the run "
            "directory, or name a prepared shard directory"
        ]
    return []


def _speaks_for(exc: BaseException, line: str) -> bool:
    """Whether this process prints ``exc``: a verdict of the whole job says so itself;
    otherwise, at world size > 1, the first rank to report a failure speaks (a peer that
    died leaves its peers' collectives failing: they stay silent)."""
    from rootopt.train.run.agree import JobError

    if isinstance(exc, JobError):
        return exc.speak
    if _world().world_size == 1:
        return _speaks_alone()
    from rootopt.distributed import claim_failure

    return claim_failure(f"rank {_world().rank}: {line}")


def _fail(code: int, lines: list[str], *, speak: bool, for_the_job: bool = True) -> int:
    """Print ``lines`` (when this process speaks), tell torchrun and the other ranks, and
    leave with ``code``."""
    if speak:
        for line in lines:
            _err(line, for_the_job=for_the_job)
    if lines:
        from rootopt.distributed import report_to_launcher

        report_to_launcher(f"rootopt train: {lines[0]}", code)
    return _leave(code)


def _leave(code: int) -> int:
    """Exit status after a failure. With peers (world size > 1) the process group may
    have a collective in flight that cannot be shut down cleanly, so the process leaves at
    once (``rootopt.distributed.abort``'s rule); the launcher then stops or restarts the others."""
    if _world().world_size > 1:
        from rootopt.distributed import exit_now

        exit_now(code)
    return code


def _report(summary: Any) -> None:
    if summary.status == "completed" and summary.session_steps == 0:
        print(
            f"already complete: step {summary.steps} of {summary.max_steps} (checkpoint "
            f"{summary.checkpoint or 'none'}), nothing to train; run dir: {summary.run_dir}. "
            "To train longer rerun with --log_dir and a larger run.max_steps; to start again "
            "use another --log_dir or checkpoint.resume=restart"
        )
        if summary.detail:
            print(summary.detail)
        return
    total = f" ({summary.steps} in total)" if summary.steps != summary.session_steps else ""
    loss = f"loss {summary.initial_loss:.3f} → {summary.final_loss:.3f}"
    if summary.final_loss != summary.final_loss:  # NaN: no training record yet
        loss = "no loss record yet"
    print(
        f"{summary.status}: {summary.session_steps} steps in {summary.wall_s:.1f} s this session"
        f"{total} ({summary.steps_per_s:.2f} steps/s, {summary.tokens_per_s:.0f} tokens/s); "
        f"{loss}"
        + (f", val {summary.val_loss:.3f}" if summary.val_loss == summary.val_loss else "")
        + f"; non-finite steps {summary.nonfinite_steps}"
    )
    print(
        f"run dir: {summary.run_dir} (checkpoint {summary.checkpoint or 'none'}; "
        f"report: rootopt report {summary.run_dir})"
    )
    if summary.detail:
        print(summary.detail)
    elif summary.status == "interrupted":
        print("stopped by signal after a checkpoint; run the same command to resume")
    elif summary.status == "max_time":
        print("stopped at run.max_time after a checkpoint; run the same command to continue")


def _status(summary: Any) -> int:
    if summary.status == "interrupted":
        sig = summary.signal or int(signal.SIGTERM)
        return 130 if sig == int(signal.SIGINT) else 128 + sig
    return 0
