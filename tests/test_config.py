"""Config: the deployment example loads as written, defaults round-trip, bad input is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rootopt.config import Config, ConfigError, dump_yaml, load_config, to_dict
from rootopt.train.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]


def test_deployment_example_yaml_loads_as_written() -> None:
    cfg = load_config(ROOT / "configs" / "deployment_example.yaml")
    assert cfg.distributed.backend == "nccl" and cfg.distributed.world_size == 8
    assert cfg.distributed.init_method == "env://" and cfg.distributed.rank == 0
    o = cfg.optimization
    assert o.optimizer == "ROOT" and o.base_lr == 5e-4 and o.warmup_steps == 30
    assert (o.beta1, o.beta2, o.epsilon) == (0.9, 0.98, 1e-8)
    # autocast on CUDA only (fp16 with the static scale there); fp32 on a CPU
    assert cfg.mixed_precision.enabled == "auto" and cfg.mixed_precision.loss_scale == "8192"


def test_default_yaml_is_the_embedded_default() -> None:
    assert to_dict(load_config(ROOT / "configs" / "default.yaml")) == to_dict(Config())


def test_resolved_config_round_trips() -> None:
    cfg = load_config(None, ["optimization.base_lr=1e-3", "optimization.clip.mode=adaptive"])
    again = load_config(None, [])
    assert to_dict(cfg) != to_dict(again)
    assert to_dict(load_config(None, [f"{k}" for k in []])) == to_dict(Config())
    data = yaml.safe_load(dump_yaml(cfg))
    assert (
        data["optimization"]["base_lr"] == 1e-3
        and data["optimization"]["clip"]["mode"] == "adaptive"
    )


BAD = [
    (["optimization.base_lr=-1"], "optimization.base_lr: must be > 0; got -1.0"),
    (["optimization.base_lr=fast"], "optimization.base_lr: expected a number; got 'fast'"),
    (["optimization.learning_rate=1e-3"], "optimization.learning_rate: unknown key"),
    (["nonsense.key=1"], "nonsense: unknown key"),
    (["run.max_steps=1.5"], "run.max_steps: expected an integer; got 1.5"),
    (["run.max_steps=0"], "run.max_steps: must be >= 1; got 0"),
    (
        ["mixed_precision.enabled=maybe"],
        "mixed_precision.enabled: expected true, false or auto; got 'maybe'",
    ),
    (
        ["mixed_precision.dtype=fp8"],
        "mixed_precision.dtype: expected one of auto, bf16, fp16; got 'fp8'",
    ),
    (
        ["mixed_precision.loss_scale=huge"],
        "mixed_precision.loss_scale: expected 'dynamic' or a positive number",
    ),
    (["optimization.optimizer=adagradx"], "optimization.optimizer: expected one of root, adamw"),
    (
        ["optimization.clip.mode=sometimes"],
        "optimization.clip.mode: expected one of norm, value, adaptive, none",
    ),
    (["model.n_kv_heads=3"], "model.n_kv_heads: must divide model.n_heads=4; got 3"),
    (["data.val_fraction=0.9"], "data.val_fraction: must be <= 0.5; got 0.9"),
    (["distributed.rank=3"], "distributed.rank: must be < distributed.world_size=1; got 3"),
    (["model=3"], "model: expected a mapping of keys; got 3"),
    (
        ["checkpoint.resume=missing.pt"],
        "checkpoint.resume: expected auto, never, restart or an existing checkpoint file",
    ),
    (["justtext"], "override 'justtext': expected section.key=value"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_config_is_one_clear_line(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert len(info.value.problems) == 1
    assert message in info.value.problems[0]
    # The command line: exit status 2, one line, no traceback, nothing trained.
    assert train_main(["--log_dir", "unused", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_several_problems_are_all_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["run.max_steps=x", "model.foo=1", "optimization.beta1=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("rootopt train: config error: ") for line in err)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run: [1, 2\n", "invalid YAML at line"),
        ("- a\n- b\n", "expected a mapping of sections"),
        ("run:\n  max_steps: ten\n", "run.max_steps: expected an integer"),
    ],
)
def test_bad_yaml_file(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert train_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_missing_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--config", "no/such.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_deployment_example_world_size_is_for_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its world_size 8 needs torchrun; without a launcher the example runs as one
    process and says so (the README runs it that way: tests/test_user_path.py)."""
    from rootopt.train.build import process_info

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = process_info(load_config(ROOT / "configs" / "deployment_example.yaml"))
    assert (info.rank, info.world_size) == (0, 1)
    assert "torchrun --nproc_per_node=8" in info.note


def test_yaml11_exponent_strings_are_numbers() -> None:
    # PyYAML reads `5e-4` as a string (YAML 1.1); the deployment example writes exactly that.
    assert load_config(None, ["optimization.epsilon=1e-8"]).optimization.epsilon == 1e-8
    assert isinstance(load_config(None, []), Config)
