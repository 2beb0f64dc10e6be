"""World-size parity at the default optimizer settings: a 100-step training run under
torchrun (DDP, gloo) at world size 2 and 3 logs the same losses as one process, to 1e-4
relative at every step.

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

from pathlib import Path

import pytest
import torch

from _train_fixtures import TINY, logged_losses, prepare_tiny, torchrun
from rootopt.config import OptimizationConfig, load_config
from rootopt.train import train

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

STEPS = 100
RTOL = 1e-4
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


@pytest.fixture(scope="module")
def one_process(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    cfg = load_config(None, CFG)
    assert cfg.optimization == OptimizationConfig()  # nothing optimizer-side overridden
    run = tmp_path_factory.mktemp("parity") / "w1"
    train(cfg, run, str(shards), say=lambda _: None)
    losses = logged_losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    # the model learns (a model that does not train would agree across world sizes trivially)
    assert max(losses[s] for s in range(STEPS - 9, STEPS + 1)) < losses[1] - 2.0, losses
    return losses


@pytest.mark.parametrize("world", [2, 3])
def test_default_run_logs_the_same_losses_at_world_size(
    world: int, one_process: dict[int, float], shards: Path, tmp_path: Path
) -> None:
    run = tmp_path / f"w{world}"
    out = torchrun(world, run, shards, CFG)
    assert f"{world} processes (ddp, gloo), global batch 8" in out.stdout
    losses = logged_losses(run)
    assert sorted(losses) == sorted(one_process) == list(range(1, STEPS + 1))
    rel = {s: abs(losses[s] - one_process[s]) / abs(one_process[s]) for s in one_process}
    over = [s for s in sorted(rel) if rel[s] > RTOL]
    worst = max(rel, key=rel.__getitem__)
    assert not over, (
        f"world {world}: {len(over)} of {STEPS} losses differ by more than {RTOL:g} relative, "
        f"first at step {over[0]} ({one_process[over[0]]:.6f} vs {losses[over[0]]:.6f}); "
        f"largest {rel[worst]:.2e} at step {worst}"
    )
