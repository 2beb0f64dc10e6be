"""Observations, actions and the saved policy of the learned ROOT controller.

This module is what a training run needs (``optimization.controller: PATH``): it reads a
policy directory (``policy.zip`` from stable-baselines3 + ``provenance.json``), and every
``K`` steps turns the run's statistics into an observation and the policy's action into an
lr multiplier and an outlier quantile on the optimizer's param groups. It does not import
the training loop, the benchmark tasks or the environment.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1  # bump when the observation or action meaning changes; old policies are refused
OBS_DIM = 9
ACT_DIM = 2
LR_MULT_RANGE = 4.0  # action a0 ∈ [-1, 1] ↦ lr multiplier 4^a0 ∈ [1/4, 4]
Q_LOW, Q_HIGH = 0.5, 0.99  # action a1 ∈ [-1, 1] ↦ outlier quantile in [0.5, 0.99]
DEFAULT_Q = 0.9
POLICY_FILE = "policy.zip"
PROVENANCE_FILE = "provenance.json"


class ControllerError(ValueError):
    """A policy that cannot be used (missing, incompatible, or its extra not installed)."""


def action_to_knobs(action: np.ndarray) -> tuple[float, float]:
    """``(lr multiplier, outlier quantile)`` of a policy action in ``[-1, 1]²`` (clipped)."""
    a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
    mult = float(LR_MULT_RANGE ** a[0])
    q = float(Q_LOW + (Q_HIGH - Q_LOW) * (a[1] + 1.0) / 2.0)
    return mult, q


def knobs_to_action(mult: float, q: float) -> np.ndarray:
    a0 = math.log(mult) / math.log(LR_MULT_RANGE)
    a1 = 2.0 * (q - Q_LOW) / (Q_HIGH - Q_LOW) - 1.0
    return np.array([a0, a1], dtype=np.float32)


def telemetry_summary(telemetry: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Mean clip fraction, threshold ε and update/parameter ratio over ROOT's matrices."""
    out: dict[str, float] = {}
    for key in ("clip_fraction", "eps", "update_param_ratio"):
        vals = [float(t[key]) for t in telemetry.values() if key in t]
        vals = [v for v in vals if math.isfinite(v)]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


