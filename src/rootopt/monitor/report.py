"""Validation criteria and troubleshooting table (docs/monitoring.md, "Validation: `rootopt report`"),
checked on a run directory.

Reads only what a run leaves behind (``metrics.jsonl``, ``events.jsonl``, ``summary.json``),
so it works on a finished, crashed or still running run, and on a baseline run for the
step-time comparison.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rootopt.monitor.metrics import read_jsonl, read_jsonl_checked

# The troubleshooting table of docs/monitoring.md: symptom -> (likely cause, fix). Keys are
# what the report detects.
TROUBLESHOOTING: dict[str, tuple[str, str, str]] = {
    "oscillating_loss": (
        "training loss oscillates strongly",
        "learning rate too high",
        "lower optimization.base_lr to the 1e-4 range",
    ),
    "nonfinite": (
        "NaN gradients",
        "mixed precision misconfigured",
        "enable dynamic loss scaling (mixed_precision.loss_scale=dynamic) or increase optimization.epsilon",
    ),
    # The same symptom in a run without fp16 scaling cannot come from the loss scale.
    "nonfinite_fp32": (
        "NaN/Inf gradients or loss (no fp16 loss scaling in this run)",
        "learning rate too high or bad data",
        "lower optimization.base_lr (and keep optimization.clip.mode=norm); check the shards with "
        "rootopt data verify",
    ),
    "diverged": (
        "the run stopped as diverged (run.max_nonfinite / loss-spike rule)",
        "learning rate too high (or, with fp16, a loss scale that overflows)",
        "lower optimization.base_lr and rerun: it resumes from the last good checkpoint",
    ),
    "incomplete_log": (
        "metrics.jsonl holds unreadable lines",
        "the run was killed while writing, or the disk filled up",
        "free disk space; the records of a resumed run are rewritten from its checkpoint",
    ),
    "timeout": (
        "multi-GPU synchronisation timeout",
        "insufficient network bandwidth",
        "upgrade to InfiniBand or tune NCCL (NCCL_SOCKET_IFNAME, NCCL_IB_*), or raise distributed.timeout_s",
    ),
    "oom": (
        "out of memory",
        "batch too large",
        "reduce data.batch_size (keep the global batch with optimization.grad_accum_steps) "
        "or enable model.activation_checkpointing",
    ),
}

# ||Δθ||/||θ|| per step: below 1e-6 nothing learns, above 0.1 a step rewrites a tenth of a
# tensor. The narrower "healthy 1e-5..1e-3" is checked by `rootopt diagnose`; orthogonalized
# updates of small models at lr≈1e-3 sit near 1e-2 by construction (see docs/monitoring.md).
UPDATE_BAND = (1e-6, 1e-1)


@dataclass
class Criterion:
    name: str
    status: str  # PASS | FAIL | SKIP
    evidence: str


@dataclass
class Report:
    run_dir: Path
    criteria: list[Criterion] = field(default_factory=list)
    symptoms: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "FAIL" for c in self.criteria)

    def render(self) -> str:
        lines = [f"run: {self.run_dir}"]
        width = max(len(c.name) for c in self.criteria)
        lines += [f"  {c.status:<4}  {c.name:<{width}}  {c.evidence}" for c in self.criteria]
        for key in self.symptoms:
            symptom, cause, fix = TROUBLESHOOTING[key]
            lines.append(f"  symptom: {symptom} — likely cause: {cause}; fix: {fix}")
        n_fail = sum(c.status == "FAIL" for c in self.criteria)
        lines.append(
            f"result: {'PASS' if self.ok else 'FAIL'} ({n_fail} failed, "
            f"{sum(c.status == 'PASS' for c in self.criteria)} passed, "
            f"{sum(c.status == 'SKIP' for c in self.criteria)} skipped)"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "ok": self.ok,
            "criteria": [c.__dict__ for c in self.criteria],
            "symptoms": [
                {
                    "key": k,
                    "symptom": TROUBLESHOOTING[k][0],
                    "cause": TROUBLESHOOTING[k][1],
                    "fix": TROUBLESHOOTING[k][2],
                }
                for k in self.symptoms
            ],
        }


def _by_step(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Records holding ``key``, last one per step (a resumed run re-logs a few steps)."""
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        if key in r and "step" in r:
            out[int(r["step"])] = r
    return [out[s] for s in sorted(out)]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _precision(run_dir: Path, events: list[dict[str, Any]]) -> str:
    """fp32 | bf16 | fp16 — from the run's start events, else its config.yaml."""
    for e in reversed(events):
        if e.get("event") == "start" and isinstance(e.get("precision"), str):
            return str(e["precision"])
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        mp = cfg.get("mixed_precision", {}) if isinstance(cfg, dict) else {}
        if not mp.get("enabled"):
            return "fp32"
        if mp.get("enabled") == "auto":  # on CUDA only: the device is not in the config
            return "unknown"
        return str(mp.get("dtype", "auto"))
    except (OSError, ValueError, AttributeError, ImportError):
        return "unknown"


