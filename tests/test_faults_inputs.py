"""Bad input, each answered by one line naming what is wrong and the right exit status."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from _train_fixtures import TINY, prepare_tiny
from rootopt.commands.report import main as report_main
from rootopt.train.main import main as train_main


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert len(err[0]) < 600, err[0][:300]
    assert "Traceback" not in err[0]
    return err[0]


def _config(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    return str(path)


BOMB = (
    b"a: &a [x, x, x, x, x, x, x, x, x]\n"
    + b"".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n".encode()
        for p, c in zip("abcdefgh", "bcdefghi")
    )
    + b"run: {name: *i}\n"
)

CONFIGS: list[tuple[bytes, str]] = [
    (b"run:\n  seed: 1\n\xff\xfe bad", "not UTF-8"),
    (b"", "is empty"),
    (b"# only a comment\n", "is empty"),
    (b"run:\n  seed: 1\n  seed: 2\n", "duplicate key"),
    (b"run: [1, 2\n", "invalid YAML at line"),
]


@pytest.mark.parametrize(("content", "message"), CONFIGS)
def test_bad_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    assert (
        train_main(["--config", _config(tmp_path, content), "--log_dir", str(tmp_path / "r")]) == 2
    )
    assert message in _line(capsys)
    assert not (tmp_path / "r").exists()


def test_yaml_alias_bomb_does_not_flood(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main(["--config", _config(tmp_path, BOMB)]) == 2
    err = capsys.readouterr().err
    assert "run.name: expected a string; got a list of 9 item(s)" in err
    assert len(err) < 4000, len(err)  # one short line per problem, no expanded aliases


def test_config_that_is_a_directory_or_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert train_main(["--config", str(tmp_path)]) == 2
    assert "is a directory" in _line(capsys)
    path = _config(tmp_path, b"run: {seed: 1}\n")

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert train_main(["--config", path]) == 2
    line = _line(capsys)
    assert "cannot be read (Permission denied)" in line and "c.yaml" in line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.max_steps=1.0e+30"], "run.max_steps: must be <="),
        (["model.d_model=10000000"], "model.d_model: must be <="),
        (["data.batch_size=1.0e+12"], "data.batch_size: must be <="),
        (["run.loss_spike_factor=0.5"], "run.loss_spike_factor"),
        (["checkpoint.resume=nope.pt"], "checkpoint.resume"),
    ],
)
def test_absurd_values(
    capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    assert train_main(["--print-config", *overrides]) == 2
    assert message in _line(capsys)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5"),
    ],
)
def test_bad_launcher_environment(
    shards: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    message: str,
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert train_main(["--data_path", str(shards), "--log_dir", str(tmp_path / "r"), *TINY]) == 2
    assert message in _line(capsys)


def test_log_dir_that_is_a_file_or_read_only(
    shards: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = tmp_path / "afile"
    f.write_text("mine")
    assert train_main(["--data_path", str(shards), "--log_dir", str(f), *TINY]) == 2
    assert "is not a directory" in _line(capsys) and f.read_text() == "mine"
    import rootopt.checkpoint as ck

    real = ck.os.open

    def read_only(path: Any, flags: int, mode: int = 0o777) -> int:
        if str(path).endswith(".lock") and flags & os.O_CREAT:  # the first file a run creates
            raise OSError(30, "Read-only file system", str(path))
        return real(path, flags, mode)

    monkeypatch.setattr(ck.os, "open", read_only)
    (tmp_path / "ro").mkdir()
    assert train_main(["--data_path", str(shards), "--log_dir", str(tmp_path / "ro"), *TINY]) == 2
    line = _line(capsys)
    assert "is not writable (Read-only file system)" in line and "ro" in line
    assert list((tmp_path / "ro").iterdir()) == []


def test_vocab_smaller_than_the_data(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--data_path", str(shards), "--log_dir", str(tmp_path / "r"), *TINY]
    assert train_main([*args, "model.vocab_size=100"]) == 2
    assert "model.vocab_size: 100 is smaller than the data's vocabulary (256" in _line(capsys)


def test_model_larger_than_memory_is_refused_before_allocating(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--data_path", str(shards), "--log_dir", str(tmp_path / "r"), *TINY]
    assert train_main([*args, "model.d_model=65536", "model.n_heads=2", "model.n_kv_heads=1"]) == 2
    line = _line(capsys)
    assert "model: d_model=65536" in line and "GiB" in line


def test_prometheus_port_in_use_and_bad_host(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--data_path", str(shards), *TINY, "monitoring.prometheus.enabled=true"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        rc = train_main(
            [*args, "--log_dir", str(tmp_path / "a"), f"monitoring.prometheus.port={port}"]
        )
        assert rc == 2
        assert f"127.0.0.1:{port}" in _line(capsys)
    rc = train_main(
        [*args, "--log_dir", str(tmp_path / "b"), "monitoring.prometheus.host=no-such-host.invalid"]
    )
    assert rc == 2
    assert "no-such-host.invalid" in _line(capsys)


def test_unreadable_manifest_or_shard(
    shards: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = tmp_path / "d"
    shutil.copytree(shards, d)
    (d / "manifest.json").write_bytes(b"\xff\xfe{")
    assert train_main(["--data_path", str(d), "--log_dir", str(tmp_path / "r"), *TINY]) == 2
    assert "not UTF-8" in _line(capsys)
    shutil.copy(shards / "manifest.json", d / "manifest.json")
    import rootopt.data.shards as mod

    real = mod.sha256_file

    def denied(path: Path, chunk: int = 1 << 20) -> str:
        if path.name == "train-000001.tar":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, chunk)

    monkeypatch.setattr(mod, "sha256_file", denied)
    assert train_main(["--data_path", str(d), "--log_dir", str(tmp_path / "r2"), *TINY]) == 2
    assert "shard train-000001.tar cannot be read: Permission denied" in _line(capsys)


def test_report_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert report_main([str(run), "--max-slowdown", "-1"]) == 2
    assert "--max-slowdown must be > 0" in _line(capsys)
    assert report_main([str(run), "--baseline", str(tmp_path / "missing")]) == 2
    assert "--baseline" in _line(capsys)
    assert report_main([str(run), "--update-band", "1", "0.1"]) == 2
    assert "--update-band" in _line(capsys)


def test_cli_keeps_real_import_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    from rootopt import cli

    def missing(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", lambda n: missing("webdataset"))
    assert cli.main(["data"]) == 2
    assert "needs the 'webdataset' package" in _line(capsys)
    monkeypatch.setattr(importlib, "import_module", lambda n: missing("rootopt.data.nonexistent"))
    with pytest.raises(ModuleNotFoundError, match="rootopt.data.nonexistent"):
        cli.main(["data"])


def test_sigint_while_starting_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import rootopt.train.main as m

    def interrupted(*a: Any, **k: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(m, "load_config", interrupted)
    assert m.main([]) == 130
    assert "interrupted" in _line(capsys)
