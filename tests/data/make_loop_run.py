"""Writes ``loop_run_8e46ce0/``: a one-process ``rootopt train`` run saved by rootopt at commit
8e46ce0, when the loop kept its counters (health, the open logging window) as one flat
``TrainState`` in the checkpoint, before the loop's policies owned them. ``tests/test_loop.py``
checks that its step-7 checkpoint still resumes and continues bit-identically to an
uninterrupted run of today's code.

The run: tests/_train_fixtures.TINY's model and data (the KJV corpus prepared by
``prepare_tiny``), 16 steps, a record every 4 steps (the checkpoint at step 7 holds an open
window of 3 steps), validation every 5, adaptive clipping, a loss-spike window of 4 (the
checkpoint holds the recent losses) and NaN gradients injected at steps 3 and 10 (step
numbers as ``Hooks.after_backward`` sees them, i.e. before the step: the checkpoint holds a
non-finite count and a trouble episode that closes only at step 8). Kept: ``run.json``, ``config.yaml``,
``metrics.jsonl`` (every record of that version's uninterrupted 16 steps),
``checkpoints/owner.json`` and ``checkpoints/ckpt-00000007.pt`` with its ``.json``. The
temporary directories the run was written in are replaced by ``data`` and ``run`` in
``run.json`` and ``owner.json`` (a resume elsewhere rewrites them; only the run id is
checked), and by ``data`` in the checkpoint's data record (written again with that version's
``rootopt.checkpoint.save``, as the run wrote it but for that one string).

Run from the repository root, with that version's ``src`` on ``PYTHONPATH`` (the commit's
tree, e.g. ``git archive 8e46ce0 | tar -x -C OLD``):
``PYTHONPATH=OLD/src python tests/data/make_loop_run.py tests/data``. Not run by the test
suite.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
COMMIT = "8e46ce0"
NAN_STEPS = (3, 10)
OVERRIDES = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "data.seq_len=32",
    "data.batch_size=8",
    "run.max_steps=16",
    "run.log_every=4",
    "run.eval_every=5",
    "run.eval_batches=2",
    "run.loss_spike_window=4",
    "optimization.warmup_steps=5",
    "optimization.clip.mode=adaptive",
    "monitoring.progress_bar=false",
    "monitoring.tensorboard=false",
    "monitoring.plot=false",
    "monitoring.histogram_every=0",
    "checkpoint.every=7",
    "checkpoint.keep_last=5",
]
KEEP = [
    "run.json",
    "config.yaml",
    "metrics.jsonl",
    "checkpoints/owner.json",
    "checkpoints/ckpt-00000007.pt",
    "checkpoints/ckpt-00000007.json",
]


def nan_grads(step: int, model: torch.nn.Module) -> None:
    """``Hooks.after_backward``: NaN gradients at the steps of ``NAN_STEPS``."""
    if step in NAN_STEPS:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))


def main(out: Path) -> None:
    sys.path.insert(0, str(HERE.parent))
    from _train_fixtures import prepare_tiny
    from rootopt import checkpoint
    from rootopt.config import load_config
    from rootopt.train import Hooks, train

    dest = out / f"loop_run_{COMMIT}"
    if dest.exists():
        raise SystemExit(f"{dest} exists; remove it first")
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_tiny(Path(tmp) / "data")
        run = Path(tmp) / "run"
        cfg = load_config(None, OVERRIDES)
        summary = train(cfg, run, str(data), hooks=Hooks(after_backward=nan_grads))
        assert summary.status == "completed" and summary.nonfinite_steps == len(NAN_STEPS)
        for name in KEEP:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run / name, dest / name)
        for name in ("run.json", "checkpoints/owner.json"):
            rec = json.loads((dest / name).read_text())
            rec.update(
                {k: k.removesuffix("_dir").replace("log", "run") for k in rec if k.endswith("_dir")}
            )
            if "data_path" in rec.get("identity", {}):
                rec["identity"]["data_path"] = "data"
            (dest / name).write_text(json.dumps(rec, indent=1) + "\n")
        ckpt = dest / "checkpoints" / "ckpt-00000007.pt"
        payload = torch.load(ckpt, weights_only=False)
        meta = json.loads(ckpt.with_suffix(".json").read_text())
        payload["data"]["path"] = "data"
        for key in ("format_version", "step", "run_id"):
            del payload[key]
        checkpoint.save(
            ckpt.parent,
            7,
            payload,
            run_id=meta["run_id"],
            suspect=meta["suspect"],
            serial=meta["serial"],
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
