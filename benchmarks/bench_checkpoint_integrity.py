"""What the integrity checks of a ``dcp-*`` checkpoint cost (docs/operations.md, "What a run
trusts"): torch's own DCP save and load against rootopt's, which hash every file at save
(rank 0, after the collective save) and check every sha256, then read ``.metadata`` with the
restricted unpickler and non-tensor values with ``weights_only=True`` at load.

One process, no process group, a model of ``--params`` float32 parameters with AdamW state
(three tensors per parameter in the checkpoint). The arms alternate within each repeat (the
file cache is warm for all of them: the checks read what was just written); prints JSON
with the medians, the spread and the ratios, and writes it to ``--json``.

    python benchmarks/bench_checkpoint_integrity.py --params 16000000 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _model(params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 1024
    rows = max(1, params // width)
    model = torch.nn.Sequential(torch.nn.Linear(width, rows, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=_positive, default=16_000_000)
    ap.add_argument("--repeats", type=_positive, default=5)
    ap.add_argument("--json", type=Path, help="write the result here (refused if it exists)")
    a = ap.parse_args(argv)
    if a.json is not None and a.json.exists():
        print(
            f"bench_checkpoint_integrity: {str(a.json)!r} exists; choose another --json",
            file=sys.stderr,
        )
        return 2
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from rootopt.distributed import checkpoint as dck

    model, opt = _model(a.params)

    def torch_save(where: Path) -> None:  # what dck.save does, less extra.pt and the checks
        msd, osd = get_state_dict(model, opt)
        dcp_save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(where), no_dist=True)

    def torch_load(where: Path) -> None:  # what dck.load does, less extra.pt and the checks
        msd, osd = get_state_dict(model, opt)
        dcp_load({"model": msd, "optim": osd}, storage_reader=FileSystemReader(where), no_dist=True)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    times: dict[str, list[float]] = {
        k: [] for k in ("torch_save", "rootopt_save", "torch_load", "rootopt_load")
    }
    nbytes = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rep in range(a.repeats + 1):  # the first repeat warms up and is not counted
            plain = root / f"plain-{rep}"
            t0 = time.perf_counter()
            torch_save(plain)
            t1 = time.perf_counter()
            path = dck.save(root / "c", rep, model, opt, extra={"step": rep})
            t2 = time.perf_counter()
            torch_load(plain)
            t3 = time.perf_counter()
            dck.load(path, model, opt)
            t4 = time.perf_counter()
            nbytes = sum(p.stat().st_size for p in path.iterdir())
            if rep:
                times["torch_save"].append(t1 - t0)
                times["rootopt_save"].append(t2 - t1)
                times["torch_load"].append(t3 - t2)
                times["rootopt_load"].append(t4 - t3)
            shutil.rmtree(plain)
            shutil.rmtree(path)
    med = {k: statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {
        "commit": _commit(),
        "torch": torch.__version__,
        "params": a.params,
        "checkpoint_bytes": nbytes,
        "repeats": a.repeats,
        "median_s": med,
        "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
        "save_ratio": med["rootopt_save"] / med["torch_save"],
        "load_ratio": med["rootopt_load"] / med["torch_load"],
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.json is not None:
        a.json.write_text(text + "\n")
    return 0


def _commit() -> str:
    try:
        got = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return ""
    return got.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
