"""Distributed ROOT: process groups, the optimizer across ranks (one design per layout:
:mod:`~rootopt.distributed.replicated`, :mod:`~rootopt.distributed.sharded`), resharding
checkpoints and a world-size-invariant sampler (docs/distributed.md).

Imports ``optim``/``ortho``/``coeffs`` only; never the training loop, and never the cost
model (:mod:`rootopt_analysis.costmodel`, analysis outside the runtime).
"""

from __future__ import annotations

from rootopt.distributed.flat import StepStats
from rootopt.distributed.group import (
    CollectiveError,
    CollectiveTimeoutError,
    PendingCollective,
    RendezvousError,
    WorldInfo,
    abort,
    claim_failure,
    collective,
    describe_failure,
    exit_now,
    finish,
    init_distributed,
    report_to_launcher,
    resolve_backend,
    shutdown,
    start_collective,
    world,
)
from rootopt.distributed.model import broadcast_parameters, unwrap_model, wrap_model
from rootopt.distributed.owners import assign_owners, chunk_rows, ns_cost
from rootopt.distributed.root import DistributedROOT

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
    "broadcast_parameters",
    "chunk_rows",
    "claim_failure",
    "collective",
    "describe_failure",
    "exit_now",
    "finish",
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
