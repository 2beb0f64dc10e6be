"""The owner design's reduce-scatter started in backward (``DistributedROOT(average_grads=True)``,
tests/dist_scripts/backward.py) on gloo at W = 2 and 3: equal to one process and to the
same design with every reduce-scatter started with the step (bitwise), every bucket of a
model whose parameters all get gradients started from a gradient hook, the same bytes and
collectives over backward + step as the cost model predicts, a rank without a parameter's
gradient (it starts its buckets with the step, the others in backward), accumulation under
``no_sync()``, a backward discarded by ``zero_grad()``, a gradient grown or scaled after its
bucket started refused on every rank with nothing updated, unscaling and clipping inside
the step equal to one process, and a rank built with another ``average_grads`` refused at
construction.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rootopt.distributed import DistributedROOT
from rootopt_analysis import costmodel as P
from test_dist import STATE_TOL, TOL, results, run_ok
from test_dist_owner import specs


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_in_backward_matches_one_process(tmp_path: Path, world: int) -> None:
    run_ok("backward.py", world, str(tmp_path))
    res = results(tmp_path, "backward", world)
    assert len(res) == world
    opts = P.Options(backend="gloo", bucket_bytes=2048)
    est = P.estimate(specs(6), world, "owner", opts)
    for rank, r in enumerate(res):
        early, late = r["early"], r["in_step"]
        for run in (early, late):
            assert run["param_diff"] < TOL and run["state_diff"] < STATE_TOL, run
        # the same sums in the same order: the same parameters, bit for bit
        assert early["params"] == late["params"]
        # every bucket started from a hook, during backward, as a reduce-scatter (an
        # all-to-all on gloo); none when backward runs inside no_sync()
        assert early["buckets"] == est.buckets > 2
        assert early["in_backward"] == early["buckets"] == early["backward_collectives"]
        assert early["backward_by_op"] == {"all_to_all_single": early["buckets"]}
        assert (late["in_backward"], late["backward_collectives"]) == (0, 0)
        # bytes and collectives over backward + step: the same as in the step, and the
        # model's (the reduce-scatter moved, not added)
        for key in ("collectives", "bytes_sent", "bytes_received", "stats_sent"):
            assert early[key] == pytest.approx(late[key], rel=1e-12), key
        assert early["collectives"] == est.exposed_collectives == 1 + 2 * est.buckets
        assert early["bytes_sent"] == pytest.approx(est.step_sent[rank])
        assert early["bytes_received"] == pytest.approx(est.step_received[rank])
        # common.Net: rank 0 has no embedding gradient, alone in the first bucket, so it
        # starts every bucket with the step, the others that one in backward
        for case in ("micro1", "micro2", "discarded", "after_late", "after_scaled", "clipped"):
            assert r[case]["param_diff"] < TOL, (case, r[case])
            assert r[case]["state_diff"] < STATE_TOL, (case, r[case])
        for case in ("micro1", "micro2"):
            assert r[case]["first_bucket"] == ["emb.weight"]
            assert r[case]["emb_grad"] is (rank != 0)
            assert r[case]["in_backward"] == (0 if rank == 0 else 1)
        # two backward passes without no_sync, or p.grad clipped by hand on the last rank:
        # refused on every rank in one line, the parameters and the state untouched; the
        # next step is the reference's first
        for case in ("late", "scaled"):
            msg = r[case]
            # rank 0 has no embedding gradient: nothing started early there, and the first
            # bucket holds the embedding (what the others see change first)
            changed = rank != 0 if case == "late" else rank == world - 1
            name = "emb.weight" if changed else "a parameter on another rank"
            assert msg.startswith(f"the gradient of {name} changed after its bucket's"), msg
            assert "no_sync" in msg and "clip_grad_norm_" in msg, msg
            assert "nothing was updated" in msg and "\n" not in msg
            assert r[f"{case}_unchanged"] and r[f"{case}_state_unchanged"]
        # unscaled (loss x 1024) and clipped inside the step: one process's norms
        clipped = r["clipped"]
        assert len(clipped["norms"]) == len(clipped["ref_norms"]) == 3
        for got, want in zip(clipped["norms"], clipped["ref_norms"]):
            assert got == pytest.approx(want, rel=1e-5) and want > 0.01  # it did clip
        assert r["mismatch"].startswith(f"rank {rank}/{world}: the owner plan (digest "), r
        assert "average_grads on every rank" in r["mismatch"]
        assert r["after_mismatch"] == world


def test_average_grads_is_the_plain_step_at_world_size_one() -> None:
    """No process group: no hooks, no_sync() a no-op, ROOT's own step."""
    import torch

    import rootopt

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(6, 4))
    with torch.no_grad():
        b.copy_(a)
    opt = DistributedROOT([a], lr=0.01, average_grads=True)
    ref = rootopt.ROOT([b], lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        ref.zero_grad()
        with opt.no_sync():
            (a**2).sum().backward()
        (b**2).sum().backward()
        opt.step()
        ref.step()
    assert opt._replicated.hooks == [] and opt._replicated.backward is None
    assert torch.equal(a, b)


def test_bench_backward_sync_runs_every_arm_and_refuses_nonsense(tmp_path: Path) -> None:
    """benchmarks/bench_backward_sync.py, tiny, under torchrun at W = 2: the three arms
    measured (every bucket started in backward in ``owner``, none in ``step``), the JSON
    written; a nonsense size is one line and status 2 before any process group starts, and
    an existing --json is refused and left as it was."""
    import json
    import subprocess
    import sys

    from test_dist import ROOT_DIR, finish, torchrun

    script = str(ROOT_DIR / "benchmarks" / "bench_backward_sync.py")
    args = ["--width", "16", "--layers", "2", "--batch", "8", "--steps", "1", "--rounds", "1"]
    out_json = tmp_path / "sync.json"
    rc, out = finish(torchrun(script, 2, *args, "--bucket-kib", "1", "--json", str(out_json)))
    assert rc == 0, out[-3000:]
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if "ms per step" in ln}
    assert sorted(lines) == ["ddp", "owner", "step"], out[-3000:]
    buckets = int(lines["owner"].split("buckets ")[1].split(",")[0])
    assert buckets >= 2 and f"started in backward {buckets}," in lines["owner"]
    assert "started in backward 0," in lines["step"]
    assert "step / owner = " in out and "ddp / owner = " in out
    rec = json.loads(out_json.read_text())
    assert rec["world"] == 2 and sorted(rec["median_ms"]) == ["ddp", "owner", "step"]
    bad = subprocess.run(
        [sys.executable, script, "--width", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "must be an integer >= 1, got '0'" in bad.stderr
    assert "Traceback" not in bad.stderr
    mine = tmp_path / "mine.json"
    mine.write_text("mine")
    bad = subprocess.run(
        [sys.executable, script, "--json", str(mine)], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "the file exists" in bad.stderr
    assert mine.read_text() == "mine"
