"""Components built outside the loop: process info, device, data, optimizer, precision."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rootopt.config import Config, ConfigError, loss_scale_value
from rootopt.optim import make_optimizer
from rootopt.optim.registry import get as optimizer_spec


class TrainingError(RuntimeError):
    """A failure the user can act on; the command line prints it as one line."""


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    note: str = ""  # a line rank 0 prints about how the world was chosen

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int = 0) -> int:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            [f"environment: {name}={raw[:40]!r} is not an integer (set by the launcher)"]
        ) from None


def process_info(cfg: Config) -> ProcessInfo:
    """Rank and world size; starts the process group when there is more than one process.

    Under a launcher (torchrun, a Kubeflow PyTorchJob) ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
    come from the environment and the ``distributed`` block gives the backend (``auto``:
    nccl on CUDA, gloo on CPU), ``init_method``, ``timeout_s`` and ``rendezvous_timeout_s``
    (docs/distributed.md). With ``init_method: env://`` and no launcher the process is the
    whole world: ``distributed.world_size`` is then the size to launch with, and a note says
    so. Without a launcher, ``distributed.world_size > 1`` with another ``init_method``
    (e.g. ``tcp://host:port``) starts the group with each process's ``distributed.rank``.
    """
    from rootopt.distributed import init_distributed

    d = cfg.distributed
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        info = ProcessInfo(
            torch.distributed.get_rank(),
            torch.distributed.get_world_size(),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    elif "WORLD_SIZE" in os.environ:
        info = _launched(d.init_method)
    elif d.world_size > 1 and d.init_method == "env://":
        info = ProcessInfo(
            0,
            1,
            0,
            f"distributed.world_size={d.world_size} is the size to launch with; no launcher "
            "environment (WORLD_SIZE) is set, so this runs as one process (all of them: "
            f"torchrun --nproc_per_node={d.world_size} -m rootopt.train ...)",
        )
    else:
        info = ProcessInfo(d.rank, d.world_size, 0)
    if info.world_size > 1 and not torch.distributed.is_initialized():
        device = resolve_device(cfg, info)
        try:
            init_distributed(
                backend=d.backend,
                init_method=d.init_method,
                timeout_s=d.timeout_s,
                device=device,
                rank=info.rank,
                world_size=info.world_size,
                rendezvous_timeout_s=d.rendezvous_timeout_s,
            )
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
    return info


def _launched(init_method: str) -> ProcessInfo:
    """Rank and world size from a launcher's environment, checked."""
    info = ProcessInfo(_env_int("RANK"), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK"))
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise ConfigError(
            [f"environment: RANK={info.rank} is not in [0, WORLD_SIZE={info.world_size})"]
        )
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if info.world_size > 1 and init_method == "env://" and missing:
        raise ConfigError(
            [
                f"environment: WORLD_SIZE={info.world_size} is set but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: start the ranks with torchrun "
                "(it sets them), or set both to rank 0's host and a free port"
            ]
        )
    return info


def barrier(info: ProcessInfo, name: str) -> None:
    """Wait for every rank (no-op in one process), under the collective timeout."""
    if info.world_size > 1:
        from rootopt.distributed import collective

        collective(name, torch.distributed.barrier)


def resolve_device(cfg: Config, info: ProcessInfo) -> torch.device:
    want = cfg.run.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["run.device: cuda requested but no CUDA device is available"])
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", info.local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


# --------------------------------------------------------------------------- optimizer


def parallelize(cfg: Config, model: nn.Module, info: ProcessInfo) -> nn.Module:
    """At world size > 1: ``distributed.parallel`` = ddp or fsdp (FSDP2 ``fully_shard`` per
    transformer block, then the whole model). Under ddp, ROOT and Muon synchronise the
    gradients in the optimizer (:func:`optimizer_syncs_grads`): the model stays unwrapped
    and only rank 0's parameters are broadcast, as DDP would; other optimizers get
    ``DistributedDataParallel``. World 1: unchanged. The FSDP2 units are the model's own
    repeated layers (:func:`rootopt.train.models.blocks_of`)."""
    if info.world_size == 1:
        return model
    from rootopt.distributed import broadcast_parameters, wrap_model
    from rootopt.train.models import blocks_of

    mode = cfg.distributed.parallel
    if optimizer_syncs_grads(cfg, info.world_size):
        broadcast_parameters(model)
        return model
    units = {id(b) for b in blocks_of(model)}
    unit = (lambda m: id(m) in units) if mode == "fsdp" else None
    # the models' buffers are constants (RoPE tables), identical on every rank: DDP need
    # not broadcast them before every forward
    return wrap_model(model, mode, shard_unit=unit, broadcast_buffers=False)


def optimizer_syncs_grads(cfg: Config, world_size: int) -> bool:
    """ROOT or Muon under ``parallel: ddp`` at world size > 1: no DDP wrapper;
    ``DistributedROOT(average_grads=True)`` reduce-scatters the gradients to their owners
    (started during backward), unscales, checks and clips them there, at DDP AdamW's bytes
    (docs/distributed.md, "Training under torchrun")."""
    return (
        world_size > 1
        and cfg.distributed.parallel == "ddp"
        and cfg.optimization.optimizer.lower() in ("root", "muon")
    )


def build_optimizer(
    cfg: Config, model: nn.Module, world_size: int = 1
) -> tuple[torch.optim.Optimizer, str]:
    """The configured optimizer and a printable routing table ('' when not ROOT/Muon).

    At world size > 1, ROOT (and Muon mode) is :class:`rootopt.distributed.DistributedROOT`: each
    matrix is thresholded and orthogonalized by one owner rank (docs/distributed.md); under
    ddp it synchronises the gradients itself (``model`` is not wrapped), under fsdp
    ``model`` holds FSDP2's shards.
    """
    o = cfg.optimization
    name = o.optimizer.lower()
    try:
        spec = optimizer_spec(name)
    except ValueError as exc:
        raise ConfigError([f"optimization: {str(exc).splitlines()[0]}"]) from None
    # The registry names which optimization.* keys each optimizer takes.
    extra: dict[str, Any] = {k: getattr(o, k) for k in spec.config_options}
    try:
        if world_size > 1 and name in ("root", "muon"):
            return _distributed_root(cfg, model, name, extra, world_size)
        opt, report = make_optimizer(
            name,
            model,
            lr=o.base_lr,
            weight_decay=o.weight_decay,
            betas=(o.beta1, o.beta2),
            eps=o.epsilon,
            **extra,
        )
    except ValueError as exc:
        raise ConfigError([f"optimization: {str(exc).splitlines()[0]}"]) from None
    return opt, (str(report) if report is not None else "")


def _distributed_root(
    cfg: Config, model: nn.Module, name: str, extra: dict[str, Any], world_size: int
) -> tuple[torch.optim.Optimizer, str]:
    """DistributedROOT on the same routing as :func:`rootopt.optim.make_optimizer`."""
    from rootopt.distributed import DistributedROOT, unwrap_model
    from rootopt.optim import param_groups

    o = cfg.optimization
    opts = dict(extra)
    # per-matrix telemetry needs every matrix on one rank; owners see only their own
    opts["telemetry"] = False
    if name == "muon":
        opts.update(outlier_quantile=None, ns_coefficients="muon", ns_dtype="bfloat16")
    betas = (o.beta1, o.beta2)
    groups, report = param_groups(
        unwrap_model(model),
        lr=o.base_lr,
        weight_decay=o.weight_decay,
        adamw_betas=betas,
        adamw_eps=o.epsilon,
    )
    opts["average_grads"] = optimizer_syncs_grads(cfg, world_size)
    opt = DistributedROOT(
        groups,
        lr=o.base_lr,
        weight_decay=o.weight_decay,
        adamw_betas=betas,
        adamw_eps=o.epsilon,
        **opts,
    )
    return opt, str(report)


# --------------------------------------------------------------------------- precision


class Precision:
    """Autocast + loss scaling in one place.

    * disabled: float32, no scaling.
    * bf16: autocast to bfloat16 (CPU or CUDA), no scaling needed.
    * fp16 + ``loss_scale: dynamic``: ``torch.amp.GradScaler`` with the defaults in docs/training.md
      (initial 65536, growth interval 2000, factor 2, backoff 0.5).
    * fp16 + a number: a static ``loss_scale`` (e.g. 8192).
    Non-finite gradients are detected by the loop after :meth:`unscale`, the step is skipped,
    and :meth:`skip` lets the dynamic scaler back off.
    """

    def __init__(self, cfg: Config, device: torch.device) -> None:
        mp = cfg.mixed_precision
        self.device = device
        # auto: autocast on CUDA only; a CPU without native bfloat16 emulates it, several
        # times slower than fp32 (docs/training.md, "Mixed precision")
        enabled = mp.enabled if isinstance(mp.enabled, bool) else device.type == "cuda"
        self.enabled = enabled
        dtype = mp.dtype if mp.dtype != "auto" else ("fp16" if device.type == "cuda" else "bf16")
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
        self.name = dtype if enabled else "fp32"
        self.static_scale: float | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._probe: torch.optim.Optimizer | None = None  # see _agreed_update
        self.description = f"precision: {self.name}" + (
            f" autocast on {device.type}" if enabled else ""
        )
        if mp.enabled == "auto" and not enabled:
            self.description += " (mixed_precision.enabled=auto: autocast on CUDA only)"
        if enabled and dtype == "bf16" and loss_scale_value(cfg) is not None:
            self.description += f"; loss_scale {mp.loss_scale} unused (bf16 needs no loss scaling)"
        if enabled and dtype == "fp16":
            static = loss_scale_value(cfg)
            if static is None:
                self.scaler = torch.amp.GradScaler(
                    device.type,
                    init_scale=mp.init_scale,
                    growth_factor=mp.growth_factor,
                    backoff_factor=mp.backoff_factor,
                    growth_interval=mp.growth_interval,
                )
                self.description += f"; dynamic loss scale from {mp.init_scale:g} (growth ×{mp.growth_factor:g} every {mp.growth_interval} steps)"
            else:
                self.static_scale = static
                self.description += f"; static loss scale {static:g}"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        elif self.static_scale is not None:
            (loss * self.static_scale).backward()  # type: ignore[no-untyped-call]
        else:
            loss.backward()  # type: ignore[no-untyped-call]

    def unscale(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        elif self.static_scale is not None:
            inv = 1.0 / self.static_scale
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(inv)

    def step(self, optimizer: torch.optim.Optimizer, *, agreed: bool = False) -> None:
        """The optimizer step and the dynamic scale's update. ``agreed``: the optimizer
        unscaled and checked the gradients itself (``DistributedROOT.sync_grads`` with
        :meth:`inv_scale`), every rank found them finite."""
        if agreed:
            optimizer.step()
            self._agreed_update(found_inf=False)
        elif self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def skip(self, *, agreed: bool = False) -> None:
        """A step with non-finite gradients: not applied; the dynamic scale backs off."""
        if agreed:
            self._agreed_update(found_inf=True)
        elif self.scaler is not None:
            self.scaler.update()

    def inv_scale(self) -> float | None:
        """1 / the loss scale, or None without one: what ``DistributedROOT.sync_grads``
        multiplies the synchronised gradients by (instead of :meth:`unscale` on ``p.grad``,
        which the reduce-scatter started in backward has already read)."""
        if self.scaler is not None:
            return 1.0 / float(self.scaler.get_scale())
        if self.static_scale is not None:
            return 1.0 / self.static_scale
        return None

    def _agreed_update(self, found_inf: bool) -> None:
        """``GradScaler.update`` with the outcome every rank agreed on. The scaler learns
        it through its own ``unscale_`` of a one-element probe whose gradient is inf when
        a gradient was non-finite on any rank (the real gradients were unscaled and
        checked in the optimizer's step, on the parts each rank owns)."""
        if self.scaler is None:
            return
        if self._probe is None:
            probe = torch.zeros(1, device=self.device, requires_grad=True)
            self._probe = torch.optim.SGD([probe], lr=0.0)
        probe = self._probe.param_groups[0]["params"][0]
        probe.grad = torch.full_like(probe, math.inf if found_inf else 0.0)
        self.scaler.unscale_(self._probe)
        self.scaler.update()

    @property
    def scale(self) -> float:
        if self.scaler is not None:
            return float(self.scaler.get_scale())
        return self.static_scale or 1.0

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
