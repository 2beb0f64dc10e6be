"""Distributed ROOT on CPU with gloo, in real processes launched by torchrun.

Each launch runs a batch of checks (process start is slow) and writes one JSON per rank;
the assertions are here. Every launch has a timeout so that a hang fails fast.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import rootopt
from _faultkit import free_port
from rootopt.distributed import DistributedROOT, assign_owners, chunk_rows, ns_cost

ROOT_DIR = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))

import common  # noqa: E402

LAUNCH_TIMEOUT_S = 240
# float32 round-off after a few steps; a wrong update is off by ~1e-2. Parameters agree to
# ~1e-6; optimizer state (momentum, i.e. gradients at slightly different parameters) to
# ~1e-5: AdaNewton's soft count sends the small, nearly rank-deficient test matrices (2x10,
# 10x10) to the steep schedule, which amplifies the reduction-order rounding in their
# smallest singular direction (measured: 1.2e-6 / 1.4e-5 at world 3; docs/adanewton.md).
TOL = 1e-5
STATE_TOL = 1e-4


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT_DIR / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(
    script: str, nproc: int, *args: str, extra: list[str] | None = None
) -> subprocess.Popen[str]:
    port = free_port()
    launch = extra or [
        "--nnodes", "1",
        "--rdzv-backend", "c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        *launch,
        "--nproc_per_node", str(nproc),
        str(SCRIPTS / script), *args,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=ROOT_DIR, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(proc: subprocess.Popen[str], timeout: float = LAUNCH_TIMEOUT_S) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s (hang?)\n{out[-4000:]}")
    return proc.returncode, out


def run_ok(script: str, nproc: int, *args: str) -> None:
    rc, out = finish(torchrun(script, nproc, *args))
    assert rc == 0, out[-6000:]


def results(out_dir: Path, name: str, world: int) -> list[dict[str, Any]]:
    files = sorted(out_dir.glob(f"{name}-rank*.json"))
    assert len(files) == world, [f.name for f in files]
    return [json.loads(f.read_text()) for f in files]


def check_resharded_checkpoint(tmp_path: Path, saved_at: int, loaded_at: int, design: str) -> None:
    """``dist_scripts/ckpt.py``: saved at ``saved_at`` ranks after 2 steps, loaded at
    ``loaded_at`` and trained 2 more; parameters and optimizer state equal the uninterrupted
    single-process run at the save, after the load and after the steps."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    run_ok("ckpt.py", saved_at, str(out), str(ck), design, "2")
    run_ok("ckpt.py", loaded_at, str(out), str(ck), design, "2")
    first = results(out, "ckpt-dcp-00000002", saved_at)
    second = results(out, "ckpt-dcp-00000004", loaded_at)
    for r in first:
        assert r["after_train"]["param_diff"] < TOL
        assert r["after_train"]["state_diff"] < STATE_TOL
    assert [r["loaded_step"] for r in second] == [2] * loaded_at
    for r in second:
        assert r["extra_ok"] == 1.0
        for phase in ("after_load", "after_train"):
            assert r[phase]["param_diff"] < TOL, (phase, r[phase])
            assert r[phase]["state_diff"] < STATE_TOL, (phase, r[phase])
            assert r[phase]["steps_equal"] == 1.0


# ---------------------------------------------------------------------------------------
# in-process: owners, world size 1
# ---------------------------------------------------------------------------------------
def test_owners_balance_cost_not_count() -> None:
    # one big matrix and many small ones: by count rank 0 would get the big one plus
    # half of the small ones; by cost the big one is alone on its rank
    costs = [ns_cost(1, 512, 512, 5)] + [ns_cost(1, 64, 64, 5)] * 8
    owners = assign_owners(costs, 2)
    assert owners[0] not in owners[1:]
    loads = [0.0, 0.0]
    assert assign_owners(costs, 2, loads) == owners
    assert sum(loads) == pytest.approx(sum(costs))
    # LPT bound: the busiest rank carries at most the mean plus the largest task
    big = [float(c) for c in range(1, 40)]
    loads3 = [0.0] * 3
    assign_owners(big, 3, loads3)
    assert max(loads3) <= sum(big) / 3 + max(big)
    assert ns_cost(1, 10, 33, 5) == ns_cost(1, 33, 10, 5) == 5 * 100 * 76


