"""``rootopt plan``: what distributed ROOT costs per rank at a world size (cost model).

    rootopt plan [--model llama3-8b llama3-70b llama3-405b] [--worlds 8 16 ... 1024]
                 [--designs replicated owner fsdp] [--bucket-mib 1024]
                 [--dtype bf16|fp32] [--json NEW_FILE] [--plot NEW_FILE.png]
                 [--verdict MODEL@W]

Prints, per model, world size and design: bytes per rank per step (and against AdamW
under the same wrapper), collectives per step, Newton–Schulz TFLOP on the critical path
and its lower bound, load imbalance, peak optimizer memory per rank and the optimizer's
share of forward/backward time; then the verdict for one model and world size with the
assumptions it rests on (docs/distributed.md, "Cost model").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

PROG = "rootopt plan"
DEFAULT_WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024]


def _new_file(text: str) -> Path:
    path = Path(text)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} exists; choose a new file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(path.parent)!r} does not exist")
    return path


def _world(text: str) -> int:
    try:
        w = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"world size must be an integer, got {text!r}") from None
    if not 1 <= w <= 1 << 20:
        raise argparse.ArgumentTypeError(f"world size must be in 1 .. 1048576, got {w}")
    return w


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (never an existing file: O_EXCL) and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def format_table(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'W':>6} {'design':<10} {'GB/rank':>9} {'xAdamW':>7} {'coll':>6} {'step':>5} "
        f"{'NS TFLOP':>9} {'bound':>8} {'path':>9} {'imbal':>6} {'opt GiB':>8} {'opt ms':>9} "
        f"{'%fwd/bwd':>9} {'%ovl':>7}"
    )
    out = [head]
    for r in rows:
        out.append(
            f"{r['world']:>6} {r['design']:<10} {r['bytes_per_rank'] / 1e9:>9.2f} "
            f"{r['vs_adamw']:>7.3f} {r['collectives']:>6} {r['step_collectives']:>5} "
            f"{r['critical_tflop']:>9.2f} {r['lower_bound_tflop']:>8.2f} "
            f"{r['path_tflop']:>9.2f} {r['imbalance']:>6.2f} "
            f"{r['memory_gib']:>8.2f} {1e3 * r['optimizer_s']:>9.1f} "
            f"{100 * r['fraction']:>9.2f} {100 * r['fraction_overlapped']:>7.2f}"
        )
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    designs = list(dict.fromkeys(r["design"] for r in rows))
    panels = (
        ("vs_adamw", "bytes per rank / AdamW's", True),
        ("fraction", "optimizer / forward+backward (nothing overlapped)", True),
        ("imbalance", "Newton–Schulz critical path / mean", True),
    )
    fig, axes = plt.subplots(
        len(panels), len(models), figsize=(4.2 * len(models), 3.2 * len(panels)), squeeze=False
    )
    for j, model in enumerate(models):
        for i, (key, label, logy) in enumerate(panels):
            ax = axes[i][j]
            for d in designs:
                pts = [
                    (r["world"], r[key]) for r in rows if r["model"] == model and r["design"] == d
                ]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=d)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            if key == "fraction":
                ax.axhline(0.02, color="k", lw=0.8, ls="--")
            ax.set_title(f"{model}: {label}" if i == 0 else label, fontsize=8)
            ax.set_xlabel("world size W", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="major", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    _write_new(path, buf.getvalue())


def main(argv: list[str]) -> int:
    from rootopt_analysis import costmodel as P

    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", nargs="+", choices=list(P.LLAMA3), default=list(P.LLAMA3))
    ap.add_argument("--worlds", nargs="+", type=_world, default=DEFAULT_WORLDS)
    ap.add_argument("--designs", nargs="+", choices=list(P.DESIGNS), default=list(P.DESIGNS))
    ap.add_argument(
        "--bucket-mib", type=_positive, default=P.SCALE_OPTIONS.bucket_bytes / P.MiB,
        help="bucket / round size (default: 1024 MiB)",
    )  # fmt: skip
    ap.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16",
        help="gradients, parameters and Newton–Schulz in bfloat16 (default) or float32",
    )  # fmt: skip
    ap.add_argument("--tokens", type=int, default=P.LLAMA3_WORKLOAD.tokens, help="tokens per step")
    ap.add_argument("--seq-len", type=int, default=P.LLAMA3_WORKLOAD.seq_len)
    ap.add_argument("--mfu", type=_positive, default=P.LLAMA3_WORKLOAD.mfu)
    ap.add_argument(
        "--verdict", default="llama3-70b@1024", metavar="MODEL@W",
        help="the model and world size to judge (default llama3-70b@1024); 'none' to skip",
    )  # fmt: skip
    ap.add_argument("--json", type=_new_file, help="also write the rows as JSON (a new file)")
    ap.add_argument("--plot", type=_new_file, help="also plot them as PNG (a new file)")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.seq_len < 1 or a.mfu > 1:
        print(f"{PROG}: --tokens and --seq-len must be >= 1 and --mfu <= 1", file=sys.stderr)
        return 2
    judge: tuple[str, int] | None = None
    if a.verdict != "none":
        model, _, w = a.verdict.partition("@")
        if model not in P.LLAMA3 or not w.isdigit() or int(w) < 1:
            print(
                f"{PROG}: --verdict {a.verdict!r}: expected MODEL@W with MODEL one of "
                f"{', '.join(P.LLAMA3)} (or 'none')",
                file=sys.stderr,
            )
            return 2
        judge = (model, int(w))
    if a.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            print(f"{PROG}: --plot needs matplotlib: pip install 'rootopt[train]'", file=sys.stderr)
            return 2
    nbytes = 2 if a.dtype == "bf16" else 4
    options = replace(
        P.SCALE_OPTIONS,
        grad_bytes=nbytes,
        param_bytes=nbytes,
        ns_bytes=nbytes,
        bucket_bytes=max(1, int(a.bucket_mib * P.MiB)),
    )
    hw = P.H100
    if a.dtype == "fp32":
        # float32 Newton–Schulz runs at the TF32 tensor-core rate at best (494 TFLOP/s
        # dense, same datasheet) and only if TF32 matmuls are allowed
        hw = replace(hw, name=hw.name.replace("(bf16)", "(tf32)"), flops=494e12)
    work = P.Workload(a.tokens, a.seq_len, a.mfu, P.LLAMA3_WORKLOAD.source)
    if (a.tokens, a.seq_len, a.mfu) != (
        P.LLAMA3_WORKLOAD.tokens,
        P.LLAMA3_WORKLOAD.seq_len,
        P.LLAMA3_WORKLOAD.mfu,
    ):
        work = replace(
            work,
            source=f"{a.tokens:,} tokens per step, {a.seq_len:,}-token sequences, "
            f"{100 * a.mfu:.0f} % MFU (given)",
        )
    worlds = sorted(set(a.worlds))
    rows = P.table_rows(a.model, worlds, a.designs, options, hw, work)
    for model in a.model:
        params = P.llama3_params(model)
        n_root = sum(1 for p in params if p.algorithm == "root")
        print(
            f"{model}: {n_root} ROOT matrices, {sum(p.numel for p in params) / 1e9:.2f} B "
            f"parameters; {a.dtype} gradients/parameters/Newton–Schulz, "
            f"{options.bucket_bytes / P.MiB:.0f} MiB buckets; {hw.name}"
        )
        print("\n".join(format_table([r for r in rows if r["model"] == model])))
        print()
    print(
        "GB/rank: most bytes any rank sends or receives per step (gradient sync included); "
        "xAdamW: against AdamW under the same wrapper (DDP, or FSDP2 for fsdp); "
        "coll: collectives per step, step: of which issued by the optimizer step; "
        "NS TFLOP: Newton–Schulz on the busiest rank, bound: max(total/W, largest matrix), "
        "path: on the step's path, each round waiting for its busiest rank (the time uses it); "
        "opt GiB: optimizer state + buffers per rank; %fwd/bwd: optimizer time with nothing "
        "overlapped, %ovl: with the communication that can overlap compute overlapped "
        "(all but what precedes the first Newton–Schulz or follows the last); owner: "
        "DistributedROOT on plain tensors (no DDP wrapper), fsdp: on FSDP2 shards"
    )
    if judge is not None:
        v = P.verdict(judge[0], judge[1], a.designs, options, hw, work)
        print()
        print("\n".join(v.lines(hw, work, options)))
    if a.json is not None:
        _write_new(a.json, (json.dumps(rows, indent=1) + "\n").encode())
    if a.plot is not None:
        plot(rows, a.plot)
    return 0
