"""``rootopt bench SUITE``: ROOT against the optimizer family on real offline tasks.

Suites: ``convergence`` (lr sweep + seeds, steps to target), ``lr-robustness`` (final loss over
the lr grid; reuses the convergence runs), ``robustness`` (injected gradient corruption and lr
×3/×10), ``overhead`` (step time, optimizer memory, orthogonalization GFLOP/s), ``all``;
``study``: the defaults study (preregistered protocol in docs/benchmarks.md; writes
``study.json`` and ``study.md``; resumable like the others).
Writes ``runs/*.json`` (one per run; finished runs are reused on a rerun), ``results.json``,
``report.md`` and ``bench_*.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SUITES = ("convergence", "lr-robustness", "robustness", "overhead", "all", "study")
MANIFEST = "bench-manifest.json"
# the files of a study directory that runs append to (bench/store.py, the session log)
APPENDED = ("runs.jsonl", "timing.jsonl", "study-log.jsonl")


class UserError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    from rootopt.optim.registry import help_text
    from rootopt.tasks import TASKS

    p = argparse.ArgumentParser(
        prog="rootopt bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="optimizers:\n"
        + help_text()
        + "\n\ntasks:\n"
        + "\n".join(f"  {t.name:<8} {t.description}" for t in TASKS.values()),
    )
    p.add_argument("suite", choices=SUITES)
    p.add_argument(
        "--out", default="bench-results", help="output directory (default bench-results)"
    )
    p.add_argument("--quick", action="store_true", help="tiny pipeline smoke test (~2 min)")
    p.add_argument(
        "--import",
        dest="import_dir",
        default="",
        metavar="DIR",
        help="study only: first add the finished runs of another study directory DIR "
        "(those --out lacks) to --out",
    )
    p.add_argument(
        "--protocol",
        choices=("v2", "v3"),
        default="v2",
        help="study only: the protocol (docs/benchmarks.md; default v2, whose record is "
        "docs/study/)",
    )
    p.add_argument(
        "--earlier",
        default="docs/study",
        metavar="DIR",
        help="study v3 only: the v2 record whose selection runs v3 reuses (default docs/study)",
    )
    p.add_argument("--tasks", default="", help="comma-separated subset of tasks")
    p.add_argument("--optimizers", default="", help="comma-separated subset of optimizers")
    p.add_argument("--seeds", type=int, default=0, help="seeds at the best lr (default 3; quick 1)")
    p.add_argument("--workers", type=int, default=2, help="parallel processes, one thread each")
    p.add_argument(
        "--finished-only",
        action="store_true",
        help="run nothing; report the runs already finished in --out (a partial suite)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return p


def _pick(raw: str, known: list[str], what: str) -> list[str]:
    if not raw:
        return known
    items = [x.strip().lower() for x in raw.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad:
        raise UserError(
            f"unknown {what} {', '.join(map(repr, bad))} (choose from {', '.join(known)})"
        )
    return items


class NothingFinished(Exception):
    pass


def _check_out(out: Path) -> None:
    """Refuse ``out`` unless it is new, empty or already ours (has our manifest)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise UserError(
            f"--out {str(out)!r} is a non-empty directory not written by rootopt bench; "
            "choose a new or empty directory"
        )
    from rootopt._atomic import refuse_link

    # the files a run appends to: refused before anything is written (open_append is the
    # last guard, not the check); main() reports the LinkError in one line
    for name in APPENDED:
        refuse_link(out / name)


def _check_finished(out: Path) -> None:
    """``--finished-only`` runs nothing, so it writes nothing either where nothing finished."""
    _check_out(out)
    if not (out / MANIFEST).is_file() or not any((out / "runs").glob("*.json")):
        raise NothingFinished(out)


def _claim_out(out: Path) -> None:
    """Use ``out`` only if it is new, empty or already ours (has our manifest)."""
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MANIFEST).is_file():
        from rootopt._atomic import atomic_write

        atomic_write(out / MANIFEST, json.dumps({"tool": "rootopt bench", "format": 1}).encode())