def test_sharded_updates_travel_in_the_dtype_they_are_exact_in() -> None:
    """update_dtype: the FSDP2 return all-to-all sends a round's updates in bfloat16 /
    float16 only when every one is a Newton–Schulz iterate in that dtype with no fused
    block scale folded in; float32 for anything else, or a mix."""
    from types import SimpleNamespace

    from rootopt.distributed.sharded import update_dtype as _update_dtype
    from rootopt.optim._options import ns_dtype_name

    cpu = torch.device("cpu")

    def task(ns_dtype: str, method: str = "newton_schulz", split: Any = None) -> Any:
        group = {"ns_dtype": ns_dtype, "ortho_method": method, "ns_split": [split]}
        return SimpleNamespace(group={**group, "ns_auto": "native"}, pi=0)

    assert _update_dtype([task("bfloat16"), task("bfloat16")], cpu) == torch.bfloat16
    assert _update_dtype([task("float16")], cpu) == torch.float16
    assert _update_dtype([task("float32")], cpu) == torch.float32
    # "auto": what it resolves to here (bfloat16 on a CPU with bf16 units)
    want = torch.bfloat16 if ns_dtype_name("auto", cpu) == "bfloat16" else torch.float32
    assert _update_dtype([task("auto")], cpu) == want
    # a group saved before "auto" changed (no ns_auto) keeps its rule: float32 on the CPU
    legacy = task("auto")
    del legacy.group["ns_auto"]
    assert _update_dtype([legacy], cpu) == torch.float32
    assert _update_dtype([task("auto")], torch.device("cuda")) == torch.bfloat16
    assert _update_dtype([task("bfloat16"), task("float16")], cpu) == torch.float32
    assert _update_dtype([task("bfloat16"), task("float32")], cpu) == torch.float32
    assert _update_dtype([task("bfloat16", "svd")], cpu) == torch.float32
    assert _update_dtype([task("bfloat16", split=[4, 4])], cpu) == torch.float32
    assert _update_dtype([], cpu) == torch.float32


def test_chunk_rows_matches_torch_chunk() -> None:
    for rows in (0, 1, 2, 5, 10, 18, 33):
        for world in (1, 2, 3, 4, 8):
            got = chunk_rows(rows, world)
            ref = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
            ref += [0] * (world - len(ref))
            assert got == ref, (rows, world)
            assert sum(got) == rows


def _three_steps(*pairs: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    """Three steps of each (model, optimizer) pair on the same global batches."""
    for step in range(3):
        ids, x, y = common.global_batch(step)
        for m, o in pairs:
            o.zero_grad()
            torch.nn.functional.mse_loss(m(ids, x), y).backward()
            o.step()


def test_world_one_is_the_plain_step() -> None:
    """No process group: DistributedROOT's step is rootopt.ROOT's, bit for bit."""
    a, b = common.make_model(), common.make_model()
    opt_a = rootopt.ROOT(common.groups(a), **common.HYPER)
    opt_b = DistributedROOT(common.groups(b), **common.HYPER)
    _three_steps((a, opt_a), (b, opt_b))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sorted(pa) == sorted(pb)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    assert opt_b.stats.ns_matrices == 6  # w4, w1, 2 x w3, w2, w5 (unused: no gradient)


def test_state_is_created_eagerly_and_lr0_is_a_noop() -> None:
    model = common.make_model()
    opt = DistributedROOT(common.groups(model), **{**common.HYPER, "lr": 0.0})
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len(list(model.parameters()))
    assert all(opt.state[p] for p in params)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"bucket_bytes": 1.5}, "bucket_bytes"),
        ({"average_grads": "yes"}, "average_grads"),
        # removed options: one line saying what replaced them
        ({"ddp_design": "gather"}, "ddp_design=...\\) was removed: the owner design is the one"),
        ({"overlap": False}, "overlap=...\\) was removed: buckets are updated one after"),
        ({"sync_in_backward": True}, "sync_in_backward=...\\) was removed: with average_grads"),
        ({"fsdp_design": "gram"}, "fsdp_design=...\\) was removed: sharded matrices are"),
        ({"gpus_per_node": 8}, "gpus_per_node=...\\) was removed"),
        # the communication bucket has its own name; ROOT's bucket_bytes is a group option
        ({"comm_bucket_bytes": 0}, "Invalid comm_bucket_bytes: 0"),
        ({"comm_bucket_bytes": 1.5}, "Invalid comm_bucket_bytes: 1.5"),
        ({"bucket_bytes": 1 << 20}, "bucket_bytes=...\\) is now comm_bucket_bytes=..."),
    ],
)
def test_bad_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as exc:
        DistributedROOT(common.make_model().parameters(), **kwargs)
    assert "\n" not in str(exc.value)


