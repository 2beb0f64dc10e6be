"""Shards: real corpora, checksums, rank/worker split, exact resume positions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _train_fixtures import prepare_tiny
from rootopt.commands.data import main as data_main
from rootopt.data import ShardError, ShardStream, load_manifest, make_loader, prepare, text_bytes


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("shards"))


def _take(stream: ShardStream, n: int, workers: int = 0) -> list[torch.Tensor]:
    out = []
    for batch in make_loader(stream, workers):
        out.append(batch["input"])
        if len(out) == n:
            break
    return out


def test_manifest_and_sha256sums(shards: Path) -> None:
    m = load_manifest(shards)
    assert m["task"] == "lm" and m["tokenizer"]["kind"] == "bytes" and m["seq_len"] == 32
    assert m["token_dtype"] == "uint8" and m["tokenizer"]["vocab_size"] == 256
    assert len(m["splits"]["train"]) >= 4 and len(m["splits"]["val"]) == 1
    sums = (shards / "SHA256SUMS").read_text().split("\n")
    assert any(line.endswith("train-000000.tar") for line in sums)
    text = bytes(next(iter(ShardStream(shards, batch_size=2)))["input"][0].tolist())
    assert text.isascii()  # real KJV text, byte tokens


@pytest.mark.parametrize("corpus", ["stdlib", "kjv", "bbc"])
def test_real_corpora_are_offline_text(corpus: str) -> None:
    data = text_bytes(corpus, max_bytes=20_000)
    assert len(data) == 20_000 and data.decode("utf-8", errors="replace").count(" ") > 1000


def test_corrupt_shard_is_named(shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in shards.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    victim = copy / "train-000001.tar"
    blob = bytearray(victim.read_bytes())
    blob[700] ^= 0xFF
    victim.write_bytes(bytes(blob))
    stream = ShardStream(copy, batch_size=64, shuffle=False)
    with pytest.raises(ShardError, match="shard train-000001.tar failed its checksum"):
        for _ in stream:
            pass
    assert data_main(["verify", str(copy)]) == 2
    victim.write_bytes((shards / victim.name).read_bytes())
    (copy / "train-000002.tar").unlink()
    with pytest.raises(ShardError, match="train-000002.tar is missing"):
        for _ in ShardStream(copy, batch_size=64, shuffle=False, verify=True):
            pass


def test_a_truncated_shard_fails_the_checksum_or_without_it_the_sample_count(
    shards: Path, tmp_path: Path
) -> None:
    from rootopt.data import validate_data

    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    entry = load_manifest(copy)["splits"]["train"][2]
    victim = copy / entry["name"]
    victim.write_bytes(victim.read_bytes()[: 1024 * 3])  # three whole samples, no end record
    with pytest.raises(ShardError, match=f"shard {entry['name']} failed its checksum"):
        validate_data(copy, checksum=True)
    with pytest.raises(
        ShardError,
        match=rf"shard {entry['name']} holds \d+ samples, manifest says {entry['samples']}",
    ):
        validate_data(copy, checksum=False)
    victim.write_bytes((shards / victim.name).read_bytes())
    assert validate_data(copy, checksum=True) == validate_data(copy, checksum=False) > 4


def test_ranks_get_disjoint_shards(shards: Path) -> None:
    names = [
        {e["name"] for e in ShardStream(shards, batch_size=4, rank=r, world_size=3).shards}
        for r in range(3)
    ]
    assert not (names[0] & names[1]) and not (names[1] & names[2]) and not (names[0] & names[2])
    assert set().union(*names) == {e["name"] for e in load_manifest(shards)["splits"]["train"]}


@pytest.mark.parametrize("start", [0, 7, 150])  # 150 batches of 16 crosses an epoch boundary
def test_resume_at_exact_position(shards: Path, start: int) -> None:
    full = _take(ShardStream(shards, batch_size=16, seed=3), start + 5)
    part = _take(ShardStream(shards, batch_size=16, seed=3, start_batch=start), 5)
    assert all(torch.equal(a, b) for a, b in zip(full[start:], part))


def test_worker_split_resumes_exactly(shards: Path) -> None:
    full = _take(ShardStream(shards, batch_size=64, seed=1, num_workers=2), 12, workers=2)
    part = _take(
        ShardStream(shards, batch_size=64, seed=1, num_workers=2, start_batch=7), 5, workers=2
    )
    assert all(torch.equal(a, b) for a, b in zip(full[7:], part))
    single = _take(ShardStream(shards, batch_size=64, seed=1), 12)
    assert {tuple(t.flatten()[:8].tolist()) for t in full} != set() and len(single) == 12


def test_epochs_reshuffle(shards: Path) -> None:
    s = ShardStream(shards, batch_size=8, seed=0)
    per_epoch = sum(e["samples"] for e in s.shards) // 8
    batches = _take(s, 2 * per_epoch + 1)
    assert not torch.equal(batches[0], batches[per_epoch])


def test_seq_len_longer_than_shards_is_refused(shards: Path) -> None:
    with pytest.raises(ShardError, match="exceeds the shards' seq_len=32"):
        ShardStream(shards, batch_size=2, seq_len=64)


def test_classification_path_digits(tmp_path: Path) -> None:
    m = prepare("digits", tmp_path / "d", samples_per_shard=500, val_fraction=0.1)
    assert m["task"] == "classify" and m["num_classes"] == 10 and m["feature_dim"] == 64
    batch = next(iter(ShardStream(tmp_path / "d", batch_size=8)))
    assert batch["input"].shape == (8, 64) and batch["input"].dtype == torch.float32
    assert batch["target"].dtype == torch.int64 and int(batch["target"].max()) < 10


def test_data_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert (
        data_main(
            [
                "prepare",
                "--corpus",
                str(corpus),
                "--out",
                str(tmp_path / "o"),
                "--seq_len",
                "16",
                "--samples_per_shard",
                "100",
            ]
        )
        == 0
    )
    assert "train samples" in capsys.readouterr().out
    assert data_main(["verify", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["corpus"] == "text.txt"
    assert data_main(["prepare", "--corpus", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown corpus 'nope'" in capsys.readouterr().err
    assert (
        data_main(["prepare", "--corpus", "kjv", "--out", str(tmp_path / "x"), "--seq_len", "1"])
        == 2
    )


def test_classification_path_bbc_news(tmp_path: Path) -> None:
    m = prepare("bbc-classes", tmp_path / "news", samples_per_shard=1000, val_fraction=0.1)
    assert m["num_classes"] == 5 and m["feature_dim"] == 256
    assert sorted(m["classes"]) == ["business", "entertainment", "politics", "sports", "tech"]
    assert sum(e["samples"] for s in m["splits"].values() for e in s) == 2225
