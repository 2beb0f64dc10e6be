"""The loop's policies: a checkpoint of the flat state that rootopt wrote before them resumes
bit-identically."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _train_fixtures import FAST, final_params, prepare_tiny, quiet
from rootopt.checkpoint import load
from rootopt.config import load_config
from rootopt.monitor import read_jsonl
from rootopt.train import Hooks, train

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))

import make_loop_run  # noqa: E402

OLD_RUN = DATA / f"loop_run_{make_loop_run.COMMIT}"
# what a record says about the run (the rest is wall time and memory, different every run)
TIMING = {"steps_per_s", "tokens_per_s", "step_time_s", "mfu", "memory_rss_bytes"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _records(run: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in r.items() if k not in TIMING} for r in read_jsonl(run / "metrics.jsonl")
    ]


def _same(a: Any, b: Any, rtol: float = 0.0) -> bool:
    """``a`` and ``b`` hold the same structure and values: bit for bit with ``rtol=0``, floats
    and float tensors within ``rtol`` (relative, with an absolute floor of ``rtol`` times the
    tensor's largest magnitude) otherwise; everything else exactly."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if rtol == 0.0 or not a.is_floating_point():
            return torch.equal(a, b)
        floor = rtol * float(a.abs().max()) if a.numel() else 0.0
        return torch.allclose(a, b, rtol=rtol, atol=floor)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k], rtol) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y, rtol) for x, y in zip(a, b))
        )
    if isinstance(a, float) and isinstance(b, float) and rtol:
        return abs(a - b) <= rtol * max(abs(a), 1.0)
    return bool(a == b)


# How far this machine's float kernels may round differently from the machine that wrote
# OLD_RUN (different SIMD kernels for the same ops), over the 9 steps after the checkpoint.
ROUNDING = 1e-5


def _suspect(run: Path) -> dict[str, bool]:
    return {
        p.stem: bool(json.loads(p.read_text())["suspect"])
        for p in sorted((run / "checkpoints").glob("ckpt-*.json"))
    }


def test_a_checkpoint_of_the_flat_train_state_resumes_bit_identically(
    shards: Path, tmp_path: Path
) -> None:
    """tests/data/loop_run_8e46ce0 (tests/data/make_loop_run.py): its step-7 checkpoint holds
    the counters as one flat dict (a non-finite step, an open trouble episode, the recent
    losses of the spike rule, an open logging window of 3 steps). Resumed by today's code it
    continues exactly as an uninterrupted run of today's code: the same parameters and
    optimizer state bit for bit (within ROUNDING on a CPU that rounds the stored steps
    differently), the same records after step 7 (the first one averages the window the
    checkpoint carried), the same suspect flags on the checkpoints written inside the second
    episode; and today's uninterrupted run logs what that version logged."""
    # the optimizer settings of the version that wrote it (the defaults changed since:
    # CHANGELOG.md; its "auto" iterated in float32 on every CPU)
    then = ["optimization.ns_coefficients=muon", "optimization.ns_dtype=float32"]
    cfg = load_config(None, [*make_loop_run.OVERRIDES, *then])
    hooks = Hooks(after_backward=make_loop_run.nan_grads)
    whole = train(cfg, tmp_path / "whole", str(shards), say=quiet, hooks=hooks)
    run = tmp_path / "old"
    shutil.copytree(OLD_RUN, run)
    # Bit for bit where this machine computes the checkpoint's first 7 steps bit for bit
    # (the same kernels as the machine that wrote it); on other CPUs they round differently
    # in the last bits, and the continuation is compared within ROUNDING (counters, steps and
    # flags stay exact either way).
    step7 = "checkpoints/ckpt-00000007.pt"
    mine, theirs = load(tmp_path / "whole" / step7), load(OLD_RUN / step7)
    rtol = 0.0 if _same(mine["model"], theirs["model"]) else ROUNDING
    assert _same(mine["model"], theirs["model"], ROUNDING)
    said: list[str] = []
    rest = train(cfg, run, str(shards), say=said.append, hooks=hooks)
    assert "resumed from ckpt-00000007.pt at step 7" in said
    assert rest.status == whole.status == "completed"
    assert rest.resumed_from == "ckpt-00000007.pt" and rest.session_steps == 9
    assert rest.steps == whole.steps == 16
    assert rest.nonfinite_steps == whole.nonfinite_steps == 2  # one from the checkpoint
    a, b = final_params(tmp_path / "whole"), final_params(run)
    # the checkpoint's groups say ns_dtype "auto" as that version resolved it (float32 on
    # the CPU, kept on load: no "ns_auto" key); today's run names float32
    from rootopt.optim._options import group_ns_dtype

    for ga, gb in zip(a["optimizer"]["param_groups"], b["optimizer"]["param_groups"], strict=True):
        assert (gb["ns_dtype"], "ns_auto" in gb) == ("auto", False)
        assert group_ns_dtype(gb, torch.device("cpu")) == ga["ns_dtype"] == "float32"
        for g in (ga, gb):
            g.pop("ns_dtype"), g.pop("ns_auto", None)
    for key in ("model", "optimizer", "scheduler", "clipper", "scaler"):
        assert _same(a[key], b[key], rtol), (key, rtol)
    assert a["state"]["step"] == b["state"]["step"] == 16
    assert a["state"]["batches"] == b["state"]["batches"] == 16
    assert a["state"]["tokens"] == b["state"]["tokens"]
    # the step-8 record averages steps 5-8: three from the checkpoint's window, one after it
    got, want = _records(run), _records(tmp_path / "whole")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [4, 5, 8, 10, 12, 15, 16, 16]
    assert got[2]["steps"] == 4 and got[2]["finite_steps"] == 4
    assert _same(got, want, rtol), (got, want)
    # episodes: ckpt-7 inside the first (it closes at step 8), ckpt-14 inside the second
    assert (
        _suspect(run)
        == _suspect(tmp_path / "whole")
        == {
            "ckpt-00000007": True,
            "ckpt-00000014": True,
            "ckpt-00000016": False,
        }
    )
    # the version that wrote the checkpoint logged the same run (float round-off aside)
    before = _records(OLD_RUN)
    assert [r["step"] for r in before] == [r["step"] for r in want]
    for old, new in zip(before, want):
        assert old.keys() == new.keys(), (old.keys(), new.keys())
        for k, v in old.items():
            if isinstance(v, float):
                assert abs(new[k] - v) <= 1e-5 * max(abs(v), 1.0), (old["step"], k, v, new[k])
            else:
                assert new[k] == v, (old["step"], k, v, new[k])


def test_max_time_stops_a_run_that_logs_every_step(shards: Path, tmp_path: Path) -> None:
    """run.max_time counted only the steps since the last record, so with run.log_every=1
    it never stopped a run; it stops after the session's first step here, with a
    checkpoint, and the rerun continues."""
    over = [*FAST, "run.max_steps=6", "run.log_every=1", "run.max_time=1e-6"]
    for want in (1, 2):
        s = train(load_config(None, over), tmp_path / "run", str(shards), say=quiet)
        assert s.status == "max_time" and s.steps == want and s.session_steps == 1
        assert (tmp_path / "run" / "checkpoints" / f"ckpt-{want:08d}.pt").is_file()