@dataclass
class Observer:
    """Builds the observation vector from per-step losses/grad norms and block telemetry.

    Features (all O(1) to compute): progress ``t/T``; ``log(L/L₀)``; the block's log-loss trend;
    ``log(‖g‖/‖g‖₀)``; ROOT's clip fraction; ``log(ε/ε₀)``; ``log10`` of the update/parameter
    ratio (+3); the current lr multiplier as ``log₄``; the current quantile. ``L`` is the mean
    training loss of a block of ``K`` steps; the ``₀`` values are the first block's.
    """

    total_steps: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    first: dict[str, float] = field(default_factory=dict)
    prev_loss: float = float("nan")
    tel: dict[str, float] = field(default_factory=dict)

    def record(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def block(self, step: int, mult: float, q: float) -> tuple[np.ndarray, float, float]:
        """Close the current block: ``(observation, block loss, previous block loss)``."""
        finite = [v for v in self.losses if math.isfinite(v)]
        loss = sum(finite) / len(finite) if finite and len(finite) == len(self.losses) else math.inf
        gn = [v for v in self.grad_norms if math.isfinite(v)]
        grad = sum(gn) / len(gn) if gn else math.inf
        self.losses, self.grad_norms = [], []
        if not self.first:
            self.first = {"loss": loss, "grad": grad, "eps": self.tel.get("eps", float("nan"))}
            self.prev_loss = loss
        prev = self.prev_loss

        def log_ratio(a: float, b: float) -> float:
            if not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
                return 0.0
            return math.log(a / b)

        obs = np.array(
            [
                min(step / max(1, self.total_steps), 1.5),
                log_ratio(loss, self.first["loss"]),
                log_ratio(loss, prev),
                log_ratio(grad, self.first["grad"]),
                self.tel.get("clip_fraction", 0.0),
                log_ratio(self.tel.get("eps", float("nan")), self.first["eps"]),
                math.log10(max(self.tel.get("update_param_ratio", 1e-3), 1e-8)) + 3.0,
                math.log(mult) / math.log(LR_MULT_RANGE),
                q,
            ],
            dtype=np.float32,
        )
        self.prev_loss = loss
        return np.clip(np.nan_to_num(obs, nan=0.0, posinf=10.0, neginf=-10.0), -10, 10), loss, prev


def apply_knobs(optimizer: Any, mult: float, q: float) -> None:
    """Multiply each group's (scheduled) lr by ``mult``; set ROOT groups' outlier quantile.

    Called right after the lr scheduler set the scheduled lr, so the multiplier never compounds.
    Groups without a quantile (ROOT's AdamW groups, other optimizers) keep theirs untouched.
    """
    for g in optimizer.param_groups:
        g["lr"] = float(g["lr"]) * mult
        if g.get("outlier_quantile") is not None:
            g["outlier_quantile"] = q


def load_policy(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """``(RecurrentPPO model, provenance)`` from a policy directory, or one-line ControllerError."""
    p = Path(path)
    prov_file, pol_file = p / PROVENANCE_FILE, p / POLICY_FILE
    if not p.is_dir() or not prov_file.is_file() or not pol_file.is_file():
        raise ControllerError(
            f"controller policy {str(p)!r} not found (expected a directory with "
            f"{POLICY_FILE} and {PROVENANCE_FILE} written by 'rootopt rl train')"
        )
    try:
        prov = json.loads(prov_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ControllerError(
            f"controller policy {str(p)!r}: unreadable provenance: {exc}"
        ) from None
    if not isinstance(prov, dict) or prov.get("format") != FORMAT:
        raise ControllerError(
            f"controller policy {str(p)!r} is incompatible: format "
            f"{prov.get('format') if isinstance(prov, dict) else None!r}, this rootopt reads {FORMAT}"
        )
    if prov.get("obs_dim") != OBS_DIM or prov.get("act_dim") != ACT_DIM:
        raise ControllerError(
            f"controller policy {str(p)!r} is incompatible: observation/action sizes "
            f"{prov.get('obs_dim')}/{prov.get('act_dim')}, expected {OBS_DIM}/{ACT_DIM}"
        )
    try:
        from sb3_contrib import RecurrentPPO
    except ModuleNotFoundError as exc:
        raise ControllerError(
            f"controller policy needs the {exc.name!r} package; install with: pip install 'rootopt[rl]'"
        ) from None
    try:
        model = RecurrentPPO.load(str(pol_file), device="cpu")
    except Exception as exc:  # a corrupt or foreign zip: name it in one line
        raise ControllerError(
            f"controller policy {str(pol_file)!r} could not be loaded: {type(exc).__name__}: {exc}"
        ) from None
    shape = getattr(model.observation_space, "shape", None)
    if shape != (OBS_DIM,) or getattr(model.action_space, "shape", None) != (ACT_DIM,):
        raise ControllerError(
            f"controller policy {str(pol_file)!r} is incompatible: spaces {shape} / "
            f"{getattr(model.action_space, 'shape', None)}"
        )
    return model, prov


class Controller:
    """Runs a saved policy inside a training loop.

    Per optimizer step call :meth:`after_step` right after the lr scheduler's step. Every
    ``every`` steps it closes a block, asks the policy (deterministic action, recurrent state
    carried) for the next block's knobs; every step it re-applies the multiplier to the lr
    the scheduler just set. ``wants_telemetry`` is True on the last step of a block so the
    optimizer records ROOT telemetry only there. ``seconds`` accumulates the time spent here.
    """

    def __init__(self, policy: Any, provenance: dict[str, Any], *, total_steps: int) -> None:
        self.policy = policy
        self.provenance = provenance
        self.every = int(provenance.get("every", 5))
        self.observer = Observer(total_steps=total_steps)
        self.mult, self.q = 1.0, float(provenance.get("default_quantile", DEFAULT_Q))
        self.step = 0
        self.state: tuple[np.ndarray, ...] | None = None
        self.start = np.ones((1,), dtype=bool)
        self.seconds = 0.0
        self.decisions = 0
        self._tel_id: int | None = None

    @staticmethod
    def load(path: str | Path, *, total_steps: int) -> Controller:
        policy, prov = load_policy(path)
        return Controller(policy, prov, total_steps=total_steps)

    @property
    def wants_telemetry(self) -> bool:
        return (self.step + 1) % self.every == 0

    def after_step(self, optimizer: Any, loss: float, grad_norm: float) -> None:
        t0 = time.perf_counter()
        self.step += 1
        self.observer.record(loss, grad_norm)
        tel = getattr(optimizer, "telemetry", None)
        if isinstance(tel, dict) and tel and id(tel) != self._tel_id:  # a fresh record
            self._tel_id = id(tel)
            self.observer.tel = telemetry_summary(tel)
        if self.step % self.every == 0:
            obs, _, _ = self.observer.block(self.step, self.mult, self.q)
            action, self.state = self.policy.predict(
                obs[None], state=self.state, episode_start=self.start, deterministic=True
            )
            self.start = np.zeros((1,), dtype=bool)
            self.mult, self.q = action_to_knobs(action[0])
            self.decisions += 1
        apply_knobs(optimizer, self.mult, self.q)
        self.seconds += time.perf_counter() - t0

    def skipped_step(self, optimizer: Any) -> None:
        """A non-finite (skipped) step: keep the multiplier on the freshly scheduled lr."""
        apply_knobs(optimizer, self.mult, self.q)


def load_controller(path: str, *, total_steps: int, optimizer: str) -> Controller:
    """The controller of ``optimization.controller``, or a one-line ``ConfigError``.

    Called before a training run creates anything, so a bad policy never leaves a
    half-configured run behind.
    """
    from rootopt.config import ConfigError

    if optimizer.lower() not in ("root",):
        raise ConfigError(
            [f"optimization.controller needs optimization.optimizer ROOT (got {optimizer!r})"]
        )
    try:
        return Controller.load(path, total_steps=total_steps)
    except ControllerError as exc:
        raise ConfigError([f"optimization.controller: {exc}"]) from None
