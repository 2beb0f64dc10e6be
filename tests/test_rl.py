"""The learned ROOT controller: RecurrentPPO improves its reward; a saved policy drives a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sb3_contrib")
pytest.importorskip("gymnasium")

import numpy as np
import torch

from _train_fixtures import TINY, prepare_tiny
from rootopt.config import ConfigError, load_config
from rootopt.rl.controller import (
    PROVENANCE_FILE,
    Controller,
    action_to_knobs,
    knobs_to_action,
)
from rootopt.rl.env import EpisodeConfig, RootTrainingEnv
from rootopt.rl.train import PPOConfig, train_policy
from rootopt.train import train
from rootopt.train.schedule import LRMultiplier

SRC = Path(__file__).resolve().parents[1] / "src"
# The toy task with a base lr 10× too small: raising the lr multiplier clearly pays.
TOY = EpisodeConfig(tasks=("toy",), steps=20, every=4, base_lr=0.003)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("policy") / "p"
    _, _env, prov = train_policy(TOY, PPOConfig(timesteps=600, n_steps=40, batch_size=20), out)
    return out, prov


def test_knob_mapping_round_trips_and_clips() -> None:
    for mult, q in [(1.0, 0.9), (0.25, 0.5), (4.0, 0.99), (2.0, 0.7)]:
        m2, q2 = action_to_knobs(knobs_to_action(mult, q))
        assert m2 == pytest.approx(mult, rel=1e-5) and q2 == pytest.approx(q, abs=1e-6)
    assert action_to_knobs(np.array([9.0, -9.0])) == pytest.approx((4.0, 0.5))


def test_env_default_action_is_plain_root_and_returns_telescope() -> None:
    env = RootTrainingEnv(TOY)
    obs, info = env.reset(seed=3)
    assert obs.shape == env.observation_space.shape and info["task"] == "toy"
    rewards, losses, done = [], [], False
    first = env.episode.observer.first["loss"]  # type: ignore[union-attr]
    while not done:
        obs, r, done, trunc, info = env.step(knobs_to_action(1.0, 0.9))
        rewards.append(r)
        losses.append(info["loss"])
        assert env.observation_space.contains(obs) and not trunc
    assert len(rewards) == TOY.steps // TOY.every - 1
    # Σ rewards = log(L_first_block / L_last_block)
    assert sum(rewards) == pytest.approx(np.log(first) - np.log(losses[-1]), rel=1e-6)
    assert env.returns == [pytest.approx(sum(rewards))]


def test_policy_training_improves_reward(trained: tuple[Path, dict[str, object]]) -> None:
    _, prov = trained
    r = prov["episode_returns"]
    assert isinstance(r, list) and len(r) >= 100
    first, last = float(np.mean(r[:20])), float(np.mean(r[-20:]))
    assert last > first + 0.05, (first, last)


def test_policy_saved_with_provenance(trained: tuple[Path, dict[str, object]]) -> None:
    out, _ = trained
    prov = json.loads((out / PROVENANCE_FILE).read_text())
    assert prov["task_distribution"] == ["toy"] and prov["seed"] == 0
    assert prov["episode"]["base_lr"] == 0.003 and prov["ppo"]["timesteps"] == 600
    assert {"torch", "stable_baselines3", "sb3_contrib", "gymnasium"} <= set(prov["versions"])
    ctl = Controller.load(out, total_steps=20)
    assert ctl.every == 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def test_training_config_uses_controller(
    trained: tuple[Path, dict[str, object]], shards: Path, tmp_path: Path
) -> None:
    out, _ = trained
    cfg = load_config(
        None, [*TINY, "run.max_steps=24", "run.log_every=1", f"optimization.controller={out}"]
    )
    s = train(cfg, tmp_path / "run", str(shards), say=lambda m: None)
    assert s.status == "completed" and s.steps == 24
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    o = cfg.optimization
    sched = LRMultiplier(o.schedule, warmup=o.warmup_steps, total=24, min_ratio=o.min_lr_ratio)
    ratios = [
        lrs[k] / (o.base_lr * sched(k - 1)) for k in sorted(lrs) if k > 4 and sched(k - 1) > 0
    ]
    assert ratios, lrs
    # The controller multiplies the scheduled lr by a value in [1/4, 4] that it chose (≠ 1).
    assert all(0.25 - 1e-6 <= x <= 4 + 1e-6 for x in ratios)
    assert any(abs(x - 1.0) > 1e-3 for x in ratios), ratios


def _write(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


@pytest.mark.parametrize("case", ["missing", "format", "corrupt", "optimizer"])
def test_bad_policy_refused_before_run_starts(
    case: str, trained: tuple[Path, dict[str, object]], shards: Path, tmp_path: Path
) -> None:
    good, _ = trained
    policy = tmp_path / "pol"
    extra: list[str] = []
    if case == "format":
        _write(policy / "provenance.json", json.dumps({"format": 999}))
        _write(policy / "policy.zip", "x")
    elif case == "corrupt":
        _write(policy / "provenance.json", (good / PROVENANCE_FILE).read_text())
        _write(policy / "policy.zip", "not a zip")
    elif case == "optimizer":
        policy = good
        extra = ["optimization.optimizer=AdamW"]
    cfg = load_config(None, [*TINY, f"optimization.controller={policy}", *extra])
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run", str(shards), say=lambda m: None)
    msg = str(err.value)
    assert "\n" not in msg and "optimization.controller" in msg
    expect = {
        "missing": "not found",
        "format": "incompatible",
        "corrupt": "could not be loaded",
        "optimizer": "needs optimization.optimizer ROOT",
    }[case]
    assert expect in msg, msg
    assert not (tmp_path / "run").exists()  # nothing half-configured left behind


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rootopt.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


def test_cli_bad_inputs_exit_2_one_line(tmp_path: Path) -> None:
    r = _cli("rl", "eval", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    owned = tmp_path / "mine"
    _write(owned / "notes.txt", "keep me")
    r = _cli("rl", "train", "--out", str(owned), "--timesteps", "10")
    assert r.returncode == 2 and "not an empty directory" in r.stderr
    assert (owned / "notes.txt").read_text() == "keep me" and len(list(owned.iterdir())) == 1
    r = _cli("rl", "train", "--out", str(tmp_path / "new"), "--tasks", "nosuch")
    assert r.returncode == 2 and "nosuch" in r.stderr


def test_example_config_names_a_controller() -> None:
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "controller-example.yaml")
    assert cfg.optimization.controller == "policies/root-ctl"
    assert cfg.optimization.optimizer == "ROOT"


def test_missing_rl_package_named(
    trained: tuple[Path, dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rootopt.rl.controller import ControllerError, load_policy

    out, _ = trained
    monkeypatch.setitem(sys.modules, "sb3_contrib", None)  # import now raises ModuleNotFoundError
    with pytest.raises(ControllerError, match=r"needs the 'sb3_contrib' package.*rootopt\[rl\]"):
        load_policy(out)
