"""What a run is made of: the components (:class:`Run`), the counters that say where it is
(:class:`TrainState`), extension points (:class:`Hooks`) and the result (:class:`Summary`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rootopt.config import Config
from rootopt.monitor import Monitor
from rootopt.train.build import Precision, ProcessInfo
from rootopt.train.schedule import GradClipper


@dataclass
class TrainState:
    """Counters that, with the components' state dicts, define where a run is.

    Everything here is saved in every checkpoint, including the open logging window (the
    steps since the last metric record), so a resumed run writes the same records as an
    uninterrupted one.
    """

    step: int = 0  # optimizer steps attempted (applied + skipped)
    batches: int = 0  # micro-batches consumed by this rank: the data position
    tokens: int = 0  # tokens (or samples) consumed by this rank
    nonfinite_steps: int = 0
    elapsed: float = 0.0  # training seconds over all sessions
    # divergence policy (docs/training.md, "Divergence")
    nonfinite_streak: int = 0
    spike_streak: int = 0
    recent_losses: list[float] = field(default_factory=list)
    # an open "trouble episode": from the first non-finite or spiking step until
    # run.loss_spike_window finite steps in a row; checkpoints written inside one are
    # suspect (never replace the last good one, moved aside if the run diverges)
    trouble_since: int = -1
    finite_run: int = 0
    # the open logging window: steps since the previous record
    window_steps: int = 0
    window_finite: int = 0
    window_loss_sum: float = 0.0
    window_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["recent_losses"] = list(self.recent_losses)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def copy(self) -> TrainState:
        return TrainState.from_dict(self.to_dict())


@dataclass
class Hooks:
    """Test and extension points; ``after_step`` returning True stops like a signal."""

    after_backward: Callable[[int, nn.Module], None] | None = None
    after_step: Callable[[int], bool] | None = None


@dataclass
class Run:
    """Everything the loop uses, built by :func:`rootopt.train.loop.setup`."""

    cfg: Config
    info: ProcessInfo
    device: torch.device
    run_dir: Path
    ckpt_dir: Path
    data_dir: Path
    manifest: dict[str, Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    clipper: GradClipper
    precision: Precision
    monitor: Monitor
    routing: str
    run_id: str
    state: TrainState = field(default_factory=TrainState)
    resumed_from: str = ""
    last_checkpoint: str = ""  # newest checkpoint of this run written (or resumed from)
    good_checkpoint: str = ""  # newest one written outside a trouble episode
    suspect: list[str] = field(default_factory=list)  # written inside the open episode
    release: Callable[[], None] = lambda: None  # drops the checkpoint-directory lock
    params: list[torch.Tensor] = field(default_factory=list)  # trainable parameters
    telemetry: bool = False  # the optimizer collects per-matrix telemetry at log steps
    controller: Any = None  # rootopt.rl.controller.Controller (optimization.controller)
    # "between" steps (state consistent), "data" (reading/forward/backward: model and
    # optimizer untouched), "update" (optimizer/scaler/clipper may be half-updated)
    phase: str = "between"
    # this rank's share of the global micro-batch × world size / global batch
    # (GlobalBatchSampler.loss_weight): the DDP average of the weighted losses is the
    # global-batch mean even when the world size does not divide the batch
    loss_weight: float = 1.0
    # at world size > 1 a stop (signal, run.max_time) is voted on in each step's loss
    # reduction, so every rank stops after the same step; "" = keep going
    vote: tuple[float, float] = (0.0, 0.0)
    stop_status: str = ""
    # the mfu metric (rootopt.train.mfu): the model's training FLOPs per token and one
    # device's peak (rank 0 measures or looks it up; None elsewhere)
    flops_per_token: float = 0.0
    peak: Any = None

    @property
    def world_size(self) -> int:
        return self.info.world_size


@dataclass
class Summary:
    status: str  # running | completed | interrupted | max_time | diverged | failed
    steps: int  # total optimizer steps of the run
    session_steps: int  # steps this process ran
    wall_s: float
    steps_per_s: float  # this session
    tokens_per_s: float  # this session
    initial_loss: float
    final_loss: float
    val_loss: float
    nonfinite_steps: int
    checkpoint: str
    run_dir: str
    resumed_from: str
    signal: int = 0
    max_steps: int = 0
    detail: str = ""  # why the session stopped, when not completed
    # lines in metrics.jsonl when the summary was written (None: no JSONL log); `rootopt
    # report` compares it with the file to tell a complete log from a cut one
    metrics_records: int | None = None