def test_comm_bucket_bytes_and_roots_bucket_bytes_are_two_options() -> None:
    """comm_bucket_bytes cuts the communication buckets; ROOT's bucket_bytes (the stacking
    budget) reaches the step as a parameter group option, validated as ROOT validates it."""
    model = common.make_model()
    groups = common.groups(model)
    groups[0]["bucket_bytes"] = 4096
    opt = DistributedROOT(groups, **common.HYPER, comm_bucket_bytes=1 << 16)
    assert opt.comm_bucket_bytes == 1 << 16
    assert opt.param_groups[0]["bucket_bytes"] == 4096
    assert opt.param_groups[1]["bucket_bytes"] == "auto"  # ROOT's default
    bad = common.groups(common.make_model())
    bad[0]["bucket_bytes"] = -1
    with pytest.raises(ValueError, match="bucket_bytes"):
        DistributedROOT(bad, **common.HYPER)


def test_compile_step_is_refused_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """At world size > 1 the step runs collectives between the owners' updates: compile_step
    is refused with one line before anything is built (it was silently ignored)."""
    import rootopt.distributed.root as droot
    from rootopt.distributed import WorldInfo

    monkeypatch.setattr(droot, "world", lambda group=None: WorldInfo(0, 2, 0, 2, "gloo"))
    for mode in (True, "reduce-overhead"):
        with pytest.raises(ValueError) as exc:
            DistributedROOT(common.groups(common.make_model()), compile_step=mode)
        assert str(exc.value) == (
            "compile_step is not supported by DistributedROOT at world size 2: its step runs "
            "collectives between the owners' updates; leave it off (it is ROOT's own step, "
            "compiled, in one process with plain tensors)"
        )


def test_compile_step_is_refused_for_sharded_parameters(tmp_path: Path) -> None:
    """DTensor parameters (FSDP2) take the sharded step even in one process: refused."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="^compile_step is not supported by "
                           "DistributedROOT for sharded \\(FSDP2\\) parameters"):  # fmt: skip
            DistributedROOT([w], compile_step=True)
        DistributedROOT([w])  # without it: fine
    finally:
        dist.destroy_process_group()


def test_compile_step_is_roots_compiled_step_in_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No process group, plain tensors: DistributedROOT(compile_step=...) compiles ROOT's
    step from the second step on, with the mode given, and updates as ROOT does."""
    compiled: list[Any] = []

    def fake_compile(fn: Any, mode: Any = None) -> Any:  # the traced step, run eagerly
        compiled.append(mode)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    a, b = common.make_model(), common.make_model()
    opt_a = rootopt.ROOT(common.groups(a), **common.HYPER)
    opt_b = DistributedROOT(common.groups(b), **common.HYPER, compile_step="reduce-overhead")
    _three_steps((a, opt_a), (b, opt_b))
    assert compiled == ["reduce-overhead"]
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


