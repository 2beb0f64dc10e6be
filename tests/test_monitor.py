"""Monitoring: Prometheus names match the dashboard; report criteria and fixes; diagnose."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path

import pytest

from _train_fixtures import TINY, PrometheusScraper, prepare_tiny
from rootopt.commands.diagnose import main as diagnose_main
from rootopt.commands.report import main as report_main
from rootopt.config import load_config
from rootopt.monitor import PROMETHEUS_METRICS, Monitor
from rootopt.monitor.report import check_run
from rootopt.train import Hooks, train

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json"


def _dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {
        re.sub(r"_(bucket|sum|count)$", "", n)
        for e in exprs
        for n in re.findall(r"rootopt_[a-z_]+", e)
    }
    return names


def test_prometheus_endpoint_serves_the_dashboard_metrics(tmp_path: Path) -> None:
    mon = Monitor(tmp_path, jsonl=True, tensorboard=False, prometheus=("127.0.0.1", 0))
    try:
        assert mon.prom is not None and mon.prom.server.server_address[0] == "127.0.0.1"
        mon.log(
            {
                "step": 5,
                "loss": 2.5,
                "val_loss": 2.6,
                "lr": 1e-3,
                "steps_per_s": 3.0,
                "tokens_per_s": 900.0,
                "loss_scale": 1.0,
            },
            {
                "rootopt_update_param_ratio": {"w": 1e-3},
                "rootopt_root_clip_fraction": {"w": 0.1},
                "rootopt_root_eps": {"w": 0.01},
                "rootopt_memory_bytes": {"rss": 1e8},
            },
        )
        mon.grad_norm(0.7)
        mon.nonfinite_step()
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{mon.prom.port}/metrics", timeout=10)
            .read()
            .decode()
        )
    finally:
        mon.close()
    served = {
        line.split("{")[0].split(" ")[0]
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    served_base = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in served}
    wanted = _dashboard_metric_names()
    assert wanted, "dashboard has no rootopt queries"
    assert wanted <= served_base | served, wanted - (served_base | served)
    assert set(PROMETHEUS_METRICS) <= wanted | {
        "rootopt_step"
    }  # every exported metric is on the dashboard
    assert "rootopt_loss 2.5" in body and "rootopt_nonfinite_steps_total 1.0" in body


def test_training_serves_prometheus_when_enabled(tmp_path: Path) -> None:
    shards = prepare_tiny(tmp_path / "shards")
    cfg = load_config(
        None,
        [
            *TINY,
            "run.max_steps=12",
            "monitoring.prometheus.enabled=true",
            "monitoring.prometheus.port=0",
        ],
    )
    with PrometheusScraper(at=10) as prom:
        hooks = Hooks(after_step=prom.after_step)
        train(cfg, tmp_path / "run", str(shards), say=lambda _: None, hooks=hooks)
    scraped = prom.pages
    body = scraped[0]
    for name in (
        "rootopt_step 10.0",
        "rootopt_root_clip_fraction{param=",
        "rootopt_update_param_ratio{param=",
        "rootopt_grad_norm_bucket",
        "rootopt_tokens_per_second",
        'rootopt_memory_bytes{kind="rss"}',
    ):
        assert name in body, name


def _write_run(
    run: Path,
    losses: list[float],
    *,
    val: list[float] = (),
    nonfinite: int = 0,
    events: list[dict[str, object]] = (),
    ratio: float = 1e-2,
    step_time: float = 0.1,
) -> Path:
    run.mkdir(parents=True)
    rows = [
        {
            "step": 10 * (i + 1),
            "loss": v,
            "update_ratio_median": ratio,
            "step_time_s": step_time,
            "tokens_per_s": 100.0,
            "nonfinite_steps": nonfinite,
        }
        for i, v in enumerate(losses)
    ]
    rows += [{"step": 100 * (i + 1), "val_loss": v} for i, v in enumerate(val)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def _status(rep: object, name: str) -> str:
    return next(c.status for c in rep.criteria if c.name == name)  # type: ignore[attr-defined]


def test_report_passes_a_healthy_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(
        tmp_path / "ok", [5.0 * math.exp(-i / 20) + 1 for i in range(40)], val=[3.0, 2.0]
    )
    rep = check_run(run)
    assert rep.ok and not rep.symptoms
    assert (
        _status(rep, "loss trending down") == "PASS"
        and _status(rep, "validation improving") == "PASS"
    )
    assert report_main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "PASS  loss trending down" in out and "result: PASS" in out


def test_report_detects_oscillation_and_prints_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    losses = [3.0 if i % 3 else 6.0 for i in range(40)]
    run = _write_run(tmp_path / "osc", losses)
    assert report_main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  loss smooth" in out and "lower optimization.base_lr to the 1e-4 range" in out


def test_report_detects_nan_oom_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(
        tmp_path / "nan",
        [3.0, 2.5, float("nan"), 2.0] * 3,
        nonfinite=2,
        events=[
            {"event": "nonfinite_step", "step": 17},
            {"event": "oom", "step": 20},
            {"event": "timeout", "step": 21},
        ],
    )
    assert report_main([str(run), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert {s["key"] for s in data["symptoms"]} == {"nonfinite", "oom", "timeout"}
    fixes = " ".join(s["fix"] for s in data["symptoms"])
    assert (
        "dynamic loss scaling" in fixes and "activation_checkpointing" in fixes and "NCCL" in fixes
    )
    assert any(c["name"] == "no NaN/Inf" and c["status"] == "FAIL" for c in data["criteria"])


def test_report_update_band_and_baseline(tmp_path: Path) -> None:
    losses = [3.0 - 0.02 * i for i in range(20)]
    base = _write_run(tmp_path / "base", losses, step_time=0.1)
    slow = _write_run(tmp_path / "slow", losses, step_time=0.3, ratio=0.5)
    rep = check_run(slow, baseline=base)
    assert (
        _status(rep, "step time vs baseline") == "FAIL"
        and _status(rep, "update magnitudes in range") == "FAIL"
    )
    assert _status(check_run(base, baseline=base), "step time vs baseline") == "PASS"


def test_report_does_not_judge_warmup_records_as_steady_state(tmp_path: Path) -> None:
    """A healthy GPT-NeoX or Phi run peaks just over the band inside the lr warmup (0.105)
    and settles in it: the warmup records (steps <= optimization.warmup_steps of the run's
    config.yaml) are shown, not judged; the same value after the warmup still fails, and
    a run without its config.yaml is judged whole."""
    losses = [3.0 - 0.02 * i for i in range(20)]

    def run(name: str, at: int, config: bool = True) -> Path:
        d = _write_run(tmp_path / name, losses, ratio=0.05)
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            if r["step"] == at:
                r["update_ratio_median"] = 0.105
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if config:
            (d / "config.yaml").write_text("optimization:\n  warmup_steps: 30\n")
        return d

    crit = {c.name: c for c in check_run(run("warm", at=10)).criteria}["update magnitudes in range"]
    assert crit.status == "PASS", crit.evidence
    assert "max 5.00e-02" in crit.evidence and "0 of 17 outside" in crit.evidence
    assert "3 warmup record(s) (steps <= 30) not judged, max 1.05e-01" in crit.evidence
    assert _status(check_run(run("after", at=40)), "update magnitudes in range") == "FAIL"
    bare = run("bare", at=10, config=False)
    assert _status(check_run(bare), "update magnitudes in range") == "FAIL"


def test_report_on_missing_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_main([str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_report_and_diagnose_on_a_real_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = prepare_tiny(tmp_path / "shards")
    cfg = load_config(None, [*TINY, "run.max_steps=40", "run.log_every=2"])
    train(cfg, tmp_path / "run", str(shards), say=lambda _: None)
    assert report_main([str(tmp_path / "run")]) == 0
    assert "result: PASS" in capsys.readouterr().out
    assert diagnose_main([str(tmp_path / "run"), "--data_path", str(shards)]) == 0
    out = capsys.readouterr().out
    assert "gradient range" in out and "update ratio" in out and "loss-surface probe" in out
    assert "log-log slope" in out
    assert diagnose_main([str(tmp_path / "nothing")]) == 2
