"""Preparing data at size: peak memory against corpus size, and throughput against the
``tokenizers`` library's own batch encoding (docs/training.md, "Your own data").

Corpora are built offline by cycling the Python standard library's source files and the
KJV text (the ``stdlib`` and ``kjv`` corpora) into directories of text files of 20 MB and
200 MB. A byte-level BPE (``tokenizer.json``, trained once on the first 4 MB) is the
tokenizer of both measurements.

(a) Memory: each ``rootopt data prepare`` runs in a fresh process; ``ru_maxrss`` after the
imports and at the end. Target: the 200 MB peak within 1.2× of the 20 MB peak (with the
BPE file and with byte tokens).

(b) Throughput: on the 20 MB corpus, interleaved for ``--rounds`` rounds, the whole prepare
(read, tokenize, pack, shuffle, write and checksum the shards) against
``Tokenizer.encode_batch`` over the same files' texts, already in memory (and, for
reference, ``encode_batch_fast``). Target: prepare ≥ 0.8× the library's throughput.

Usage: python benchmarks/bench_prepare.py --json docs/results/prepare.json
           --page docs/results/prepare.md [--sizes 20 200] [--rounds 3]
       python benchmarks/bench_prepare.py --render docs/results/prepare.json
           --page docs/results/prepare.md      (the page from a committed JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rootopt_analysis.provenance import others_paused

MB = 10**6
RSS_TARGET = 1.2
THROUGHPUT_TARGET = 0.8
PAGE_TITLE = "# Preparing data at size (benchmarks/bench_prepare.py)"


# --------------------------------------------------------------------------- corpora


def _documents() -> Iterator[bytes]:
    """The stdlib's source files, then the KJV text, forever."""
    from rootopt.data.corpora import documents

    while True:
        for corpus in ("stdlib", "kjv"):
            if corpus == "kjv":
                yield b"".join(piece for doc in documents("kjv") for piece in doc)
                continue
            for doc in documents(corpus):
                yield b"".join(doc)


def build_corpus(root: Path, size: int) -> Path:
    """A directory of ``size`` bytes of text files (one document each)."""
    out = root / f"corpus-{size // MB}mb"
    if out.is_dir():
        return out
    tmp = root / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    left = size
    for i, doc in enumerate(_documents()):
        blob = doc[:left]
        (tmp / f"{i // 1000:03d}" / f"{i:06d}.txt").parent.mkdir(exist_ok=True)
        (tmp / f"{i // 1000:03d}" / f"{i:06d}.txt").write_bytes(blob)
        left -= len(blob)
        if left <= 0:
            break
    tmp.rename(out)
    return out


def build_tokenizer(root: Path, vocab: int) -> Path:
    path = root / f"bpe-{vocab}.json"
    if not path.is_file():
        from rootopt.data import tokenizer as T
        from rootopt.data.corpora import piece_text, pieces

        tok = T.train_bpe((piece_text(p) for p in pieces("stdlib", max_bytes=4 * MB)), vocab)
        path.write_text(tok.to_json())
    return path


# --------------------------------------------------------------------------- children


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_prepare(corpus: str, out: str, tokenizer: str, seq_len: int) -> dict[str, Any]:
    from rootopt.data import prepare

    base = _rss_mib()
    t0 = time.perf_counter()
    m = prepare(corpus, out, seq_len=seq_len, max_bytes=0, tokenizer=tokenizer)
    seconds = time.perf_counter() - t0
    return {
        "rss_after_imports_mib": base,
        "peak_rss_mib": _rss_mib(),
        "seconds": seconds,
        "text_bytes": m["text_bytes"],
        "tokens": m["tokens"],
        "samples": sum(e["samples"] for s in m["splits"].values() for e in s),
        "shards": sum(len(s) for s in m["splits"].values()),
    }


def child_library(corpus: str, tokenizer: str) -> dict[str, Any]:
    """``encode_batch`` and ``encode_batch_fast`` over the corpus files' texts."""
    from tokenizers import Tokenizer

    from rootopt.data.corpora import check_source

    tok = Tokenizer.from_file(tokenizer)
    files = check_source(corpus) or []
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    out: dict[str, Any] = {"text_bytes": sum(len(t.encode()) for t in texts)}
    for name in ("encode_batch", "encode_batch_fast"):
        t0 = time.perf_counter()
        encs = getattr(tok, name)(texts, add_special_tokens=False)
        out[f"{name}_seconds"] = time.perf_counter() - t0
        out["tokens"] = sum(len(e.ids) for e in encs)
        del encs
    return out


