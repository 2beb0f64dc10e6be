"""The benchmark scripts refuse an existing ``--json`` file before they measure anything, and\nthe paired spectral check pairs its runs correctly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script", ["bench_step", "bench_gram", "bench_memory", "bench_quantile", "paired_spectral"]
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
    study = json.loads((ROOT / "docs" / "study_results.json").read_text())
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
