"""``rootopt.train`` under real torchrun processes (CPU, gloo, loopback): the world size
changes nothing but the speed (docs/distributed.md, "Training under torchrun"), ROOT
synchronises the gradients at DDP AdamW's bytes, checkpoints reshard in every direction
(bit for bit at the same world size), and runs saved with the DDP wrapper still resume.

Each launch runs in a subprocess with a timeout, so a hang fails fast. Several checks share
one set of launches to keep the default suite's time budget.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _faultkit import kill_session
from _train_fixtures import (
    TINY,
    logged_losses,
    prepare_tiny,
    torchrun,
    torchrun_cmd,
    torchrun_env,
)
from rootopt.config import load_config
from rootopt.train import train

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

STEPS = 12
# constant lr after warmup: a run stopped at step s and continued to STEPS follows the
# same schedule as an uninterrupted one (cosine would depend on run.max_steps)
CFG = [
    *TINY,
    f"run.max_steps={STEPS}",
    "run.log_every=1",
    "run.eval_every=0",
    "checkpoint.every=4",
    "optimization.schedule=constant",
    # float32 iterations: the world sizes are compared to float32 rounding (with bfloat16
    # iterations, the default on a CPU with bf16 units, they agree to bfloat16 rounding:
    # tests/test_parity.py)
    "optimization.ns_dtype=float32",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("dist-shards") / "d")


def _model(run: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model tensors, whatever its format (``.pt`` or DCP)."""
    ckpts = sorted((run / "checkpoints").glob("ckpt-*.pt")) + sorted(
        (run / "checkpoints").glob("dcp-*")
    )
    newest = max(ckpts, key=lambda p: int(p.name.split("-")[1].split(".")[0]))
    if newest.is_file():
        model = torch.load(newest, weights_only=False)["model"]
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        flat = run / f"{newest.name}.flat.pt"
        dcp_to_torch_save(newest, flat)
        model = torch.load(flat, weights_only=False)["model"]
    assert isinstance(model, dict)
    return model


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal to float tolerance. Gradients summed in another order differ by ~1e-7
    relative, and 12 steps of Newton–Schulz (a high-gain polynomial) plus AdamW's division
    by sqrt(v) grow that to a few 1e-6 absolute (measured up to 4e-6); one ROOT step moves
    an entry by about lr·0.2·√max(r,c)·rms(U) ≈ 1e-3 here, so 2e-5 still fails any wrong update."""
    assert sorted(a) == sorted(b) and len(a) > 10
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5, msg=k)


def _assert_same_losses(a: dict[int, float], b: dict[int, float]) -> None:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


def _one_process(run: Path, data: Path, over: list[str]) -> None:
    train(load_config(None, over), run, str(data), say=lambda _: None)


def _comm_bytes(run: Path) -> list[float]:
    from rootopt.monitor import read_jsonl

    return [r["comm_bytes"] for r in read_jsonl(run / "metrics.jsonl") if "comm_bytes" in r]


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, STEPS steps: the run every world size must reproduce."""
    ref = tmp_path_factory.mktemp("w1") / "run"
    _one_process(ref, shards, CFG)
    losses = logged_losses(ref)
    assert len(set(losses.values())) == STEPS  # the model trains: losses change
    assert losses[STEPS] < losses[1] - 0.5
    return ref