def test_agreed_loss_scale_follows_torchs_gradscaler() -> None:
    """rootopt train's fp16 dynamic loss scale when DistributedROOT unscales and checks the
    gradients itself (Precision.inv_scale / step(agreed=True) / skip(agreed=True)): the
    same scales as torch's GradScaler driven by unscale_ on the same outcomes, growth
    after ``growth_interval`` clean steps and back-off on an overflow included."""
    from rootopt.config import load_config
    from rootopt.train.build import Precision

    over = ["mixed_precision.enabled=true", "mixed_precision.dtype=fp16",
            "mixed_precision.loss_scale=dynamic", "mixed_precision.growth_interval=2",
            "mixed_precision.init_scale=1024"]  # fmt: skip
    mp = load_config(None, over).mixed_precision
    ours = Precision(load_config(None, over), torch.device("cpu"))
    ref = torch.amp.GradScaler(
        "cpu", init_scale=1024, growth_factor=mp.growth_factor,
        backoff_factor=mp.backoff_factor, growth_interval=2,
    )  # fmt: skip
    p = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([p], lr=0.0)
    seen = []
    for overflow in (False, False, False, True, False, False, True, True):
        assert ours.inv_scale() == 1.0 / ref.get_scale()
        ours.backward(p.sum() * 0)  # the loop scales the loss in backward (GradScaler.scale)
        ref.scale(torch.ones(()))
        p.grad = torch.full((3,), math.inf if overflow else 1.0)
        ref.unscale_(sgd)
        ref.update()
        if overflow:
            ours.skip(agreed=True)
        else:
            ours.step(sgd, agreed=True)
        assert ours.scale == ref.get_scale()
        seen.append(ours.scale)
    assert max(seen) > 1024 and min(seen) < 1024  # it grew and it backed off


# ---------------------------------------------------------------------------------------
# torchrun launches
# ---------------------------------------------------------------------------------------
def _check_parity(res: list[dict[str, Any]], world: int) -> None:
    assert [r["world"] for r in res] == [world] * world
    for r in res:
        # the reference moved the parameters far more than the tolerance: a wrong but
        # non-zero update cannot pass
        assert r["moved"] > 1e-2
        # rounds cut by what each owner receives (plan.owner_rounds), 256 B each: at W = 2
        # one rank owns w4 (LPT, the costliest), the other w1, w3, w2, w5 in round order:
        # [w5 + w2] (88 B), [w3], [w1], 3 rounds; at W = 3 the third rank's [w5 + w2], [w3]:
        # 2 rounds; at W = 4 the fourth rank holds [w5 + w2] alone: 1 round (the cut by the
        # bytes of the whole round gave 4 at every W)
        assert r["fsdp_rounds"] == {2: 3, 3: 2, 4: 1}[world]
        for key in (
            "ddp_param_diff",
            "owner_param_diff",
            "owner_buckets_param_diff",
            "fsdp_param_diff",
            "fsdp_rounds_param_diff",
        ):
            assert r[key] < TOL, (key, r[key])
        for key in (
            "ddp_state_diff",
            "fsdp_state_diff",
            "owner_state_diff",
            "owner_buckets_state_diff",
        ):
            assert r[key] < STATE_TOL, (key, r[key])
        assert r["fsdp_state_sharded"] is True
        assert r["eager_state"] is True
        assert r["lr0_change"] == 0.0
        assert r["missing_grad_ok"] is True
        assert r["fsdp_vs_ddp"] < TOL  # FSDP2 equals DDP
        # NaN on rank 0 only: all ranks agree to refuse, nothing is updated anywhere
        assert r["nan_refused"].startswith("non-finite gradient (NaN/Inf) in parameter w1")
        assert r["compile_refused"].startswith(
            f"compile_step is not supported by DistributedROOT at world size {world}:"
        )
        assert r["nan_change"] == 0.0
    # every matrix orthogonalized exactly once per step, by exactly one rank, cost-balanced
    assert sum(r["ns_matrices"] for r in res) == 6
    assert sum(r["fsdp_ns_matrices"] for r in res) == 6
    costs = [r["ns_cost"] for r in res]
    biggest = ns_cost(1, 33, 16, 5)
    assert max(costs) <= sum(costs) / world + biggest
    if world > 1:
        assert all(r["ns_matrices"] < 6 for r in res)
    # the (10 x 33) matrix is split unevenly (rows % world != 0) yet its owner's threshold
    # equals the single-process one: the quantile uses the whole matrix, no padding
    assert sorted(r["w1_local_rows"] for r in res) == sorted(chunk_rows(10, world))
    owners = [r for r in res if r["owner_eps_w1"]]
    assert len(owners) == 1
    got, ref = owners[0]["owner_eps_w1"], owners[0]["ref_eps_w1"]
    assert len(got) == len(ref) == 4
    for g, e in zip(got, ref):
        assert g == pytest.approx(e, rel=1e-5)
    # the owner design: every matrix orthogonalized once, momentum and AdamW moments held
    # by exactly one rank each (every parameter with elements: 6 ROOT, 2 AdamW)
    named = sorted(n for n, _ in common.make_model().named_parameters())
    for key in ("owner", "owner_buckets"):
        assert sum(r[f"{key}_ns_matrices"] for r in res) == 6
        held = sorted(n for r in res for n in r[f"{key}_held"])
        assert held == named, (key, held)
        if world > 1:
            assert all(len(r[f"{key}_held"]) < len(named) for r in res)
    # a constant number of collectives per step: the flag all-reduce, then a reduce-scatter
    # and an all-gather per bucket (one bucket; more with tiny buckets). The bucket holding
    # `unused`, which never gets a gradient, starts with the step, and so do all after it;
    # with tiny buckets the ones before it start in backward
    for r in res:
        assert r["owner_buckets"] == 1 and r["owner_collectives"] == 3
        assert r["owner_in_backward"] == 0
        assert r["owner_buckets_buckets"] >= 5  # 8 parameters, the small ones share
        assert r["owner_buckets_collectives"] == 1 + 2 * r["owner_buckets_buckets"]
        assert 0 < r["owner_buckets_in_backward"] < r["owner_buckets_buckets"]