def _run_child(args: list[str], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps(args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)
    if r.returncode != 0:
        raise SystemExit(f"child {args[0]} failed:\n{r.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- measuring


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = str(build_tokenizer(work, args.vocab))
    corpora = {size: str(build_corpus(work, size * MB)) for size in args.sizes}
    rss: list[dict[str, Any]] = []
    for kind, spec in (("bpe", tok), ("bytes", "bytes")):
        for size in args.sizes:
            out = work / f"out-{kind}-{size}"
            shutil.rmtree(out, ignore_errors=True)
            r = _run_child(["prepare", corpora[size], str(out), spec, args.seq_len], 7200)
            shutil.rmtree(out, ignore_errors=True)
            row = {"tokenizer": kind, "corpus_mb": size, **r}
            rss.append(row)
            print(
                f"memory  {kind:<5} {size:>4} MB: peak {r['peak_rss_mib']:7.1f} MiB "
                f"(after imports {r['rss_after_imports_mib']:6.1f}), {r['seconds']:6.1f} s",
                flush=True,
            )
    small = str(corpora[min(args.sizes)])
    rounds: list[dict[str, Any]] = []
    with others_paused():
        for i in range(args.rounds):
            out = work / "out-throughput"
            shutil.rmtree(out, ignore_errors=True)
            lib = _run_child(["library", small, tok], 3600)
            prep = _run_child(["prepare", small, str(out), tok, args.seq_len], 3600)
            shutil.rmtree(out, ignore_errors=True)
            row = {
                "round": i,
                "prepare_seconds": prep["seconds"],
                "encode_batch_seconds": lib["encode_batch_seconds"],
                "encode_batch_fast_seconds": lib["encode_batch_fast_seconds"],
                "ratio": lib["encode_batch_seconds"] / prep["seconds"],
                "ratio_fast": lib["encode_batch_fast_seconds"] / prep["seconds"],
                "text_bytes": prep["text_bytes"],
                "prepare_tokens": prep["tokens"],
                "library_tokens": lib["tokens"],
            }
            rounds.append(row)
            print(
                f"speed   round {i}: prepare {row['prepare_seconds']:6.1f} s, encode_batch "
                f"{row['encode_batch_seconds']:6.1f} s, encode_batch_fast "
                f"{row['encode_batch_fast_seconds']:6.1f} s → {row['ratio']:.2f}× "
                f"({row['ratio_fast']:.2f}× of fast)",
                flush=True,
            )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "bench_prepare",
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": _machine(),
        "settings": {
            "sizes_mb": args.sizes,
            "vocab": args.vocab,
            "seq_len": args.seq_len,
            "rounds": args.rounds,
            "samples_per_shard": 2000,
            "val_fraction": 0.05,
        },
        "memory": rss,
        "throughput": rounds,
        "summary": summarize(rss, rounds, args.sizes),
    }


def summarize(
    rss: list[dict[str, Any]], rounds: list[dict[str, Any]], sizes: list[int]
) -> dict[str, Any]:
    lo, hi = min(sizes), max(sizes)
    out: dict[str, Any] = {}
    for kind in sorted({r["tokenizer"] for r in rss}):
        peak = {r["corpus_mb"]: r["peak_rss_mib"] for r in rss if r["tokenizer"] == kind}
        ratio = peak[hi] / peak[lo]
        out[f"rss_ratio_{kind}"] = ratio
        out[f"rss_target_met_{kind}"] = ratio <= RSS_TARGET
    ratios = [r["ratio"] for r in rounds]
    fast = [r["ratio_fast"] for r in rounds]
    out["throughput_ratio_median"] = statistics.median(ratios)
    out["throughput_ratio_min"], out["throughput_ratio_max"] = min(ratios), max(ratios)
    out["throughput_ratio_fast_median"] = statistics.median(fast)
    out["throughput_target_met"] = out["throughput_ratio_median"] >= THROUGHPUT_TARGET
    return out


def _commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src", "benchmarks"],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{sha}{' (with uncommitted changes)' if dirty else ''}" if sha else "unknown"


def _machine() -> dict[str, Any]:
    import tokenizers

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tokenizers": tokenizers.__version__,
    }


# --------------------------------------------------------------------------- the page