def _meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import torch

    return {
        "command": "rootopt bench " + " ".join(argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or 'cpu'}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads per run": 1,
        "workers": args.workers,
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from rootopt.optim.registry import REGISTRY
    from rootopt.tasks import TASKS

    if args.suite == "study":
        return _study(args, argv)
    from rootopt_analysis.bench.suites import DEFAULT_TASKS

    tasks = _pick(args.tasks, list(TASKS), "task") if args.tasks else list(DEFAULT_TASKS)
    opts = _pick(args.optimizers, list(REGISTRY), "optimizer")
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1; got {args.workers}")
    if args.seeds < 0:
        raise UserError(f"--seeds must be >= 1; got {args.seeds}")
    out = Path(args.out)
    if args.finished_only:
        _check_finished(out)
    else:
        _claim_out(out)

    from rootopt._atomic import atomic_write
    from rootopt_analysis.bench import report, suites
    from rootopt_analysis.bench.overhead import overhead

    cfg = suites.BenchConfig(
        out=out,
        quick=args.quick,
        tasks=tasks,
        optimizers=opts,
        seeds=args.seeds or (1 if args.quick else 3),
        reduce_costly=not args.quick and not args.optimizers,
        finished_only=args.finished_only,
        workers=args.workers,
        progress=not args.no_progress,
        grid=suites.QUICK_GRID if args.quick else suites.FULL_GRID,
    )
    res_path = out / "results.json"
    results: dict[str, Any] = json.loads(res_path.read_text()) if res_path.is_file() else {}
    t0 = time.perf_counter()
    s = args.suite
    if s in ("convergence", "lr-robustness", "all"):
        results["convergence"] = suites.convergence(cfg)
        results["lr_robustness"] = suites.lr_robustness(results["convergence"])
    if s in ("robustness", "all"):
        results["robustness"] = suites.robustness(cfg, results.get("convergence"))
    # The overhead suite is a measurement, not a set of finished runs: --finished-only keeps
    # the one already in results.json and never starts one.
    if s in ("overhead", "all") and not args.finished_only:
        results["overhead"] = overhead(quick=args.quick, optimizers=opts, progress=cfg.progress)
    if args.finished_only:
        shown = report.finished_sections(results)
        if not shown:
            raise NothingFinished(out)
        results = {k: v for k, v in results.items() if k in shown}
    results["meta"] = {
        **_meta(args, argv),
        "wall_s (this command)": round(time.perf_counter() - t0),
    }
    atomic_write(res_path, json.dumps(results, indent=1, default=str).encode())
    plots = report.write_plots(results, out)
    md = report.markdown(results, plots)
    atomic_write(out / "report.md", md.encode())
    print(
        f"rootopt bench {s}: wrote {res_path}, {out / 'report.md'} and {len(plots)} plots "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    return 0


def _git_commit() -> dict[str, Any]:
    """The commit of the source tree being run, and whether the code that runs (the rootopt
    package and this one, both in that tree) has local changes."""
    import subprocess

    import rootopt

    here = Path(__file__).resolve().parents[1]
    runtime = Path(rootopt.__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10
        )

    try:
        head = git("rev-parse", "HEAD")
        top = git("rev-parse", "--show-toplevel")
        if head.returncode != 0 or top.returncode != 0:
            return {"commit": None, "dirty": None}
        paths = [str(here)]
        if runtime.is_relative_to(Path(top.stdout.strip()).resolve()):
            paths.append(str(runtime))  # the rootopt of the same tree (not an installed copy)
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _study(args: argparse.Namespace, argv: list[str]) -> int:
    from rootopt.checkpoint import DirLock, LockHeld

    if args.tasks or args.optimizers or args.seeds:
        raise UserError(
            "the study's tasks, optimizers and seeds are its protocol; drop those flags"
        )
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1; got {args.workers}")
    out = Path(args.out)
    src = Path(args.import_dir) if args.import_dir else None
    if src is not None and not (src / "runs.jsonl").is_file() and not (src / "runs").is_dir():
        raise UserError(f"--import {str(src)!r} is not a study directory (no runs.jsonl)")
    _claim_out(out)
    # One session that appends (runs or an import) per study directory; a render of what has
    # finished (--finished-only alone) may run beside it. The kernel drops the lock at exit.
    lock = DirLock(out)
    if not args.finished_only or src is not None:
        try:
            lock.acquire()
        except LockHeld as exc:
            raise UserError(
                f"--out {str(out)!r} is in use by another rootopt bench study ({exc.holder}); "
                "wait for it to end or choose another directory"
            ) from None
    try:
        return _study_session(args, argv, out, src)
    finally:
        lock.release()


def _study_session(args: argparse.Namespace, argv: list[str], out: Path, src: Path | None) -> int:
    """The study's work in ``out`` (the caller validated it and holds its lock if needed)."""
    from rootopt._atomic import atomic_write, open_append
    from rootopt_analysis.bench import study, study_report
    from rootopt_analysis.bench.store import read_sessions

    proto = study.Protocol.quick() if args.quick else study.Protocol.full()
    log_path = out / "study-log.jsonl"
    if src is not None:
        runs, timings = study.open_store(out).merge_from(src)
        sessions = study_report.merge_log(src / "study-log.jsonl", log_path)
        print(
            f"rootopt bench study: imported {runs} runs, {timings} timings and "
            f"{sessions} session entries"
        )
    started = time.time()
    git = _git_commit()
    meta = _meta(args, argv)
    # the output and import directories are the reader's own: logged as OUT and SRC
    meta["command"] = meta["command"].replace(str(args.out), "OUT")
    if args.import_dir:
        meta["command"] = meta["command"].replace(str(args.import_dir), "SRC")
    entry = {
        **meta,
        **git,
        "session": f"{started:.6f}-{os.getpid()}",
        "start": started,
        "end": None,
        "compute": not args.finished_only,
    }

    def log(e: dict[str, Any]) -> None:
        # The log records sessions that run jobs (provenance reads only those); rendering
        # from the finished runs (--finished-only) leaves it as it is.
        if args.finished_only:
            return
        with open_append(log_path) as f:
            f.write(json.dumps(e) + "\n")

    # Logged at the start too, so that a session killed before its end (a reboot, a kill) is
    # still on record with its commit; the end entry of the same session completes it.
    log(entry)
    commit = None
    if git.get("commit"):
        commit = f"{git['commit']}{'+dirty' if git.get('dirty') else ''}"
    if args.protocol == "v3":
        return _study_v3(args, out, commit, lambda: log({**entry, "end": time.time()}))
    w, store = study.run_study(
        proto,
        out,
        workers=args.workers,
        compute=not args.finished_only,
        progress=not args.no_progress,
        commit=commit,
    )
    log({**entry, "end": time.time()})
    meta = study_report.provenance(read_sessions(log_path), store)
    summary = study.summarize(w, store, meta)
    atomic_write(out / "study.json", study_report.dump_summary(summary).encode())
    atomic_write(out / "study.md", study_report.markdown(summary).encode())
    plots = study_report.write_plots(summary, out)
    state = "complete" if w.complete else f"{len(w.jobs)} jobs ready to run, more may follow"
    print(
        f"rootopt bench study: {state}; wrote {out / 'study.json'}, {out / 'study.md'}"
        + (f" and {len(plots)} plots" if plots else "")
    )
    return 0


def _study_v3(
    args: argparse.Namespace, out: Path, commit: str | None, log_end: Callable[[], None]
) -> int:
    from rootopt._atomic import atomic_write
    from rootopt_analysis.bench import study_report, study_v3
    from rootopt_analysis.bench.store import read_sessions

    earlier = Path(args.earlier)
    if not (earlier / "runs.jsonl").is_file():
        raise UserError(f"--earlier {str(earlier)!r} holds no study record (no runs.jsonl)")
    w, store = study_v3.run_study(
        out,
        [earlier],
        workers=args.workers,
        compute=not args.finished_only,
        progress=not args.no_progress,
        commit=commit,
    )
    log_end()
    meta = study_report.provenance(read_sessions(out / "study-log.jsonl"), store)
    summary = study_v3.summarize(w, store, meta)
    atomic_write(out / "study.json", study_report.dump_summary(summary).encode())
    atomic_write(out / "study.md", study_v3.markdown(summary).encode())
    state = "complete" if w.complete else f"{len(w.jobs)} jobs ready to run, more may follow"
    print(f"rootopt bench study: {state}; wrote {out / 'study.json'}, {out / 'study.md'}")
    return 0


def main(argv: list[str]) -> int:
    from rootopt._atomic import LinkError

    try:
        return run(argv)
    except (UserError, LinkError) as exc:
        print(f"rootopt bench: {exc}", file=sys.stderr)
        return 2
    except NothingFinished as exc:
        print(
            f"rootopt bench: no finished runs in {str(exc.args[0])!r} to report; nothing was "
            "written (run without --finished-only to compute them)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(
            "rootopt bench: interrupted; finished runs are kept, rerun to resume", file=sys.stderr
        )
        return 130