def test_three_ranks_uneven_match_single_process(tmp_path: Path) -> None:
    """Under DDP, synchronising the gradients itself and FSDP2 at world 3 (10 and 33 rows,
    a 2-row and a 1-row matrix) equal single-process ROOT on the same global batch."""
    run_ok("parity.py", 3, str(tmp_path))
    _check_parity(results(tmp_path, "parity", 3), 3)


def test_two_node_launch_on_localhost(tmp_path: Path) -> None:
    """Two torchrun invocations (--nnodes 2, --node_rank 0/1) rendezvous over loopback;
    the world-2 run equals the single-process reference."""
    port = free_port()

    def launch_args(node: int) -> list[str]:
        return [
            "--nnodes", "2",
            "--node_rank", str(node),
            "--rdzv-backend", "c10d",
            "--rdzv-id", "two-node-test",
            f"--rdzv-endpoint=127.0.0.1:{port}",
        ]  # fmt: skip

    procs = [torchrun("parity.py", 1, str(tmp_path), extra=launch_args(n)) for n in (0, 1)]
    outs = [finish(p) for p in procs]
    for rc, out in outs:
        assert rc == 0, out[-6000:]
    _check_parity(results(tmp_path, "parity", 2), 2)


def test_checkpoint_reshards_across_world_sizes(tmp_path: Path) -> None:
    """Saved at 2 (DDP) → loaded at 1 (no process group) → saved → loaded at 3 (FSDP2,
    sharded state) → saved → loaded at 2 (DDP): after every load and every step the
    parameters and optimizer state equal an uninterrupted single-process run."""
    import ckpt

    from rootopt.train.checkpoint import list_checkpoints, newest_valid

    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    run_ok("ckpt.py", 2, str(out), str(ck), "ddp", "2")
    one = ckpt.run(str(out), str(ck), "none", 1)
    run_ok("ckpt.py", 3, str(out), str(ck), "fsdp", "1")
    run_ok("ckpt.py", 2, str(out), str(ck), "ddp", "1")
    first = results(out, "ckpt-dcp-00000002", 2)
    fsdp = results(out, "ckpt-dcp-00000004", 3)
    last = results(out, "ckpt-dcp-00000005", 2)
    assert [r.get("loaded_step") for r in first] == [None, None]
    assert one["loaded_step"] == 2 and one["saved"] == "dcp-00000003"
    assert [r["loaded_step"] for r in fsdp] == [3, 3, 3]
    assert [r["loaded_step"] for r in last] == [4, 4]
    for r in first:
        assert r["after_train"]["param_diff"] < TOL
    for r in [one, *fsdp, *last]:
        assert r["extra_ok"] == 1.0
        for phase in ("after_load", "after_train"):
            assert r[phase]["param_diff"] < TOL, (r["world"], phase, r[phase])
            assert r[phase]["state_diff"] < STATE_TOL, (r["world"], phase, r[phase])
            assert r[phase]["steps_equal"] == 1.0
    infos = list_checkpoints(ck)
    assert [c.step for c in infos] == [2, 3, 4, 5]
    assert all(c.valid for c in infos)
    assert newest_valid(ck)[0].path == ck / "dcp-00000005"
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_hung_rank_stops_with_one_line(tmp_path: Path) -> None:
    """The last rank never reaches the step's collective; rank 0 stops after the
    collective timeout with one line naming its rank and the operation."""
    start = time.monotonic()
    rc, out = finish(torchrun("hang.py", 2, str(tmp_path), "3"), timeout=120)
    assert rc != 0
    rec = json.loads((tmp_path / "hang-rank0.json").read_text())
    assert rec["type"] == "CollectiveTimeoutError"
    # the step's first collective: the reduce-scatter that backward could not start (the
    # bucket holding `unused`, which never gets a gradient, and every one after it)
    assert rec["error"].startswith("rank 0/2: collective 'reduce_scatter gradients to owners'")
    assert "within 3 s" in rec["error"]
    assert 2.9 <= rec["elapsed"] < 30
    assert rec["error"] in out.splitlines()
    assert time.monotonic() - start < 100


