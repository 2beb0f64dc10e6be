"""The loop: loss falls, resume is bit-identical, non-finite steps are skipped and counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _train_fixtures import TINY, final_params, prepare_tiny
from rootopt.config import load_config
from rootopt.distributed import CollectiveTimeoutError
from rootopt.monitor import read_jsonl
from rootopt.train import Hooks, train
from rootopt.train.main import main as train_main

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _quiet(msg: str) -> None:
    pass


def _same_params(a: dict[str, object], b: dict[str, object]) -> bool:
    ma, mb = a["model"], b["model"]
    assert isinstance(ma, dict) and isinstance(mb, dict)
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_tiny_run_loss_decreases_and_leaves_evidence(shards: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            *TINY,
            "run.max_steps=60",
            "monitoring.plot=true",
            "monitoring.tensorboard=true",
            "monitoring.histogram_every=30",
        ],
    )
    s = train(cfg, tmp_path / "run", str(shards), say=_quiet)
    assert s.status == "completed" and s.steps == 60 and s.nonfinite_steps == 0
    assert s.final_loss < s.initial_loss - 1.0, (s.initial_loss, s.final_loss)
    assert s.val_loss < 5.0
    for name in (
        "config.yaml",
        "env.json",
        "metrics.jsonl",
        "events.jsonl",
        "loss_curve.png",
        "summary.json",
        "routing.txt",
    ):
        assert (tmp_path / "run" / name).is_file(), name
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    last = [r for r in rows if "loss" in r][-1]
    for key in (
        "lr",
        "grad_norm",
        "steps_per_s",
        "tokens_per_s",
        "update_ratio_median",
        "root_clip_fraction",
        "root_eps_mean",
        "grad_abs_max",
    ):
        assert key in last, key
    assert any("val_loss" in r for r in rows)
    state = final_params(tmp_path / "run")
    assert (
        state["config"]["optimization"]["optimizer"] == "ROOT"
    )  # resolved config in every checkpoint


@pytest.mark.parametrize("precision", ["mixed_precision.dtype=bf16", "mixed_precision.dtype=fp16"])
def test_interrupted_then_resumed_equals_uninterrupted(
    shards: Path, tmp_path: Path, precision: str
) -> None:
    over = [
        *TINY,
        "run.max_steps=30",
        "checkpoint.every=1000",
        "mixed_precision.enabled=true",
        precision,
        "optimization.clip.mode=adaptive",
        "mixed_precision.growth_interval=5",
    ]
    train(load_config(None, over), tmp_path / "whole", str(shards), say=_quiet)
    # Stop at step 13 through the signal path (checkpoint, then stop), then rerun the same command.
    part = train(
        load_config(None, over),
        tmp_path / "split",
        str(shards),
        say=_quiet,
        hooks=Hooks(after_step=lambda step: step == 13),
    )
    assert part.status == "interrupted" and part.steps == 13
    rest = train(load_config(None, over), tmp_path / "split", str(shards), say=_quiet)
    assert rest.resumed_from == "ckpt-00000013.pt" and rest.steps == 30
    a, b = final_params(tmp_path / "whole"), final_params(tmp_path / "split")
    assert _same_params(a, b)
    assert a["state"]["batches"] == b["state"]["batches"]


def test_nan_gradient_is_skipped_and_counted(shards: Path, tmp_path: Path) -> None:
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def inject(step: int, model: torch.nn.Module) -> None:
        if step in (4, 9):
            p = next(model.parameters())
            assert p.grad is not None
            p.grad.view(-1)[0] = float("nan")
            seen[step] = {n: q.detach().clone() for n, q in model.named_parameters()}

    cfg = load_config(None, [*TINY, "run.max_steps=12"])
    s = train(cfg, tmp_path / "run", str(shards), say=_quiet, hooks=Hooks(after_backward=inject))
    assert s.nonfinite_steps == 2 and s.status == "completed"
    events = [
        e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "nonfinite_step"
    ]
    assert [e["step"] for e in events] == [5, 10]
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "nonfinite_steps" in r]
    assert rows[-1]["nonfinite_steps"] == 2
    state = final_params(tmp_path / "run")["model"]
    assert isinstance(state, dict)
    assert all(torch.isfinite(v).all() for v in state.values())


def test_nan_skip_leaves_parameters_untouched(shards: Path, tmp_path: Path) -> None:
    snapshots: list[dict[str, torch.Tensor]] = []
    model_ref: list[torch.nn.Module] = []

    def inject(step: int, model: torch.nn.Module) -> None:
        if step == 3:
            model_ref.append(model)
            snapshots.append({n: q.detach().clone() for n, q in model.named_parameters()})
            for q in model.parameters():
                if q.grad is not None:
                    q.grad.fill_(float("inf"))

    def after(step: int) -> bool:
        return step == 4  # stop right after the skipped step (step numbers count completed steps)

    cfg = load_config(None, [*TINY, "run.max_steps=12"])
    train(
        cfg,
        tmp_path / "run",
        str(shards),
        say=_quiet,
        hooks=Hooks(after_backward=inject, after_step=after),
    )
    params = dict(model_ref[0].named_parameters())
    assert all(torch.equal(params[n], v) for n, v in snapshots[0].items())


@pytest.mark.parametrize("scale", ["dynamic", "1024"])
def test_fp16_loss_scaling_on_cpu(shards: Path, tmp_path: Path, scale: str) -> None:
    cfg = load_config(
        None,
        [
            *TINY,
            "run.max_steps=12",
            "mixed_precision.enabled=true",
            "mixed_precision.dtype=fp16",
            f"mixed_precision.loss_scale={scale}",
        ],
    )
    s = train(cfg, tmp_path / "run", str(shards), say=_quiet)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss_scale" in r]
    expected = 65536.0 if scale == "dynamic" else 1024.0
    assert rows[0]["loss_scale"] <= expected and s.final_loss < s.initial_loss


@pytest.mark.parametrize("opt", ["AdamW", "Muon"])
def test_other_optimizers_and_options(shards: Path, tmp_path: Path, opt: str) -> None:
    cfg = load_config(
        None,
        [
            *TINY,
            "run.max_steps=10",
            f"optimization.optimizer={opt}",
            "optimization.grad_accum_steps=2",
            "optimization.schedule=linear",
            "model.activation_checkpointing=true",
            "optimization.clip.mode=value",
        ],
    )
    s = train(cfg, tmp_path / "run", str(shards), say=_quiet)
    assert s.steps == 10 and s.final_loss < s.initial_loss


def test_classifier_on_digits(tmp_path: Path) -> None:
    from rootopt.data import prepare

    prepare("digits", tmp_path / "digits", samples_per_shard=400, val_fraction=0.1)
    cfg = load_config(
        None,
        [
            "model.kind=mlp",
            "model.mlp_hidden=64",
            "data.batch_size=32",
            "run.max_steps=100",
            "optimization.base_lr=3e-2",
            "run.eval_every=0",
            "run.eval_batches=10",
            "monitoring.progress_bar=false",
            "monitoring.tensorboard=false",
            "monitoring.plot=false",
            "optimization.warmup_steps=5",
        ],
    )
    s = train(cfg, tmp_path / "run", str(tmp_path / "digits"), say=_quiet)
    val = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "val_accuracy" in r]
    assert val[-1]["val_accuracy"] > 0.8, val
    assert s.final_loss < s.initial_loss


def test_corrupt_newest_checkpoint_is_skipped_on_resume(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    over = [*TINY, "run.max_steps=20", "checkpoint.every=5", "checkpoint.keep_last=5"]
    run = tmp_path / "run"
    train(
        load_config(None, over),
        run,
        str(shards),
        say=_quiet,
        hooks=Hooks(after_step=lambda s: s == 12),
    )
    newest = run / "checkpoints" / "ckpt-00000012.pt"
    blob = bytearray(newest.read_bytes())
    blob[-50] ^= 0x01
    newest.write_bytes(bytes(blob))
    lines: list[str] = []
    s = train(load_config(None, over), run, str(shards), say=lines.append)
    assert s.resumed_from == "ckpt-00000010.pt" and s.steps == 20
    assert any(
        "skipping invalid checkpoint: ckpt-00000012.pt: sha256 mismatch" in line for line in lines
    )
    events = read_jsonl(run / "events.jsonl")
    assert any(e["event"] == "checkpoint_invalid" for e in events)


def test_max_time_checkpoints_and_continues(shards: Path, tmp_path: Path) -> None:
    over = [*TINY, "run.max_steps=400", "run.max_time=0.5"]
    s = train(load_config(None, over), tmp_path / "run", str(shards), say=_quiet)
    assert s.status == "max_time" and 0 < s.steps < 400
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{s.steps:08d}.pt").is_file()
    again = train(load_config(None, over), tmp_path / "run", str(shards), say=_quiet)
    assert again.resumed_from == f"ckpt-{s.steps:08d}.pt" and again.steps > s.steps


def test_killed_process_restarts_bit_identically(shards: Path, tmp_path: Path) -> None:
    """SIGKILL a real training process mid-run; the rerun resumes from the last periodic checkpoint."""
    over = [*TINY, "run.max_steps=60", "checkpoint.every=10", "run.eval_every=0"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "rootopt.train", "--data_path", str(shards)]
    subprocess.run(
        [*cmd, "--log_dir", str(tmp_path / "whole"), *over],
        env=env,
        check=True,
        capture_output=True,
    )
    victim = subprocess.Popen(
        [*cmd, "--log_dir", str(tmp_path / "split"), *over],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    ckpts = tmp_path / "split" / "checkpoints"
    while time.time() < deadline and not list(ckpts.glob("ckpt-*.json")) and victim.poll() is None:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = sorted(ckpts.glob("ckpt-*.json"))
    assert killed_at, "the process finished before its first checkpoint"
    done = subprocess.run(
        [*cmd, "--log_dir", str(tmp_path / "split"), *over],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "resumed from" in done.stdout
    assert _same_params(final_params(tmp_path / "whole"), final_params(tmp_path / "split"))
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["steps"] == 60


def test_sigterm_checkpoints_then_exits(shards: Path, tmp_path: Path) -> None:
    over = [*TINY, "run.max_steps=100000", "run.eval_every=0"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rootopt.train",
            "--data_path",
            str(shards),
            "--log_dir",
            str(tmp_path / "run"),
            *over,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.stat().st_size > 0):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by signal after a checkpoint" in out
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))


def test_bad_data_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--data_path", str(tmp_path), "--log_dir", str(tmp_path / "r"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no manifest.json" in err[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale", ["dynamic", "8192"])
def test_cuda_fp16_autocast(shards: Path, tmp_path: Path, scale: str) -> None:
    cfg = load_config(
        None,
        [
            *TINY,
            "run.max_steps=20",
            "run.device=cuda",
            "mixed_precision.enabled=true",
            f"mixed_precision.loss_scale={scale}",
        ],
    )
    s = train(cfg, tmp_path / "run", str(shards), say=_quiet)
    assert s.final_loss < s.initial_loss and s.nonfinite_steps == 0


def test_resume_with_a_different_model_is_refused(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert (
        train_main(["--data_path", str(shards), "--log_dir", str(run), *TINY, "run.max_steps=5"])
        == 0
    )
    capsys.readouterr()
    assert (
        train_main(
            [
                "--data_path",
                str(shards),
                "--log_dir",
                str(run),
                *TINY,
                "run.max_steps=10",
                "model.d_model=64",
            ]
        )
        == 2  # a user error: the config does not fit the run's checkpoint
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "model.d_model: 32 → 64" in err[0]
        and "checkpoint.resume=restart" in err[0]
    )


@pytest.mark.slow
def test_embedded_default_main_job(tmp_path: Path) -> None:
    """The README's main job: `rootopt train` with no config, within 5 minutes on a 2-core CPU."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "rootopt.cli", "train", "--log_dir", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.time() - t0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 300
    assert summary["final_loss"] < summary["initial_loss"] - 2.0
    assert (
        tmp_path / "run" / "loss_curve.png"
    ).is_file() and "300/300" in done.stderr  # progress bar
    assert wall < 300, wall


