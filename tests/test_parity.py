"""World-size parity at the default optimizer settings: a 100-step training run under
torchrun (``parallel: ddp``, gloo; ROOT synchronises the gradients itself, without a DDP
wrapper) at world size 2 and 3 logs the same losses as one process, to 1e-4 relative at
every step, with the default global-norm clipping (it clips) and with two micro-batches per
step.

What this guards: nothing in the default update may be a hard switch that flips on
float32 rounding. Across world sizes the gradients are summed in another order (about
1e-7 relative apart); a smooth update keeps that difference near round-off for the whole
run, while a per-matrix decision taken by comparing a statistic with a threshold (for
example a selector that picks one of two Newton–Schulz schedules) can go one way on one
process count and the other way on another, and from that step on the runs train
differently. tests/test_dist_train.py checks the same equality on a short run at fixed
settings; this test keeps every ``optimization.*`` option at the training CLI's default
(the model and data are shrunk only so that it runs in seconds on a CPU), so that a
default that carries such a switch fails here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from _train_fixtures import TINY, logged_losses, prepare_tiny, torchrun
from rootopt.config import OptimizationConfig, load_config
from rootopt.monitor import read_jsonl
from rootopt.train import train

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

STEPS = 100
# The default run iterates Newton–Schulz in bfloat16: an owner stacks a subset of the
# same-shape matrices one process stacks together, and bfloat16 matmuls round differently with
# the stack's size, so world sizes agree to bfloat16 rounding carried over 100 steps (measured:
# at most 6.6e-4 relative). tests/test_dist_train.py checks float32 iterations to 1e-5.
RTOL = 2e-3
# TINY's model and data; its optimization.* entries are dropped (the defaults are the
# point of the test), one checkpoint at the end (each save costs time, DCP at world > 1)
CFG = [
    *(o for o in TINY if not o.startswith("optimization.")),
    f"run.max_steps={STEPS}",
    "run.log_every=1",
    "run.eval_every=0",
    f"checkpoint.every={STEPS}",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("parity-shards") / "d")


@pytest.fixture(scope="module", params=[1, 2], ids=["accum1", "accum2"])
def one_process(
    request: pytest.FixtureRequest, shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, dict[int, float]]:
    accum = int(request.param)
    cfg = load_config(None, [*CFG, f"optimization.grad_accum_steps={accum}"])
    # nothing optimizer-side overridden but the micro-batches per step
    assert cfg.optimization == replace(OptimizationConfig(), grad_accum_steps=accum)
    run = tmp_path_factory.mktemp("parity") / "w1"
    train(cfg, run, str(shards), say=lambda _: None)
    losses = logged_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    # the model learns (a model that does not train would agree across world sizes trivially)
    assert max(losses[s] for s in range(STEPS - 9, STEPS + 1)) < losses[1] - 2.0, losses
    # the default clipping (global norm 1.0) is on and clips
    clips = [r["clip_scale"] for r in read_jsonl(run / "metrics.jsonl") if "clip_scale" in r]
    assert len(clips) == STEPS and min(clips) < 0.9, clips
    return accum, losses


@pytest.mark.parametrize("world", [2, 3])
def test_default_run_logs_the_same_losses_at_world_size(
    world: int, one_process: tuple[int, dict[int, float]], shards: Path, tmp_path: Path
) -> None:
    accum, ref = one_process
    run = tmp_path / f"w{world}"
    out = torchrun(world, run, shards, [*CFG, f"optimization.grad_accum_steps={accum}"])
    assert f"{world} processes (ddp, gloo), global batch 8" in out.stdout
    losses = logged_losses(run)
    assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
    rel = {s: abs(losses[s] - ref[s]) / abs(ref[s]) for s in ref}
    over = [s for s in sorted(rel) if rel[s] > RTOL]
    worst = max(rel, key=rel.__getitem__)
    assert not over, (
        f"world {world}, {accum} micro-batches: {len(over)} of {STEPS} losses differ by more "
        f"than {RTOL:g} relative, first at step {over[0]} ({ref[over[0]]:.6f} vs "
        f"{losses[over[0]]:.6f}); largest {rel[worst]:.2e} at step {worst}"
    )
