"""Train a controller policy with RecurrentPPO, save it with provenance, and evaluate it.

``train_policy`` runs ``sb3-contrib``'s ``RecurrentPPO`` (``MlpLstmPolicy``: an LSTM shared
by the actor and a value head) on :class:`~rootopt.rl.env.RootTrainingEnv`. ``evaluate``
runs held-out tasks with the controller and with plain ROOT (tuned lr, cosine schedule) on
the same seeds and reports final validation loss and the controller's time per step.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rootopt.rl.controller import (
    ACT_DIM,
    DEFAULT_Q,
    FORMAT,
    OBS_DIM,
    POLICY_FILE,
    PROVENANCE_FILE,
    Controller,
    load_policy,
)
from rootopt.rl.env import Episode, EpisodeConfig, RootTrainingEnv


@dataclass(frozen=True)
class PPOConfig:
    timesteps: int = 1200  # environment steps (= decisions) in total
    n_steps: int = 60  # rollout length per PPO update
    batch_size: int = 30
    n_epochs: int = 4
    learning_rate: float = 3e-3
    gamma: float = 0.99
    lstm_hidden: int = 32
    seed: int = 0


def _versions() -> dict[str, str]:
    import gymnasium
    import sb3_contrib
    import stable_baselines3

    from rootopt import __version__

    return {
        "rootopt": __version__,
        "torch": torch.__version__,
        "stable_baselines3": stable_baselines3.__version__,
        "sb3_contrib": sb3_contrib.__version__,
        "gymnasium": gymnasium.__version__,
        "python": platform.python_version(),
    }


def train_policy(
    episode: EpisodeConfig, ppo: PPOConfig, out: Path | None = None
) -> tuple[Any, RootTrainingEnv, dict[str, Any]]:
    """Train; returns ``(model, env, provenance)``. With ``out``, saves the policy directory.

    ``out`` must not exist yet (or be an empty directory): nothing a user owns is overwritten.
    """
    from sb3_contrib import RecurrentPPO

    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{str(out)!r} exists and is not an empty directory")
    torch.manual_seed(ppo.seed)
    env = RootTrainingEnv(episode)
    model = RecurrentPPO(
        "MlpLstmPolicy",
        env,
        n_steps=ppo.n_steps,
        batch_size=ppo.batch_size,
        n_epochs=ppo.n_epochs,
        learning_rate=ppo.learning_rate,
        gamma=ppo.gamma,
        seed=ppo.seed,
        device="cpu",
        policy_kwargs={"lstm_hidden_size": ppo.lstm_hidden, "net_arch": [32]},
        verbose=0,
    )
    t0 = time.perf_counter()
    model.learn(total_timesteps=ppo.timesteps)
    prov: dict[str, Any] = {
        "format": FORMAT,
        "obs_dim": OBS_DIM,
        "act_dim": ACT_DIM,
        "every": episode.every,
        "default_quantile": DEFAULT_Q,
        "episode": asdict(episode),
        "ppo": asdict(ppo),
        "seed": ppo.seed,
        "task_distribution": list(episode.tasks),
        "episodes": env.episodes,
        "episode_returns": env.returns,
        "train_seconds": time.perf_counter() - t0,
        "versions": _versions(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        model.save(str(out / POLICY_FILE))
        (out / PROVENANCE_FILE).write_text(json.dumps(prov, indent=1) + "\n", encoding="utf-8")
    return model, env, prov


def run_episode(
    task: str, seed: int, cfg: EpisodeConfig, policy_dir: Path | None
) -> dict[str, Any]:
    """One run: plain ROOT (``policy_dir`` None) or ROOT driven by the saved controller."""
    ep = Episode(task, seed, cfg)
    ctl = None
    if policy_dir is not None:
        policy, prov = load_policy(policy_dir)
        ctl = Controller(policy, prov, total_steps=cfg.steps)
    init_loss, _ = ep.sampler.evaluate(ep.model)
    t_step = 0.0
    mults: list[float] = []
    diverged = False
    # The same per-step path as a training run with optimization.controller set.
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = ep.sampler.batch(ep.gen)
        loss = ep.sampler.loss(ep.model(x), y)
        ep.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        gn = float(torch.nn.utils.clip_grad_norm_(ep.params, cfg.clip))
        lv = float(loss.detach())
        if not np.isfinite(lv):
            diverged = True
            break
        ep.opt.telemetry_enabled = ctl is not None and ctl.wants_telemetry  # type: ignore[attr-defined]
        ep.opt.step()
        ep.sched.step()
        if ctl is not None:
            ctl.after_step(ep.opt, lv, gn)
            mults.append(ctl.mult)
        t_step += time.perf_counter() - t0
    val, acc = ep.sampler.evaluate(ep.model)
    return {
        "task": task,
        "seed": seed,
        "controller": policy_dir is not None,
        "initial_val_loss": init_loss,
        "final_val_loss": float("nan") if diverged else val,
        "final_val_acc": acc,
        "diverged": diverged,
        "step_s": t_step / cfg.steps,
        "controller_s_per_step": (ctl.seconds / cfg.steps) if ctl else 0.0,
        "mean_lr_mult": float(np.mean(mults)) if mults else 1.0,
    }


def evaluate(
    policy_dir: Path, tasks: list[str], seeds: list[int], cfg: EpisodeConfig
) -> list[dict[str, Any]]:
    load_policy(policy_dir)  # fail fast on a bad policy
    rows = []
    for task in tasks:
        for seed in seeds:
            for pol in (None, policy_dir):
                rows.append(run_episode(task, seed, cfg, pol))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per task, mean ± std final val loss (and accuracy) of ROOT vs controller."""
    lines = [
        "| task | ROOT (tuned cosine) val loss | ROOT + controller val loss | Δ (ctl − ROOT) | "
        "ROOT acc | ctl acc | ctl mean lr× | step ms ROOT / ctl | controller ms/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task in dict.fromkeys(r["task"] for r in rows):
        base = [r for r in rows if r["task"] == task and not r["controller"]]
        ctl = [r for r in rows if r["task"] == task and r["controller"]]
        if len(base) != len(ctl):
            raise ValueError(f"{task}: {len(base)} baseline runs vs {len(ctl)} controller runs")

        def ms(rs: list[dict[str, Any]], key: str) -> str:
            v = np.array([r[key] for r in rs if r[key] is not None], dtype=float)
            return f"{v.mean():.4f} ± {v.std():.4f}" if len(v) else "—"

        diff = np.array([c["final_val_loss"] - b["final_val_loss"] for b, c in zip(base, ctl)])
        lines.append(
            f"| {task} (n={len(base)}) | {ms(base, 'final_val_loss')} | {ms(ctl, 'final_val_loss')} | "
            f"{diff.mean():+.4f} | {ms(base, 'final_val_acc')} | {ms(ctl, 'final_val_acc')} | "
            f"{np.mean([r['mean_lr_mult'] for r in ctl]):.2f} | "
            f"{1e3 * np.mean([r['step_s'] for r in base]):.1f} / "
            f"{1e3 * np.mean([r['step_s'] for r in ctl]):.1f} | "
            f"{1e3 * np.mean([r['controller_s_per_step'] for r in ctl]):.2f} |"
        )
    return "\n".join(lines)