# summary.json statuses written when a session ends (``running`` is written at its start)
_FINAL = ("completed", "interrupted", "max_time", "diverged", "failed")


# The deployment guide's utilisation threshold (docs/monitoring.md, "Validation").
UTILISATION = 0.85


def _peak_record(run_dir: Path) -> dict[str, Any]:
    """env.json's ``peak`` (what the run's ``mfu`` divides by), {} when absent."""
    try:
        env = json.loads((run_dir / "env.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    peak = env.get("peak") if isinstance(env, dict) else None
    return peak if isinstance(peak, dict) else {}


def _utilisation(run_dir: Path, train: list[dict[str, Any]]) -> Criterion:
    """GPU utilisation >= 85 %, from the median ``mfu``.

    rootopt does not sample GPU utilisation (the share of time a kernel runs, as
    nvidia-smi reports it). MFU is a different quantity, but a lower bound of it: the
    device reaches at most its peak while a kernel runs, so a window at MFU m kept kernels
    running at least a fraction m of the time (with the model's FLOPs, which do not count
    recomputation, and the device's true peak). So a GPU run PASSes when its median MFU
    is >= 85 %; below that, the utilisation is not known and the criterion is SKIP, with
    the MFU as evidence. A CPU run has no GPU utilisation: SKIP."""
    name = f"GPU utilisation >= {UTILISATION:.0%}"
    values = [
        float(r["mfu"])
        for r in train
        if isinstance(r.get("mfu"), (int, float)) and math.isfinite(float(r["mfu"]))
    ]
    peak = _peak_record(run_dir)
    source = str(peak.get("source", ""))
    if not values:
        why = f" ({source})" if source.startswith("unknown") else ""
        return Criterion(
            name, "SKIP", f"no mfu records{why}; rootopt does not sample GPU utilisation"
        )
    m = _median(values)
    tflops = peak.get("tflops")
    of = f"{tflops:.4g} TFLOP/s {peak.get('dtype', '')} peak, {source}" if tflops else source
    if peak.get("estimate") or source == "measured":  # a CPU: no datasheet peak
        of += f" on {peak['machine']}" if peak.get("machine") else ""
        said = f"median MFU {m:.1%} of {len(values)} records, an estimate ({of})"
    else:
        said = f"median MFU {m:.1%} of {len(values)} records ({of})"
    if peak.get("device") != "cuda":
        return Criterion(name, "SKIP", f"no GPU in this run; {said}; MFU is not GPU utilisation")
    if m >= UTILISATION:
        return Criterion(
            name,
            "PASS",
            f"{said} >= {UTILISATION:.0%}: GPU utilisation is at least the MFU",
        )
    return Criterion(
        name,
        "SKIP",
        f"{said} < {UTILISATION:.0%}; MFU only bounds GPU utilisation from below and "
        "rootopt does not sample utilisation (use nvidia-smi / Nsight during the run)",
    )


def _warmup_steps(run_dir: Path) -> int:
    """``optimization.warmup_steps`` of the run's config.yaml; 0 when it cannot be read."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        value = cfg["optimization"]["warmup_steps"]
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _update_band(
    run_dir: Path, train: list[dict[str, Any]], band: tuple[float, float]
) -> Criterion:
    """The median ||Δθ||/||θ|| of every record after the lr warmup within ``band``.

    Records inside the warmup are not steady state: as the lr ramps up the update grows
    while the parameters that start at zero (biases, GPT-NeoX's and Phi's among them) are
    still small, and the median ratio peaks there before it settles (small GPT-NeoX and
    Phi models here: 0.088-0.097 at step 12-13 of the default 30-step warmup, 0.04-0.06
    after it). They are reported, not judged; without a readable config.yaml every record
    is judged."""
    name = "update magnitudes in range"
    lo, hi = band
    rows = [
        (int(r["step"]), float(r["update_ratio_median"]))
        for r in train
        if isinstance(r.get("update_ratio_median"), (int, float))
    ]
    if not rows:
        return Criterion(name, "SKIP", "no update-ratio records")
    warmup = _warmup_steps(run_dir)
    ratios = [v for step, v in rows if step > warmup]
    early = [v for step, v in rows if step <= warmup]
    skipped = (
        f"; {len(early)} warmup record(s) (steps <= {warmup}) not judged, max {max(early):.2e}"
        if early
        else ""
    )
    if not ratios:
        return Criterion(name, "SKIP", f"every update-ratio record is in the warmup{skipped}")
    outside = [v for v in ratios if not (lo <= v <= hi)]
    return Criterion(
        name,
        "PASS" if not outside else "FAIL",
        f"median ||Δθ||/||θ|| per record: min {min(ratios):.2e}, median "
        f"{_median(ratios):.2e}, max {max(ratios):.2e}; band [{lo:.0e}, {hi:.0e}]; "
        f"{len(outside)} of {len(ratios)} outside{skipped}",
    )


def _log_complete(run_dir: Path, metrics: list[dict[str, Any]], bad_lines: list[int]) -> Criterion:
    """Every line a JSON record, and as many lines as the run wrote: ``summary.json``
    counts them when a session ends, so a log cut at a line boundary fails too."""
    name = "metrics log complete"
    if bad_lines:
        return Criterion(
            name,
            "FAIL",
            f"{len(bad_lines)} unreadable line(s) in metrics.jsonl (line {bad_lines[0]})",
        )
    lines = len(metrics)
    summary: Any = None
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = None
    counted = summary.get("metrics_records") if isinstance(summary, dict) else None
    status = summary.get("status") if isinstance(summary, dict) else None
    if status not in _FINAL or not isinstance(counted, int) or isinstance(counted, bool):
        return Criterion(
            name,
            "PASS",
            f"{lines} records, every line readable; no end-of-session count in summary.json "
            "(run in progress or killed), so a cut at the end cannot be told",
        )
    if lines != counted:
        return Criterion(
            name,
            "FAIL",
            f"metrics.jsonl holds {lines} records but the run wrote {counted} "
            f"(summary.json, {status}): the log was cut or edited",
        )
    return Criterion(name, "PASS", f"{lines} records, as many as the run wrote ({status})")


def check_run(
    run_dir: str | Path,
    *,
    baseline: str | Path | None = None,
    max_slowdown: float = 1.5,
    update_band: tuple[float, float] = UPDATE_BAND,
    spike_factor: float = 1.3,
) -> Report:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is not a directory")
    if not max_slowdown > 0:
        raise ValueError(f"--max-slowdown must be > 0; got {max_slowdown}")
    if not 0 < update_band[0] < update_band[1]:
        raise ValueError(
            f"--update-band must be 0 < LO < HI; got {update_band[0]} {update_band[1]}"
        )
    if baseline is not None and not (Path(baseline) / "metrics.jsonl").is_file():
        raise ValueError(
            f"--baseline {str(baseline)!r} holds no metrics.jsonl (not a run directory)"
        )
    metrics, bad_lines = read_jsonl_checked(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    if not metrics:
        raise ValueError(
            f"{str(run_dir)!r} holds no metrics.jsonl records; is it a rootopt run directory?"
        )
    rep = Report(run_dir)
    rep.criteria.append(_log_complete(run_dir, metrics, bad_lines))
    if rep.criteria[-1].status == "FAIL":
        rep.symptoms.append("incomplete_log")
    train = _by_step(metrics, "loss")
    losses = [float(r["loss"]) if r["loss"] is not None else math.nan for r in train]
    finite = [v for v in losses if math.isfinite(v)]

    # 1. convergence: trending down
    if len(finite) >= 2:
        k = max(1, len(finite) // 10)
        first, last = statistics.fmean(finite[:k]), statistics.fmean(finite[-k:])
        ok = last < first * 0.98
        rep.criteria.append(
            Criterion(
                "loss trending down",
                "PASS" if ok else "FAIL",
                f"mean of first {k} records {first:.4f} → last {k} {last:.4f} "
                f"({(last / first - 1) * 100:+.1f}%)",
            )
        )
    else:
        rep.criteria.append(
            Criterion("loss trending down", "SKIP", f"{len(finite)} finite loss record(s)")
        )

    # 2. convergence: smooth (spikes against the recent median)
    if len(finite) >= 8:
        start = max(5, len(finite) // 10)
        spikes = [
            i
            for i in range(start, len(finite))
            if finite[i] > spike_factor * statistics.median(finite[i - 5 : i])
        ]
        allowed = max(1, int(0.02 * (len(finite) - start)))
        ok = len(spikes) <= allowed
        steps = [train[i]["step"] for i in spikes[:5]]
        rep.criteria.append(
            Criterion(
                "loss smooth",
                "PASS" if ok else "FAIL",
                f"{len(spikes)} spike(s) > {spike_factor}× the previous 5 records' median "
                f"(allowed {allowed})" + (f", at steps {steps}" if steps else ""),
            )
        )
        if not ok:
            rep.symptoms.append("oscillating_loss")
    else:
        rep.criteria.append(Criterion("loss smooth", "SKIP", f"{len(finite)} records (need 8)"))

    # 3. convergence: validation metric improving
    val = _by_step(metrics, "val_loss")
    if len(val) >= 2:
        a, b = float(val[0]["val_loss"]), float(val[-1]["val_loss"])
        extra = ""
        if "val_accuracy" in val[-1]:
            extra = f"; accuracy {val[0]['val_accuracy']:.3f} → {val[-1]['val_accuracy']:.3f}"
        bpb = [v.get("val_bits_per_byte") for v in (val[0], val[-1])]
        if all(isinstance(x, (int, float)) for x in bpb):
            extra += f"; bits per byte {bpb[0]:.4f} → {bpb[1]:.4f}"
        rep.criteria.append(
            Criterion(
                "validation improving",
                "PASS" if b < a else "FAIL",
                f"val loss {a:.4f} (step {val[0]['step']}) → {b:.4f} (step {val[-1]['step']}){extra}",
            )
        )
    else:
        rep.criteria.append(
            Criterion("validation improving", "SKIP", f"{len(val)} validation record(s) (need 2)")
        )

    # 4. stability: no NaN/Inf
    nonfinite_events = [e for e in events if e.get("event") == "nonfinite_step"]
    counted = max([int(r.get("nonfinite_steps", 0)) for r in train] + [len(nonfinite_events)])
    bad_loss = len(losses) - len(finite)
    ok = counted == 0 and bad_loss == 0
    first_bad = f", first at step {nonfinite_events[0]['step']}" if nonfinite_events else ""
    rep.criteria.append(
        Criterion(
            "no NaN/Inf",
            "PASS" if ok else "FAIL",
            f"{counted} non-finite step(s) skipped, {bad_loss} non-finite loss record(s){first_bad}",
        )
    )
    if not ok:
        rep.symptoms.append(
            "nonfinite_fp32" if _precision(run_dir, events) in ("fp32", "bf16") else "nonfinite"
        )
    diverged = [e for e in events if e.get("event") == "diverged"]
    if diverged:
        rep.criteria.append(
            Criterion(
                "not diverged",
                "FAIL",
                f"stopped at step {diverged[-1].get('step')}: {diverged[-1].get('reason')}",
            )
        )
        rep.symptoms.append("diverged")

    # 5. stability: update magnitudes in range
    rep.criteria.append(_update_band(run_dir, train, update_band))

    # 6. performance: step time vs a baseline run
    step_times = [
        float(r["step_time_s"]) for r in train if isinstance(r.get("step_time_s"), (int, float))
    ]
    mine = _median(step_times)
    tok = _median(
        [float(r["tokens_per_s"]) for r in train if isinstance(r.get("tokens_per_s"), (int, float))]
    )
    if baseline is not None:
        base_rows = _by_step(read_jsonl(Path(baseline) / "metrics.jsonl"), "loss")
        base = _median(
            [
                float(r["step_time_s"])
                for r in base_rows
                if isinstance(r.get("step_time_s"), (int, float))
            ]
        )
        if math.isfinite(base) and math.isfinite(mine):
            ratio = mine / base
            rep.criteria.append(
                Criterion(
                    "step time vs baseline",
                    "PASS" if ratio <= max_slowdown else "FAIL",
                    f"median {mine * 1e3:.1f} ms vs baseline {base * 1e3:.1f} ms "
                    f"(×{ratio:.2f}, allowed ×{max_slowdown})",
                )
            )
        else:
            rep.criteria.append(
                Criterion("step time vs baseline", "SKIP", "no step times in one of the runs")
            )
    else:
        rep.criteria.append(
            Criterion(
                "step time vs baseline",
                "SKIP",
                f"no --baseline; this run: median {mine * 1e3:.1f} ms/step, {tok:.0f} tokens/s",
            )
        )

    # 7. performance: accelerator utilisation, judged from the model FLOPs utilisation
    rep.criteria.append(_utilisation(run_dir, train))

    for kind in ("oom", "timeout"):
        if any(e.get("event") == kind for e in events):
            rep.symptoms.append(kind)
    return rep