@pytest.fixture(scope="module")
def ddp2(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two processes, uninterrupted (the run a resume at world size 2 must equal bitwise)."""
    run = tmp_path_factory.mktemp("ddp2") / "run"
    out = torchrun(2, run, shards, CFG)
    assert "2 processes (ddp, gloo), global batch 8" in out.stdout
    return run


def test_world_sizes_1_2_3_and_fsdp_agree_at_ddp_adamws_bytes(
    reference: Path, ddp2: Path, shards: Path, tmp_path: Path
) -> None:
    """1, 2 and 3 (uneven: 8 = 3+3+2) ranks with ROOT under ``parallel: ddp`` (no DDP
    wrapper: the optimizer reduce-scatters the gradients) and FSDP2: the same logged losses
    and final parameters; the default clipping is on and clips. Each rank sends per step
    (``comm_bytes``, counted at the collectives) at most 1.05x what AdamW under DDP sends
    on the same model."""
    from rootopt.monitor import read_jsonl

    base_losses, base_model = logged_losses(reference), _model(reference)
    clips = [r["clip_scale"] for r in read_jsonl(reference / "metrics.jsonl") if "clip_scale" in r]
    assert len(clips) == STEPS and min(clips) < 1.0  # global-norm clipping did clip
    runs = {"ddp2": ddp2}
    for name, n, extra in (("ddp3", 3, []), ("fsdp2", 2, ["distributed.parallel=fsdp"])):
        runs[name] = tmp_path / name
        out = torchrun(n, runs[name], shards, [*CFG, *extra])
        mode = "fsdp" if extra else "ddp"
        assert f"{n} processes ({mode}, gloo), global batch 8" in out.stdout
    for name, run in runs.items():
        assert (run / "checkpoints" / f"dcp-{STEPS:08d}").is_dir()
        _assert_same_losses(base_losses, logged_losses(run))
        _assert_same(base_model, _model(run))
        clipped = [r["clip_scale"] for r in read_jsonl(run / "metrics.jsonl") if "clip_scale" in r]
        assert clipped == pytest.approx(clips, rel=1e-4), name  # the same global norm
    assert not _comm_bytes(reference) and not _comm_bytes(runs["fsdp2"])  # not counted there
    for world, root in ((2, runs["ddp2"]), (3, runs["ddp3"])):
        adamw = tmp_path / f"adamw{world}"
        torchrun(world, adamw, shards, [*CFG, "run.max_steps=2", "optimization.optimizer=AdamW"])
        ours, theirs = _comm_bytes(root), _comm_bytes(adamw)
        assert len(ours) == STEPS and len(theirs) == 2
        assert len(set(ours)) == 1 and len(set(theirs)) == 1  # the same every step
        ratio = ours[0] / theirs[0]
        # 2·(W−1)/W of the model's bytes each, plus sync_grads' flags (a few hundred bytes)
        assert 1.0 <= ratio <= 1.05, (world, ours[0], theirs[0])


def test_resume_across_world_sizes_and_bitwise_at_the_same(
    reference: Path, ddp2: Path, shards: Path, tmp_path: Path
) -> None:
    """A run saved at world size 2 continues at 1 and at 3, one saved at 3 continues at 2,
    one saved at 1 continues at 2 (checkpoints dcp → .pt → dcp, resharded), each equal to
    the uninterrupted run step for step; saved at 2 and continued at 2 it is the
    uninterrupted world-2 run bit for bit."""
    base_losses, base_model = logged_losses(reference), _model(reference)
    first = tmp_path / "first"
    torchrun(2, first, shards, [*CFG, "run.max_steps=5"])
    assert (first / "checkpoints" / "dcp-00000005").is_dir()

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(first, dst, ignore=shutil.ignore_patterns(".lock"))
        return dst

    # 2 → 1 → 3
    chain = copy("chain")
    said: list[str] = []
    train(load_config(None, [*CFG, "run.max_steps=9"]), chain, str(shards), say=said.append)
    assert "resumed from dcp-00000005 at step 5 (saved at world size 2)" in said
    out = torchrun(3, chain, shards, CFG)
    assert "resumed from ckpt-00000009.pt at step 9 (saved at world size 1)" in out.stdout
    _assert_same_losses(base_losses, logged_losses(chain))
    _assert_same(base_model, _model(chain))
    # checkpoint.keep_last (3) counts both formats in the order they were written: the
    # world-2 dcp-4 and dcp-5 were pruned by the later .pt and DCP saves (each format's
    # files used to be pruned only by saves of the same format, so old .pt files stayed)
    kept = sorted(p.name for p in (chain / "checkpoints").iterdir() if p.name[0] != ".")
    want = ["ckpt-00000008.json", "ckpt-00000008.pt", "ckpt-00000009.json", "ckpt-00000009.pt"]
    assert kept == [*want, "dcp-00000012", "owner.json"], kept
    # 2 → 3 → 2
    back = copy("back")
    out = torchrun(3, back, shards, [*CFG, "run.max_steps=9"])
    assert "resumed from dcp-00000005 at step 5 (saved at world size 2)" in out.stdout
    out = torchrun(2, back, shards, CFG)
    assert "resumed from dcp-00000009 at step 9 (saved at world size 3)" in out.stdout
    _assert_same_losses(base_losses, logged_losses(back))
    _assert_same(base_model, _model(back))
    # 1 → 2
    one = tmp_path / "one"
    _one_process(one, shards, [*CFG, "run.max_steps=5"])
    out = torchrun(2, one, shards, CFG)
    assert "resumed from ckpt-00000005.pt at step 5 (saved at world size 1)" in out.stdout
    _assert_same_losses(base_losses, logged_losses(one))
    _assert_same(base_model, _model(one))
    # 2 → 2: bit for bit the uninterrupted world-2 run
    same = copy("same")
    out = torchrun(2, same, shards, CFG)
    assert "resumed from dcp-00000005 at step 5" in out.stdout
    assert logged_losses(same) == logged_losses(ddp2)
    got, want_model = _model(same), _model(ddp2)
    assert sorted(got) == sorted(want_model)
    for k in got:
        assert torch.equal(got[k], want_model[k]), k


def test_diagnose_and_export_read_a_torchrun_runs_newest_dcp_checkpoint(
    ddp2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run trained with torchrun holds only ``dcp-*`` checkpoints: ``rootopt diagnose``
    rebuilds its model from the newest one (it used to read ``ckpt-*.pt`` only and
    diagnose a fresh model), and ``rootopt export`` writes that checkpoint's weights."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from rootopt.commands.diagnose import main as diagnose_main
    from rootopt.commands.export import main as export_main

    assert not list((ddp2 / "checkpoints").glob("ckpt-*"))
    capsys.readouterr()
    assert diagnose_main([str(ddp2)]) == 0
    assert capsys.readouterr().out.startswith(f"diagnostics at step {STEPS} (checkpoint)")
    assert export_main([str(ddp2), str(tmp_path / "hf")]) == 0
    assert f"exported dcp-{STEPS:08d} (step {STEPS})" in capsys.readouterr().out
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.embed_tokens.weight"], _model(ddp2)["embed.weight"])


OLD_RUN = Path(__file__).resolve().parent / "data" / "ddp_run_3ad6c87"


@pytest.mark.parametrize("world", [1, 2])
def test_a_run_saved_with_the_ddp_wrapper_still_resumes(
    world: int, shards: Path, tmp_path: Path
) -> None:
    """tests/data/ddp_run_3ad6c87 (tests/data/make_ddp_run.py): a world-2 run saved when
    the loop wrapped the model in DDP. Its step-4 checkpoint resumes at world sizes 2 (no
    wrapper now) and 1 and logs the losses of steps 5 and 6 that version logged."""
    run = tmp_path / "old"
    shutil.copytree(OLD_RUN, run)
    old = logged_losses(run)
    assert sorted(old) == [1, 2, 3, 4, 5, 6]
    over = [*CFG, "run.max_steps=6"]
    if world == 1:
        said: list[str] = []
        train(load_config(None, over), run, str(shards), say=said.append)
        assert "resumed from dcp-00000004 at step 4 (saved at world size 2)" in said
    else:
        out = torchrun(2, run, shards, over)
        assert "resumed from dcp-00000004 at step 4" in out.stdout
    new = logged_losses(run)
    assert sorted(new) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):
        assert abs(new[step] - old[step]) <= 1e-5 * abs(old[step]), (step, new[step], old[step])
    assert (run / "checkpoints" / "dcp-00000006").is_dir() or world == 1


def test_fp16_loss_scaling_is_agreed_across_ranks(shards: Path, tmp_path: Path) -> None:
    """fp16 autocast with a dynamic loss scale (growing every 3 steps): the optimizer
    unscales the synchronised gradients inside the step and every rank updates the scale
    the same way, so world size 2 logs the loss scales and losses of one process."""
    over = [
        *CFG,
        "run.max_steps=8",
        "mixed_precision.enabled=true",
        "mixed_precision.dtype=fp16",
        "mixed_precision.loss_scale=dynamic",
        "mixed_precision.growth_interval=3",
        "mixed_precision.init_scale=256",
    ]
    from rootopt.monitor import read_jsonl

    ref, run = tmp_path / "w1", tmp_path / "w2"
    _one_process(ref, shards, over)
    torchrun(2, run, shards, over)
    scales = [
        [r["loss_scale"] for r in read_jsonl(d / "metrics.jsonl") if "loss" in r]
        for d in (ref, run)
    ]
    assert scales[0] == scales[1] and scales[0][-1] > 256  # it grew, on every rank alike
    a, b = logged_losses(ref), logged_losses(run)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-3 * abs(a[step]), (step, a[step], b[step])


def test_bad_launch_settings_are_one_line(shards: Path, tmp_path: Path) -> None:
    cases = [
        ({}, ["distributed.parallel=zero"], "distributed.parallel"),
        # WORLD_SIZE without the rendezvous address used to end in a traceback
        (
            {"WORLD_SIZE": "2", "RANK": "0"},
            [],
            "WORLD_SIZE=2 is set but MASTER_ADDR and MASTER_PORT are not",
        ),
    ]
    for extra, over, want in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "rootopt.train", "--log_dir", str(tmp_path / "r"), *over],
            env={**torchrun_env(), **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0], lines
        assert not (tmp_path / "r").exists()


def _worker(agent: int, rank: int, deadline: float) -> int:
    """pid of the torchrun worker with ``RANK=rank`` (a child of the agent process)."""
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(child)
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(path: Path, deadline: float) -> None:
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")
def test_hung_rank_is_stopped_by_the_collective_timeout(shards: Path, tmp_path: Path) -> None:
    """SIGSTOP rank 1 mid-run: rank 0 gives up after distributed.timeout_s with one line
    naming itself and the operation; torchrun then ends the job (no restart budget)."""
    run = tmp_path / "hang"
    over = [*CFG, "run.max_steps=100000", "checkpoint.every=1000", "distributed.timeout_s=4"]
    proc = subprocess.Popen(
        torchrun_cmd(2, run, shards, over),
        env=torchrun_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the launcher and its workers: killed together on failure
    )
    try:
        deadline = time.monotonic() + 120
        while len(logged_losses(run) if (run / "metrics.jsonl").exists() else {}) < 3:
            assert time.monotonic() < deadline, "no training step was logged"
            time.sleep(0.05)
        victim = _worker(proc.pid, 1, deadline)
        rank0 = _worker(proc.pid, 0, deadline)
        os.kill(victim, signal.SIGSTOP)
        while _alive(rank0) and time.monotonic() < deadline:
            time.sleep(0.1)  # rank 0 gives up after the timeout ...
        os.kill(victim, signal.SIGKILL)  # ... and a stopped process ignores torchrun's SIGTERM
        _, err = proc.communicate(timeout=120)
    finally:
        kill_session(proc)
    assert proc.returncode != 0
    lines = [ln for ln in err.splitlines() if ln.startswith("rootopt train")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 0/2: collective" in lines[0] and "did not complete within 4 s" in lines[0]
    assert "Traceback" not in err.split("rootopt train")[0][-500:]


# A rank killed under `torchrun --max-restarts=1` (without --log_dir, as the README runs
# it): tests/test_user_path.py::test_torchrun_max_restarts_after_a_killed_rank.


def test_global_batches_do_not_depend_on_world_size_workers_or_resume(shards: Path) -> None:
    """The loop's data path (ShardSamples + StreamBatchSampler): rank parts of each global
    micro-batch concatenate to the world-1 batch for W = 1, 2, 3, with 0 or 2 loader
    workers and after a resume at another world size; an epoch covers each sample once."""
    import functools

    from torch.utils.data import DataLoader

    from rootopt.data import ShardSamples, collate
    from rootopt.train.data import StreamBatchSampler

    ds = ShardSamples(shards, "train", seq_len=32, seed=0, shuffle=True)
    b, steps = 8, 12

    def inputs(world: int, rank: int, start: int, workers: int = 0) -> list[torch.Tensor]:
        sampler = StreamBatchSampler(
            len(ds), b, rank=rank, world_size=world, shuffle=False, start_step=start
        )
        loader = DataLoader(
            ds,
            batch_sampler=sampler,
            num_workers=workers,
            collate_fn=functools.partial(collate, task=ds.task),
        )
        out = []
        for i, batch in enumerate(loader):
            if i == steps - start:
                break
            out.append(batch["input"])
        return out

    ref = inputs(1, 0, 0)
    assert len(ref) == steps and all(x.shape == (b, 32) for x in ref)
    for world in (2, 3):
        parts = [inputs(world, r, 0) for r in range(world)]
        assert [len(p) for p in parts] == [steps] * world
        for t in range(steps):
            assert torch.equal(torch.cat([p[t] for p in parts]), ref[t])
    assert all(torch.equal(x, y) for x, y in zip(inputs(1, 0, 0, workers=2), ref, strict=True))
    resumed = [inputs(3, r, 5) for r in range(3)]  # e.g. saved at world 2 after 5 batches
    for t in range(steps - 5):
        assert torch.equal(torch.cat([p[t] for p in resumed]), ref[5 + t])
    # one epoch: every sample exactly once (no overlap, no gap), in a shuffled order
    epoch = [tuple(ds[i][0].tolist()) for i in range(len(ds))]
    assert len(epoch) == len(ds) > steps * b
    unshuffled = ShardSamples(shards, "train", seq_len=32, seed=0, shuffle=False)
    assert sorted(epoch) == sorted(tuple(unshuffled[i][0].tolist()) for i in range(len(ds)))
    assert epoch != [tuple(unshuffled[i][0].tolist()) for i in range(len(ds))]


@pytest.mark.slow
def test_two_nodes_on_localhost_train_like_one_process(shards: Path, tmp_path: Path) -> None:
    """Two torchrun invocations (--nnodes 2, node ranks 0/1, c10d rendezvous on
    127.0.0.1) train the same losses and parameters as one process."""
    import socket

    ref = tmp_path / "w1"
    _one_process(ref, shards, CFG)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = tmp_path / "nodes"
    procs = [
        subprocess.Popen(
            torchrun_cmd(1, run, shards, CFG, "--nnodes=2", f"--node_rank={node}",
                 "--rdzv-backend=c10d", "--rdzv-id=loop-two-node",
                 f"--rdzv-endpoint=127.0.0.1:{port}"),
            env=torchrun_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            kill_session(p)
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    _assert_same_losses(logged_losses(ref), logged_losses(run))
    _assert_same(_model(ref), _model(run))


def test_fsdp_run_with_tensorboard_histograms(shards: Path, tmp_path: Path) -> None:
    """FSDP2 with TensorBoard histograms on (the embedded default writes them every 100
    steps): rank 0 summarises each sharded parameter by its own shard instead of calling
    ``.numpy()`` on a DTensor, which stopped the run at its first histogram step."""
    run = tmp_path / "tb"
    over = [
        *CFG,
        "run.max_steps=4",
        "distributed.parallel=fsdp",
        "monitoring.tensorboard=true",
        "monitoring.histogram_every=2",
    ]
    torchrun(2, run, shards, over)
    assert (run / "checkpoints" / "dcp-00000004").is_dir()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    tags = acc.Tags()["histograms"]
    assert "param_shard/embed.weight" in tags and "grad_shard/embed.weight" in tags
    assert [e.step for e in acc.Histograms("param_shard/embed.weight")] == [2, 4]