def test_deployment_example_config_trains_on_one_cpu_process(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = Path(__file__).resolve().parents[1] / "configs" / "deployment_example.yaml"
    tiny = [o for o in TINY if not o.startswith("optimization.warmup_steps")]
    rc = train_main(
        [
            "--config",
            str(example),
            "--data_path",
            str(shards),
            "--log_dir",
            str(tmp_path / "run"),
            "distributed.world_size=1",
            *tiny,
            "run.max_steps=10",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    on_cuda = torch.cuda.is_available()
    on_cpu = "precision: fp32 (mixed_precision.enabled=auto: autocast on CUDA only)"
    assert ("static loss scale 8192" in out) if on_cuda else (on_cpu in out)
    saved = final_params(tmp_path / "run")["config"]
    assert isinstance(saved, dict) and saved["optimization"]["base_lr"] == 5e-4
    assert saved["optimization"]["warmup_steps"] == 30 and saved["optimization"]["beta2"] == 0.98
    assert saved["mixed_precision"]["enabled"] == "auto"


@pytest.mark.parametrize(
    ("error", "symptom", "fix"),
    [
        (torch.OutOfMemoryError("CUDA out of memory"), "oom", "activation_checkpointing"),
        (
            CollectiveTimeoutError(
                "rank 0/2: collective 'all_reduce step loss' did not complete within 3 s "
                "(distributed.timeout_s); a peer rank is hung or has died"
            ),
            "timeout",
            "NCCL",
        ),
    ],
)
def test_oom_and_timeout_are_recorded_for_the_report(
    shards: Path, tmp_path: Path, error: Exception, symptom: str, fix: str
) -> None:
    from rootopt.monitor.report import check_run
    from rootopt.train import TrainingError

    def fail(step: int, model: torch.nn.Module) -> None:
        if step == 7:
            raise error

    with pytest.raises(TrainingError, match="at step 8"):
        train(
            load_config(None, [*TINY, "run.max_steps=20"]),
            tmp_path / "run",
            str(shards),
            say=_quiet,
            hooks=Hooks(after_backward=fail),
        )
    rep = check_run(tmp_path / "run")
    assert symptom in rep.symptoms and fix in rep.render()


def test_extending_max_steps_uses_the_new_schedule(shards: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(
        load_config(None, [*TINY, "run.max_steps=10", "run.log_every=1"]),
        run,
        str(shards),
        say=_quiet,
    )
    s = train(
        load_config(None, [*TINY, "run.max_steps=20", "run.log_every=1"]),
        run,
        str(shards),
        say=_quiet,
    )
    assert s.resumed_from == "ckpt-00000010.pt" and s.steps == 20
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r}
    base = 6e-3
    # The old 10-step schedule would sit at its floor (0.1·base) from step 11 on.
    assert lrs[13] > 0.5 * base
    assert lrs[20] < 0.15 * base
