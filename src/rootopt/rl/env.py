"""A short ROOT training run as a :mod:`gymnasium` environment.

One environment step = ``every`` optimizer steps with the knobs the action chose; one episode
= ``steps`` optimizer steps on a task drawn from the distribution. The base schedule is the
benchmark's tuned one (warmup for 10 % of the steps, cosine to 0.1 × base lr, global grad-norm
clip 1.0), so a multiplier of 1 and quantile 0.9 reproduce plain ROOT. Reward = decrease of the
block-mean log training loss, so an episode's return is ``log(L_first / L_last)``; a
non-finite loss ends the episode with reward ``-DIVERGED_PENALTY``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rootopt.rl.controller import (
    ACT_DIM,
    DEFAULT_Q,
    OBS_DIM,
    Observer,
    action_to_knobs,
    apply_knobs,
    telemetry_summary,
)
from rootopt.rl.tasks import Sampler, episode_task

DIVERGED_PENALTY = 5.0


@dataclass(frozen=True)
class EpisodeConfig:
    tasks: tuple[str, ...]
    steps: int = 60
    every: int = 6
    base_lr: float = 0.03  # ROOT's tuned lr on every benchmark task (docs/benchmarks.md)
    weight_decay: float = 0.1
    clip: float = 1.0


class Episode:
    """One training run driven block by block (used by the env and by the evaluation)."""

    def __init__(self, task: str, seed: int, cfg: EpisodeConfig) -> None:
        from rootopt.optim.registry import make_optimizer
        from rootopt.train.schedule import LRMultiplier

        self.cfg = cfg
        self.sampler = Sampler(episode_task(task))
        torch.manual_seed(seed)
        self.model = self.sampler.t.model()
        self.opt, _ = make_optimizer(
            "root", self.model, lr=cfg.base_lr, weight_decay=cfg.weight_decay, telemetry=False
        )
        warm = max(1, cfg.steps // 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, LRMultiplier("cosine", warmup=warm, total=cfg.steps, min_ratio=0.1)
        )
        self.gen = torch.Generator().manual_seed(10_000 + seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.observer = Observer(total_steps=cfg.steps)
        self.step = 0
        self.mult, self.q = 1.0, DEFAULT_Q
        apply_knobs(self.opt, self.mult, self.q)

    def run_block(self, mult: float, q: float) -> tuple[np.ndarray, float, float]:
        """``every`` steps with the given knobs: ``(observation, block loss, previous loss)``."""
        self.mult, self.q = mult, q
        # The scheduler's lr for this step, times the multiplier.
        for g, lr in zip(self.opt.param_groups, self.sched.get_last_lr(), strict=True):
            g["lr"] = lr
        apply_knobs(self.opt, mult, q)
        for i in range(self.cfg.every):
            if self.step >= self.cfg.steps:
                break
            x, y = self.sampler.batch(self.gen)
            loss = self.sampler.loss(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            gn = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip))
            lv = float(loss.detach())
            self.observer.record(lv, gn)
            if not (math.isfinite(lv) and math.isfinite(gn)):
                break
            self.opt.telemetry_enabled = i == self.cfg.every - 1  # type: ignore[attr-defined]
            self.opt.step()
            if self.opt.telemetry_enabled:  # type: ignore[attr-defined]
                self.observer.tel = telemetry_summary(self.opt.telemetry)  # type: ignore[attr-defined]
            self.sched.step()
            apply_knobs(self.opt, mult, q)
            self.step += 1
        return self.observer.block(self.step, mult, q)

    @property
    def done(self) -> bool:
        return self.step >= self.cfg.steps


class RootTrainingEnv(gym.Env[np.ndarray, np.ndarray]):
    """Gymnasium env over episodes of :class:`Episode`; tasks cycle through ``cfg.tasks``.

    ``reset(seed=...)`` seeds the task draw and the runs' seeds; the first block of every
    episode runs with the default knobs (lr ×1, quantile 0.9) to produce the first observation.
    """

    def __init__(self, cfg: EpisodeConfig) -> None:
        super().__init__()
        if not cfg.tasks:
            raise ValueError("RootTrainingEnv needs at least one task")
        for t in cfg.tasks:
            episode_task(t)  # validate names up front
        self.cfg = cfg
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (OBS_DIM,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (ACT_DIM,), np.float32)
        self.episode: Episode | None = None
        self.episodes = 0
        self.returns: list[float] = []
        self._ret = 0.0
        self._seed = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._seed = seed
        task = self.cfg.tasks[int(self.np_random.integers(len(self.cfg.tasks)))]
        run_seed = self._seed * 100_003 + self.episodes
        self.episodes += 1
        self.episode = Episode(task, run_seed, self.cfg)
        obs, _, _ = self.episode.run_block(1.0, DEFAULT_Q)
        self._ret = 0.0
        return obs, {"task": task}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.episode is not None, "call reset() first"
        mult, q = action_to_knobs(action)
        obs, loss, prev = self.episode.run_block(mult, q)
        if not math.isfinite(loss):
            reward, done = -DIVERGED_PENALTY, True
        else:
            reward = math.log(max(prev, 1e-12)) - math.log(max(loss, 1e-12))
            done = self.episode.done
        self._ret += reward
        info: dict[str, Any] = {"loss": loss, "lr_mult": mult, "quantile": q}
        if done:
            self.returns.append(self._ret)
            info["episode_return"] = self._ret
        return obs, float(reward), done, False, info
