"""Checkpoints: atomic, checksummed, keep-last-K, corrupt ones detected and skipped."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rootopt import checkpoint
from rootopt.train.checkpoint import list_checkpoints, newest_valid, prune


class Arbitrary:
    """Any pickled class: weights_only loading must refuse it."""


def _payload() -> dict[str, object]:
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": m.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": checkpoint.rng_state(),
        "config": {"a": {"b": 1.5, "c": "x", "d": None, "e": [1, 2]}},
    }


def test_save_load_round_trip_and_keep_last(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        path = checkpoint.save(tmp_path, step, _payload())
        prune(tmp_path, run_id="", keep_last=2, keep=path)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "ckpt-00000030.pt",
        "ckpt-00000040.pt",
    ]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
    state = checkpoint.load(tmp_path / "ckpt-00000040.pt")
    assert state["step"] == 40 and state["config"]["a"]["e"] == [1, 2]
    meta = json.loads((tmp_path / "ckpt-00000040.json").read_text())
    assert meta["format_version"] == checkpoint.FORMAT_VERSION and len(meta["sha256"]) == 64


def test_rng_state_round_trip(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, 1, {"rng": checkpoint.rng_state()})
    a = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.set_rng_state(checkpoint.load(tmp_path / "ckpt-00000001.pt")["rng"])
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_sidecar", "bad_sidecar"])
def test_corrupt_checkpoint_is_reported_and_skipped(tmp_path: Path, damage: str) -> None:
    checkpoint.save(tmp_path, 1, _payload())
    checkpoint.save(tmp_path, 2, _payload())
    newest = tmp_path / "ckpt-00000002.pt"
    if damage == "flip":
        blob = bytearray(newest.read_bytes())
        blob[len(blob) // 2] ^= 0x55
        newest.write_bytes(bytes(blob))
    elif damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:100])
    elif damage == "no_sidecar":
        newest.with_suffix(".json").unlink()
    else:
        newest.with_suffix(".json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="ckpt-00000002.pt"):
        checkpoint.load(newest)
    found, skipped = newest_valid(tmp_path)
    assert found is not None and found.path.name == "ckpt-00000001.pt"
    assert len(skipped) == 1 and "ckpt-00000002.pt" in skipped[0]


def test_loads_with_weights_only(tmp_path: Path) -> None:
    # An arbitrary object must not be loadable: the loader uses weights_only=True.
    import hashlib
    import io

    buf = io.BytesIO()
    torch.save({"format_version": 1, "step": 1, "obj": Arbitrary()}, buf)
    path = tmp_path / "ckpt-00000001.pt"
    path.write_bytes(buf.getvalue())
    path.with_suffix(".json").write_text(
        json.dumps(
            {"format_version": 1, "step": 1, "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
        )
    )
    with pytest.raises(checkpoint.CheckpointError, match="cannot be loaded"):
        checkpoint.load(path)


def test_load_maps_the_file_once_without_a_copy(tmp_path: Path) -> None:
    """The checksum and the tensors come from one mapping: no bytes copy of the file."""
    import tracemalloc

    big = {"w": torch.randn(1024, 1024)}  # 4 MiB
    path = checkpoint.save(tmp_path, 1, {"model": big})
    size = path.stat().st_size
    tracemalloc.start()
    state = checkpoint.load(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert torch.equal(state["model"]["w"], big["w"])
    assert peak < size / 8, (peak, size)
