"""What a run is made of: the components (:class:`Run`), where it is (:class:`TrainState`)
and extension points (:class:`Hooks`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rootopt.config import Config
from rootopt.monitor import Monitor
from rootopt.train.build import Precision, ProcessInfo
from rootopt.train.metrics.health import Health
from rootopt.train.metrics.mfu import MFUMeter
from rootopt.train.metrics.records import Window
from rootopt.train.schedule import GradClipper
from rootopt.train.sync import GradSync

if TYPE_CHECKING:
    from rootopt.train.checkpoint import Checkpointer
    from rootopt.train.policies import Evaluate


@dataclass
class TrainState:
    """Where a run is: its position, and the state of the two policies a resumed run must
    continue: its health (:class:`~rootopt.train.metrics.health.Health`, the divergence policy) and
    the open logging window (:class:`~rootopt.train.metrics.records.Window`).

    With the components' state dicts it is saved in every checkpoint (:meth:`to_dict`: the
    position, then each part under its name), so a resumed run continues an open streak and
    writes the same records as an uninterrupted one.
    """

    step: int = 0  # optimizer steps attempted (applied + skipped)
    batches: int = 0  # micro-batches consumed by this rank: the data position
    tokens: int = 0  # tokens (or samples) consumed by this rank
    elapsed: float = 0.0  # training seconds over all sessions
    health: Health = field(default_factory=Health)
    window: Window = field(default_factory=Window)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batches": self.batches,
            "tokens": self.tokens,
            "elapsed": self.elapsed,
            "health": self.health.state_dict(),
            "window": self.window.state_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        """A state from :meth:`to_dict`, or the flat dict a checkpoint held before the
        policies kept their own state (every counter under its own name)."""
        st = cls(
            step=int(data["step"]),
            batches=int(data.get("batches", 0)),
            tokens=int(data.get("tokens", 0)),
            elapsed=float(data.get("elapsed", 0.0)),
        )
        if "health" in data:
            st.health.load_state_dict(data["health"])
            st.window.load_state_dict(data["window"])
        else:  # flat: the health counters by name, the window as window_*
            st.health.load_state_dict(data)
            if "window_steps" in data:
                st.window.load_state_dict(
                    {k: data[f"window_{k}"] for k in ("steps", "finite", "loss_sum", "tokens")}
                )
        return st

    def copy(self) -> TrainState:
        return TrainState.from_dict(self.to_dict())


@dataclass
class Hooks:
    """Test and extension points; ``after_step`` returning True stops like a signal."""

    after_backward: Callable[[int, nn.Module], None] | None = None
    after_step: Callable[[int], bool] | None = None


@dataclass
class Run:
    """Everything the loop and several components share, built by
    :func:`rootopt.train.loop.setup`; what one component alone reads is that component's
    (the mfu metric's :class:`~rootopt.train.metrics.mfu.MFUMeter`, the evaluation policy's
    bytes per token, the checkpointer's run id)."""

    cfg: Config
    info: ProcessInfo
    device: torch.device
    run_dir: Path
    data_dir: Path
    manifest: dict[str, Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    clipper: GradClipper
    precision: Precision
    # how the step's gradients are synchronised: DDP's, the optimizer's own, FSDP2's
    sync: GradSync
    monitor: Monitor
    routing: str
    # its checkpoint directory, the checkpoints written and resumed from, the last good one
    checkpointer: Checkpointer
    # the mfu metric: the model's training FLOPs per token and one device's peak
    mfu: MFUMeter
    # validation every run.eval_every steps; it holds the bytes each token id stands for
    evaluation: Evaluate
    state: TrainState = field(default_factory=TrainState)
    # a new run started from model.init_from: "DIR (step N of RUN)"
    # (rootopt.train.models.transformers_lm.init_source)
    initialised_from: str = ""
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
    # reduction, so every rank stops after the same step (rootopt.train.policies.Stop)
    vote: tuple[float, float] = (0.0, 0.0)

    @property
    def world_size(self) -> int:
        return self.info.world_size
