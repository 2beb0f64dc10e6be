"""The owner design with its reduce-scatter started in backward
(``DistributedROOT(sync_in_backward=True)``, tests/dist_scripts/backward.py) on gloo at
W = 2 and 3: equal to one process and to the same design with the reduce-scatter in the
step (bitwise), every bucket of a model whose parameters all get gradients started from a
gradient hook, the same bytes and collectives over backward + step as the cost model
predicts, a rank without a parameter's gradient (it starts its buckets with the step,
the others in backward), accumulation under ``no_sync()``, a backward discarded by
``zero_grad()``, a gradient grown after its bucket started refused on every rank with
nothing updated, and a rank built without the option refused at construction.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rootopt.distributed import DistributedROOT
from rootopt.distributed import plan as P
from test_dist import STATE_TOL, TOL, results, run_ok
from test_dist_owner import specs


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_in_backward_matches_one_process(tmp_path: Path, world: int) -> None:
    run_ok("backward.py", world, str(tmp_path))
    res = results(tmp_path, "backward", world)
    assert len(res) == world
    opts = P.Options(backend="gloo", bucket_bytes=2048, sync_in_backward=True)
    est = P.estimate(specs(6), world, "owner", opts)
    for rank, r in enumerate(res):
        early, late = r["early"], r["in_step"]
        for run in (early, late):
            assert run["param_diff"] < TOL and run["state_diff"] < STATE_TOL, run
        # the same sums in the same order: the same parameters, bit for bit
        assert early["params"] == late["params"]
        # every bucket started from a hook, during backward, as a reduce-scatter (an
        # all-to-all on gloo); none without the option
        assert early["buckets"] == est.buckets > 2
        assert early["in_backward"] == early["buckets"] == early["backward_collectives"]
        assert early["backward_by_op"] == {"all_to_all_single": early["buckets"]}
        assert (late["in_backward"], late["backward_collectives"]) == (0, 0)
        # bytes and collectives over backward + step: the same as in the step, and the
        # model's (the reduce-scatter moved, not added)
        for key in ("collectives", "bytes_sent", "bytes_received", "stats_sent"):
            assert early[key] == late[key], key
        assert early["collectives"] == est.exposed_collectives == 1 + 2 * est.buckets
        assert early["bytes_sent"] == pytest.approx(est.step_sent[rank])
        assert early["bytes_received"] == pytest.approx(est.step_received[rank])
        # common.Net: rank 0 has no embedding gradient, alone in the first bucket, so it
        # starts every bucket with the step, the others that one in backward
        for case in ("micro1", "micro2", "discarded", "after_late"):
            assert r[case]["param_diff"] < TOL, (case, r[case])
            assert r[case]["state_diff"] < STATE_TOL, (case, r[case])
        for case in ("micro1", "micro2"):
            assert r[case]["first_bucket"] == ["emb.weight"]
            assert r[case]["emb_grad"] is (rank != 0)
            assert r[case]["in_backward"] == (0 if rank == 0 else 1)
        # two backward passes without no_sync: refused on every rank in one line, the
        # parameters and the state untouched; the next step is the reference's first
        msg = r["late"]
        name = "a parameter on another rank" if rank == 0 else "emb.weight"
        assert msg.startswith(f"the gradient of {name} grew after its bucket's"), msg
        assert "no_sync" in msg and "nothing was updated" in msg and "\n" not in msg
        assert r["late_unchanged"] and r["late_state_unchanged"]
        assert r["mismatch"].startswith(f"rank {rank}/{world}: the owner plan (digest "), r
        assert "sync_in_backward on every rank" in r["mismatch"]
        assert r["after_mismatch"] == world


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"sync_in_backward": 1}, "Invalid sync_in_backward: 1 (must be True or False)"),
        ({"sync_in_backward": True}, "needs ddp_design='owner' and average_grads=True"),
        (
            {"sync_in_backward": True, "average_grads": True, "ddp_design": "gather"},
            "needs ddp_design='owner' and average_grads=True",
        ),
    ],
)
def test_sync_in_backward_options_refused_in_one_line(kw: dict[str, object], needle: str) -> None:
    import torch

    with pytest.raises(ValueError, match="Invalid sync_in_backward") as err:
        DistributedROOT([torch.nn.Parameter(torch.randn(4, 4))], lr=0.01, **kw)  # type: ignore[arg-type]
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sync_in_backward_is_the_plain_step_at_world_size_one() -> None:
    """No process group: no hooks, no_sync() a no-op, ROOT's own step."""
    import torch

    import rootopt

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 4))
    with torch.no_grad():
        b.copy_(a)
    opt = DistributedROOT([a], lr=0.01, average_grads=True, sync_in_backward=True)
    ref = rootopt.ROOT([b], lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        ref.zero_grad()
        with opt.no_sync():
            (a**2).sum().backward()
        (b**2).sum().backward()
        opt.step()
        ref.step()
    assert opt._hooks == [] and opt._bsync is None
    assert torch.equal(a, b)


def test_bench_backward_sync_runs_both_ways_and_refuses_nonsense() -> None:
    """benchmarks/bench_backward_sync.py, tiny, under torchrun at W = 2: both placements
    measured, every bucket started in backward with the option; a nonsense size is one
    line and status 2 before any process group starts."""
    import subprocess
    import sys

    from test_dist import ROOT_DIR, finish, torchrun

    script = str(ROOT_DIR / "benchmarks" / "bench_backward_sync.py")
    args = ["--width", "16", "--layers", "2", "--batch", "8", "--steps", "1", "--rounds", "1"]
    rc, out = finish(torchrun(script, 2, *args, "--bucket-kib", "1"))
    assert rc == 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("reduce-scatter in")]
    assert len(lines) == 2, out[-3000:]
    assert lines[0].endswith("started in backward 0")
    buckets = int(lines[1].split("buckets ")[1].split(",")[0])
    assert buckets >= 2 and lines[1].endswith(f"started in backward {buckets}")
    assert "backward / step = " in out
    bad = subprocess.run(
        [sys.executable, script, "--width", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "must be an integer >= 1, got '0'" in bad.stderr
    assert "Traceback" not in bad.stderr
