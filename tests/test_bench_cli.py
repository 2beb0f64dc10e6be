"""The benchmark scripts refuse an existing ``--json`` file before they measure anything, and\nthe paired spectral check pairs its runs correctly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script",
    [
        "bench_step",
        "bench_gram",
        "bench_memory",
        "bench_quantile",
        "paired_spectral",
        "bench_llama_impl",
    ],
)
def test_a_bench_refuses_an_existing_json_before_running(tmp_path: Path, script: str) -> None:
    out = tmp_path / "bench.json"
    out.write_text("the user's earlier results\n")
    extra = ["--out", str(tmp_path / "runs")] if script == "paired_spectral" else []
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--json", str(out), *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the file exists" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing was measured
    assert out.read_text() == "the user's earlier results\n"
    assert not (tmp_path / "runs").exists()


def _load(name: str) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_spectral_runs_differ_only_in_the_form() -> None:
    """The paired check trains the study's bf16 arm with its tuned setting and report seeds,
    the two forms differing in ``ns_gram`` alone (otherwise the pairing means nothing)."""
    import json

    mod: Any = _load("paired_spectral")
    study = json.loads((ROOT / "docs" / "study_results_v1.json").read_text())
    by_form = mod.specs_for(study, "kjv@150")
    plain, spectral = by_form["off"], by_form["spectral"]
    seeds = study["protocol"]["report_seeds"]
    assert len(plain) == len(spectral) == len(seeds) == 5
    setting = study["cells"]["kjv@150"]["arms"]["root-muon-bf16"]["setting"]
    for p, s, seed in zip(plain, spectral, seeds, strict=True):
        assert p.seed == s.seed == seed and p.task == "kjv" and p.steps == 150
        assert p.lr == s.lr == setting["lr"] and p.weight_decay == setting["weight_decay"]
        assert dict(p.options)["ns_dtype"] == "bfloat16"
        assert dict(p.options) == {**dict(s.options), "ns_gram": "off"}
        assert dict(s.options)["ns_gram"] == "spectral" and p.run_id != s.run_id
    with pytest.raises(KeyError, match="not in the study"):
        mod.specs_for(study, "nope@1")


def test_bench_step_skip_bf16_times_float32_only_and_leaves_that_target_open(
    tmp_path: Path,
) -> None:
    """``--skip-bf16`` (a CPU without native bfloat16 matmuls) times only ROOT and its Muon
    mode in float32; the bf16 target is reported as not measured, never as met, and the
    other targets still have values."""
    import json

    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--threads", "1",
         "--d-model", "64", "--layers", "1", "--vocab", "128", "--count-d-model", "64",
         "--count-layers", "1", "--rounds", "2", "--skip-bf16", "--skip-shapes",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert sorted(res["step_cpu_ms_median"]) == ["root", "root_muon_mode_fp32"]
    assert res["machine"]["cpu_capability"] in proc.stdout
    targets = res["targets"]
    assert len(targets) == 4
    bf16 = targets["bf16 root / torch.optim.Muon <= 1.00"]
    assert bf16["met"] is None and "not measured (--skip-bf16)" in proc.stdout
    fp32 = targets["root / own Muon mode (fp32) <= 1.05"]
    assert 0.2 < fp32["value"] < 5.0 and fp32["met"] == (fp32["value"] <= 1.05)
    kernels = targets["root kernels / torch.optim.Muon's <= 1"]
    assert kernels["value"] > 0 and isinstance(kernels["met"], bool)
