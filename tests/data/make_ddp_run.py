"""Writes ``ddp_run_3ad6c87/``: a ``rootopt train`` run at world size 2 saved by rootopt at
commit 3ad6c87, when the training loop wrapped the model in DDP and ran DistributedROOT on
DDP's averaged gradients (``ddp_design="owner"``, ``average_grads=False``), so that
``tests/test_dist_train.py`` can check that such a run still resumes, at world size 2 and 1,
and continues as that version did.

The run: tests/_train_fixtures.TINY's model and data (the KJV corpus prepared by
``prepare_tiny``), 6 steps at a constant learning rate after 5 warm-up steps, a checkpoint
every 4. Kept: ``run.json``, ``config.yaml``, ``metrics.jsonl`` (the losses of steps 5 and
6 that a resume from step 4 must reproduce), ``checkpoints/owner.json`` and
``checkpoints/dcp-00000004/``; the step-6 checkpoint and the logs of the session are left
out. The temporary directories the run was written in are replaced by ``data`` and
``run`` in ``run.json`` and ``owner.json`` (a resume elsewhere rewrites them; only the run
id is checked).

Run from the repository root, with that version's ``src`` on ``PYTHONPATH`` and torchrun
available (the commit's tree, e.g. ``git archive 3ad6c87 | tar -x -C OLD``):
``PYTHONPATH=OLD/src python tests/data/make_ddp_run.py tests/data``. Not run by the test
suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMIT = "3ad6c87"
# TINY (tests/_train_fixtures.py) with a constant schedule, 6 steps, a checkpoint every 4
OVERRIDES = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "data.seq_len=32",
    "data.batch_size=8",
    "run.max_steps=6",
    "run.log_every=1",
    "run.eval_every=0",
    "optimization.warmup_steps=5",
    "optimization.schedule=constant",
    "monitoring.progress_bar=false",
    "monitoring.tensorboard=false",
    "monitoring.plot=false",
    "monitoring.histogram_every=0",
    "checkpoint.every=4",
    "checkpoint.keep_last=5",
]
KEEP = ["run.json", "config.yaml", "metrics.jsonl", "checkpoints/owner.json"]


def main(out: Path) -> None:
    sys.path.insert(0, str(HERE.parent))
    from _train_fixtures import prepare_tiny

    dest = out / f"ddp_run_{COMMIT}"
    if dest.exists():
        raise SystemExit(f"{dest} exists; remove it first")
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_tiny(Path(tmp) / "data")
        run = Path(tmp) / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "-m", "rootopt.train", "--data_path", str(data), "--log_dir", str(run), *OVERRIDES],
            env=env, check=True, timeout=900,
        )  # fmt: skip
        for name in KEEP:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run / name, dest / name)
        for name in ("run.json", "checkpoints/owner.json"):
            rec = json.loads((dest / name).read_text())
            rec.update(
                {k: k.removesuffix("_dir").replace("log", "run") for k in rec if k.endswith("_dir")}
            )
            (dest / name).write_text(json.dumps(rec, indent=1) + "\n")
        shutil.copytree(run / "checkpoints" / "dcp-00000004", dest / "checkpoints" / "dcp-00000004")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
