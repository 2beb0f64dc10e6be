"""MFU means what it says (docs/monitoring.md, "Throughput and MFU"): never above 100 %,
and on a CPU an estimate against a peak that the machine's load does not pull down,
labelled as such in env.json and in ``rootopt report``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _train_fixtures import FAST, prepare_tiny, quiet
from rootopt.config import load_config
from rootopt.monitor import read_jsonl
from rootopt.monitor.report import check_run
from rootopt.train import train
from rootopt.train.metrics.mfu import Peak, cpu_name, cpu_peak, measure_one_thread, mfu


def test_mfu_above_one_is_not_recorded() -> None:
    """A device does not run above its peak: a value above 1 means a wrong peak."""
    peak = Peak(1e12, "run.peak_tflops", "fp32", "cpu")
    assert mfu(6e6, 1e5, 1, peak) == pytest.approx(0.6)
    assert mfu(6e6, 1e5, 2, peak) == pytest.approx(0.3)
    assert mfu(6e6, 1e6, 2, peak) is None  # 300 %
    assert mfu(6e6, 1e6, 1, Peak(0.0, "unknown", "fp32", "cuda")) is None


def test_a_run_above_its_peak_logs_no_mfu_and_says_why(tmp_path: Path) -> None:
    """A peak far too low (here configured at 1 MFLOP/s) gave MFU in the thousands of
    percent; now every such window records ``mfu: null`` and the first one an event with
    the rate the model reached."""
    shards = prepare_tiny(tmp_path / "d")
    over = [*FAST, "run.max_steps=10", "run.peak_tflops=1e-6"]
    train(load_config(None, over), tmp_path / "run", str(shards), say=quiet)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(r["tokens_per_s"] > 0 for r in rows)
    assert [r["mfu"] for r in rows] == [None, None]
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    above = [e for e in events if e["event"] == "mfu_above_peak"]
    assert len(above) == 1 and above[0]["step"] == 5
    assert above[0]["achieved_tflops"] > 1e-6 and above[0]["peak"]["tflops"] == 1e-6
    assert above[0]["peak"]["source"] == "run.peak_tflops" and not above[0]["peak"]["estimate"]


def test_cpu_peak_is_the_threads_times_one_threads_best_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Timing with all threads on a loaded machine measured a peak 15× too low (MFU 79 %
    for a window at 5 %): the estimate times one thread, which no late sibling thread
    holds back, and multiplies by the run's threads; the caller's thread count is kept."""
    seen: list[int] = []
    mm = torch.mm

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    before = torch.get_num_threads()
    rate = measure_one_thread(torch.float32, sizes=(64,))
    assert rate > 0 and seen and set(seen) == {1} and len(seen) == 1 + 3 * 3
    assert torch.get_num_threads() == before
    monkeypatch.undo()

    one = cpu_peak("fp32", 1)
    three = cpu_peak("fp32", 3)
    assert three.flops == pytest.approx(3 * one.flops)
    rec = three.record()
    assert rec["source"] == "measured" and rec["estimate"] is True and rec["device"] == "cpu"
    assert rec["machine"] == cpu_name() != "" and rec["threads"] == 3 and rec["dtype"] == "fp32"
    assert rec["method"].startswith("3 threads × the best one-thread fp32 matmul")


def _report(tmp: Path, peak: dict[str, Any]) -> Any:
    run = tmp / "r"
    run.mkdir()
    rows = [{"step": i + 1, "loss": 3.0 - 0.1 * i, "mfu": 0.02} for i in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "env.json").write_text(json.dumps({"peak": peak}))
    crit = [c for c in check_run(run).criteria if c.name.startswith("GPU utilisation")]
    return crit[0]


def test_report_labels_a_cpu_mfu_as_an_estimate(tmp_path: Path) -> None:
    peak = {
        "tflops": 0.2,
        "source": "measured",
        "dtype": "fp32",
        "device": "cpu",
        "estimate": True,
        "machine": "Some CPU 9000",
    }
    c = _report(tmp_path, peak)
    assert c.status == "SKIP"
    assert "median MFU 2.0% of 3 records, an estimate" in c.evidence
    assert "0.2 TFLOP/s fp32 peak, measured on Some CPU 9000" in c.evidence