def render(data: dict[str, Any]) -> str:
    """docs/results/prepare.md from the JSON (tests check the page matches its JSON)."""
    s, m, summary = data["settings"], data["machine"], data["summary"]
    lo, hi = min(s["sizes_mb"]), max(s["sizes_mb"])
    lines = [
        PAGE_TITLE,
        "",
        f"Generated from `docs/results/prepare.json` (commit {data['commit']}, "
        f"{data['date']}) by `python benchmarks/bench_prepare.py --render "
        "docs/results/prepare.json --page docs/results/prepare.md`. Machine: "
        f"{m['cpus']} CPUs, Python {m['python']}, tokenizers {m['tokenizers']}.",
        "",
        "Corpora: directories of text files cycled from the standard library's source and "
        f"the KJV text; tokenizer: a byte-level BPE of {s['vocab']} ids (`tokenizer.json`) "
        f"or byte tokens; `seq_len` {s['seq_len']}, {s['samples_per_shard']} samples per "
        "shard, `max_bytes` 0 (all). Each prepare runs in a fresh process.",
        "",
        "## Peak memory against corpus size",
        "",
        "| tokenizer | corpus | tokens | shards | RSS after imports | peak RSS | time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["memory"]:
        lines.append(
            f"| {r['tokenizer']} | {r['corpus_mb']} MB | {r['tokens']:,} | {r['shards']} | "
            f"{r['rss_after_imports_mib']:.0f} MiB | {r['peak_rss_mib']:.0f} MiB | "
            f"{r['seconds']:.0f} s |"
        )
    lines.append("")
    for kind in ("bpe", "bytes"):
        key = f"rss_ratio_{kind}"
        if key in summary:
            verdict = "met" if summary[f"rss_target_met_{kind}"] else "**missed**"
            lines.append(
                f"- {kind}: peak at {hi} MB / peak at {lo} MB = {summary[key]:.3f} "
                f"(target ≤ {RSS_TARGET}: {verdict})"
            )
    lines += [
        "",
        "## Throughput against the library's own batch encoding",
        "",
        f"The {lo} MB corpus; `rootopt data prepare` end to end (read, tokenize, pack, "
        "shuffle, write and checksum the shards) against `Tokenizer.encode_batch` (and "
        "`encode_batch_fast`) over the same files' texts, already in memory. Ratio = "
        "library seconds / prepare seconds (throughput of prepare relative to the "
        f"library's), {s['rounds']} interleaved rounds.",
        "",
        "| round | prepare | encode_batch | encode_batch_fast | ratio | ratio to fast |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["throughput"]:
        lines.append(
            f"| {r['round']} | {r['prepare_seconds']:.1f} s | {r['encode_batch_seconds']:.1f} s | "
            f"{r['encode_batch_fast_seconds']:.1f} s | {r['ratio']:.2f} | {r['ratio_fast']:.2f} |"
        )
    verdict = "met" if summary["throughput_target_met"] else "**missed**"
    lines += [
        "",
        f"- median ratio {summary['throughput_ratio_median']:.2f} (spread "
        f"{summary['throughput_ratio_min']:.2f}–{summary['throughput_ratio_max']:.2f}; target "
        f"≥ {THROUGHPUT_TARGET}: {verdict}); against `encode_batch_fast`, which prepare "
        f"itself calls: {summary['throughput_ratio_fast_median']:.2f}",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 200], help="corpus sizes, MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", dest="seq_len", type=int, default=128)
    ap.add_argument("--workdir", default="", help="keep corpora here (default: a temp dir)")
    ap.add_argument("--json", default="", help="write the results here (a new file)")
    ap.add_argument("--page", default="", help="write the results page here")
    ap.add_argument("--render", default="", help="only write --page from this JSON")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = json.loads(args.child)
        result = child_prepare(*rest) if kind == "prepare" else child_library(*rest)
        print(json.dumps(result))
        return 0
    if args.render:
        if not args.page:
            ap.error("--render needs --page")
        data = json.loads(Path(args.render).read_text())
        Path(args.page).write_text(render(data))
        return 0
    if args.json and os.path.lexists(args.json):
        # checked before the measurements, not after: the file is never overwritten
        ap.error(f"--json {args.json}: the file exists; name a new one")
    if min(args.sizes) < 1 or args.rounds < 1:
        ap.error("--sizes and --rounds must be positive")
    data = measure(args)
    text = json.dumps(data, indent=1) + "\n"
    print(json.dumps(data["summary"], indent=1))
    if args.json:
        with open(args.json, "x") as f:
            f.write(text)
    if args.page:
        Path(args.page).write_text(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
