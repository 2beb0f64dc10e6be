"""Distributed ROOT: process groups, the sharded optimizer step, resharding checkpoints
and a world-size-invariant sampler (docs/distributed.md).

Imports ``optim``/``ortho``/``coeffs`` only; never the training loop.
"""

from __future__ import annotations

from rootopt.dist.group import (
    CollectiveError,
    CollectiveTimeoutError,
    PendingCollective,
    RendezvousError,
    WorldInfo,
    abort,
    collective,
    describe_failure,
    exit_now,
    finish,
    claim_failure,
    init_distributed,
    report_to_launcher,
    resolve_backend,
    shutdown,
    start_collective,
    world,
)
from rootopt.dist.model import unwrap_model, wrap_model
from rootopt.dist.owners import assign_owners, chunk_rows, ns_cost
from rootopt.dist.root import DistributedROOT, StepStats

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "DistributedROOT",
    "PendingCollective",
    "RendezvousError",
    "StepStats",
    "WorldInfo",
    "abort",
    "assign_owners",
    "chunk_rows",
    "collective",
    "describe_failure",
    "exit_now",
    "finish",
    "claim_failure",
    "init_distributed",
    "ns_cost",
    "report_to_launcher",
    "resolve_backend",
    "shutdown",
    "start_collective",
    "unwrap_model",
    "world",
    "wrap_model",
]