@pytest.mark.slow
def test_four_ranks_match_single_process(tmp_path: Path) -> None:
    run_ok("parity.py", 4, str(tmp_path))
    _check_parity(results(tmp_path, "parity", 4), 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_nccl_one_gpu_sharded_path_matches_single_process(tmp_path: Path) -> None:
    """FSDP2 at world size 1 on NCCL: the sharded path's collectives on CUDA (the flag
    all-reduce and one round's two all-to-alls), bfloat16 Newton–Schulz (the default on a GPU with bf16 units) with
    the updates returned in bfloat16, equal to single-process ROOT on the same
    GPU. Written without a GPU to run it on; its logic ran on gloo/CPU."""
    rc, out = finish(torchrun("nccl_one.py", 1, str(tmp_path)))
    assert rc == 0, out[-6000:]
    (r,) = results(tmp_path, "nccl_one", 1)
    assert (r["world"], r["backend"], r["sharded"]) == (1, "nccl", True)
    assert r["moved"] > 1e-2
    assert r["param_diff"] < TOL, r["param_diff"]
    assert r["ns_matrices"] == 6  # w4, w1, the two of w3, w2, w5 (`unused` has no gradient)
    c = r["counts"]
    # one round's two all-to-alls (no flag all-reduce at world size 1); nothing leaves
    assert c["by_op"] == {"all_to_all_single": 2} and c["bytes_sent"] == 0
    assert c["full_tensor"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_nccl_two_gpus_match_single_process(tmp_path: Path) -> None:
    rc, out = finish(torchrun("parity.py", 2, str(tmp_path), "nccl"))
    assert rc == 0, out[-6000:]
    _check_parity(results(tmp_path, "parity", 2), 2)


# ---------------------------------------------------------------------------------------
# checkpoint publication rules (in-process, no process group)
# ---------------------------------------------------------------------------------------
def test_checkpoint_publication_and_newest_valid_rule(tmp_path: Path) -> None:
    from rootopt.distributed import checkpoint as dck
    from rootopt.train.checkpoint import list_checkpoints, newest_valid, prune

    model = common.make_model()
    opt = DistributedROOT(common.groups(model), **common.HYPER)
    ck = tmp_path / "ck"
    first = dck.save(ck, 3, model, opt, extra={"data_step": 3})
    assert first == ck / "dcp-00000003" and dck.inspect(first).valid
    # never overwritten
    marker = (first / "rootopt.json").read_bytes()
    with pytest.raises(dck.DistCheckpointError, match="already exists"):
        dck.save(ck, 3, model, opt)
    assert (first / "rootopt.json").read_bytes() == marker
    # a crash mid-save leaves a hidden partial directory; a newer directory without the
    # marker (torn copy) and a user's own file are not checkpoints
    (ck / ".dcp-00000007.partial-abc").mkdir()
    (ck / "dcp-00000009").mkdir()
    (ck / "dcp-00000009" / ".metadata").write_bytes(b"x")
    (ck / "notes.txt").write_text("mine")
    infos = {c.step: c for c in list_checkpoints(ck)}
    assert sorted(infos) == [3, 9]
    assert infos[3].valid and not infos[9].valid
    assert "rootopt.json unreadable" in infos[9].reason
    assert newest_valid(ck)[0].path == first
    with pytest.raises(dck.DistCheckpointError, match="dcp-00000009"):
        dck.load(ck / "dcp-00000009", model, opt)
    # prune keeps the newest valid ones and touches nothing else
    dck.save(ck, 5, model, opt)
    dck.save(ck, 6, model, opt)
    gone = prune(ck, run_id="", keep_last=2)
    assert gone == [first]
    left = sorted(p.name for p in ck.iterdir())
    assert left == [
        ".dcp-00000007.partial-abc",
        "dcp-00000005",
        "dcp-00000006",
        "dcp-00000009",
        "notes.txt",
    ]
    assert (ck / "notes.txt").read_text() == "mine"
    step, extra = dck.load(newest_valid(ck)[0].path, model, opt)  # type: ignore[union-attr]
    assert step == 6 and extra == {}
    with pytest.raises(ValueError, match="step"):
        dck.save(ck, -1, model, opt)


# ---------------------------------------------------------------------------------------
# process-group helpers (in-process)
# ---------------------------------------------------------------------------------------
def test_backend_resolution_and_single_process_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from rootopt.distributed import init_distributed, resolve_backend, world

    monkeypatch.setattr("rootopt.distributed.group._TIMEOUT_S", 1800.0)  # restored afterwards
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("gloo", "cpu") == "gloo"
    if not torch.cuda.is_available():
        assert resolve_backend("auto") == "gloo"
        with pytest.raises(ValueError, match="nccl needs a CUDA device"):
            resolve_backend("nccl")
    with pytest.raises(ValueError, match="'mpi' is unknown"):
        resolve_backend("mpi")  # type: ignore[arg-type]
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    info = init_distributed(backend="auto", timeout_s=5)  # no launcher: no process group
    assert (info.rank, info.world_size, info.backend, info.is_main) == (0, 1, None, True)
    assert world() == info
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed(timeout_s=0)


def test_finish_keeps_the_exit_code_and_flushes_output(tmp_path: Path) -> None:
    """``rootopt.distributed.finish`` leaves through ``os._exit`` (docs/distributed.md, "Ending a
    run"): the exit status must be the caller's and buffered stdout must not be lost."""
    script = (
        "import sys\n"
        "from rootopt.distributed import finish, init_distributed, world\n"
        f"init_distributed(backend='gloo', init_method='file://{tmp_path / 'pg'}', "
        "rank=0, world_size=1, timeout_s=30)\n"
        "assert world().backend == 'gloo'\n"
        "print('results written', end='')  # no newline: stays in the pipe's buffer\n"
        "finish(3)\n"
        "print('not reached')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "results written"


@pytest.mark.slow
def test_dead_rank_is_reported_without_waiting_for_the_timeout(tmp_path: Path) -> None:
    rc, out = finish(torchrun("hang.py", 2, str(tmp_path), "60", "die"), timeout=120)
    assert rc != 0
    rec = json.loads((tmp_path / "hang-rank0.json").read_text())
    assert rec["error"] in out.splitlines()
    assert rec["type"] == "CollectiveError"
    assert rec["error"].startswith("rank 0/2: collective 'reduce_scatter gradients to owners'")
    assert "failed after" in rec["error"]
    assert rec["elapsed"] < 30  # well before the 60 s timeout
