"""What the defaults study v3 writes outside its own page (docs/benchmarks.md, v3 "Claims").

Rendered from the v3 summary (docs/study_results.json) alone, each once every run it reads
has finished; until then the pages keep what v2 wrote there.

- The README's results block (:func:`headline`, :func:`ready`): one row per cell, the decided
  default, ``torch.optim.Muon`` and AdamW (mean ± half the 95 % interval over the report
  seeds) and the paired ROOT − Muon difference. The three cells whose weight decay and
  AdamW-side multiple were re-tuned show the re-tuned runs, with the same difference at equal
  measured time beside. Bold follows one rule: the paired t test, Holm-corrected over every
  difference the table shows, rejects 0 at 5 %.
- docs/optimizer.md's sentences on what the threshold does (:func:`threshold_sentences`).
- The claims, each with its interval (:func:`claims`), listed on docs/benchmarks.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from rootopt_analysis.bench.stats import holm, mean_ci
from rootopt_analysis.bench.study import arm_by_name
from rootopt_analysis.bench.study_report import HEADLINE_BEGIN, HEADLINE_END, _wrap
from rootopt_analysis.bench.study_v3_real import CELL as REAL
from rootopt_analysis.bench.study_v3_real import HF_CONFIG, REPORT_SEEDS

COMPARISON = "default − torch.optim.Muon"
MUON, ADAMW = arm_by_name("muon-bf16").name, arm_by_name("adamw").name
# the table's order: v2's seven cells as v2's README listed them, then the horizon (read from
# the summary's protocol), then the real-model cell
SEVEN = ("stdlib@150", "kjv@150", "digits@200", "stdlib@600", "kjv@600", "digits@800",
         "stdlib-large@200")  # fmt: skip


def llama_parameters(cfg: dict[str, Any] = HF_CONFIG) -> int:
    """Parameters of a ``transformers`` ``LlamaForCausalLM`` with ``cfg`` (no biases, untied
    head unless ``tie_word_embeddings``): embeddings, per layer four attention projections
    (grouped keys and values), three SwiGLU matrices and two norms, the final norm, the head."""
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    head = 0 if cfg.get("tie_word_embeddings", True) else v * h
    return int(v * h + cfg["num_hidden_layers"] * layer + h + head)


@dataclass(frozen=True)
class Row:
    cell: str
    label: str
    root: list[float]  # a diverged run is NaN
    muon: list[float]
    diff: dict[str, Any] | None  # paired, with "p"; None where a run diverged
    adamw: list[float] | None
    retuned: bool = False
    equal_time: dict[str, Any] | None = None  # paired, with "p" and "steps"
    equal_time_steps: dict[str, int] | None = None  # None: no equal-time runs for the cell


def _ran(xs: Any) -> TypeGuard[list[float]]:
    """Every report run finished (a diverged one as NaN): at least 2 of them."""
    return isinstance(xs, list) and len(xs) >= 2 and all(isinstance(x, (int, float)) for x in xs)


def _finite(xs: Any) -> TypeGuard[list[float]]:
    return _ran(xs) and all(math.isfinite(x) for x in xs)


def _label(cell: str) -> str:
    task, steps = cell.split("@")
    return f"`{task}`, {int(steps):,}"


def rows(s: dict[str, Any]) -> list[Row] | None:
    """The table's rows, or None while a run the table reads is pending. A diverged run is
    shown as such (its row has no difference and takes no part in the correction)."""
    d = s.get("default")
    if not d:
        return None
    arm = d["arm"]
    comp = next((c for c in s.get("comparisons", []) if c["label"] == COMPARISON), None)
    if comp is None:
        return None
    out: list[Row] = []
    retune_cells = s["protocol"]["retune"]["cells"]
    for cell in (*SEVEN, *s["protocol"]["horizon"]):
        c = s["cells"].get(cell, {}).get("arms", {})
        adamw = (c.get(ADAMW) or {}).get("test_loss")
        if cell in retune_cells:
            rt = s.get("retuned") or {}
            mine = (rt.get(f"{arm}|{cell}") or {}).get("test_loss")
            theirs = (rt.get(f"{MUON}|{cell}") or {}).get("test_loss")
            et = (s.get("equal_time") or {}).get(cell) or {}
            timed = (et.get("test_loss") or {}).values()
            if not (_ran(mine) and _ran(theirs) and len(timed) == 2 and all(map(_ran, timed))):
                return None
            diff = (s.get("retuned_comparison") or {}).get(cell)
            eq = et.get(COMPARISON)
            out.append(Row(cell, _label(cell), mine, theirs, diff, adamw, True, eq, et["steps"]))
            continue
        mine, theirs = ((c.get(a) or {}).get("test_loss") for a in (arm, MUON))
        if not (_ran(mine) and _ran(theirs)):
            return None
        out.append(Row(cell, _label(cell), mine, theirs, comp["cells"].get(cell), adamw))
    real = s.get("real_model") or {}
    arms = real.get("arms") or {}
    mine, theirs = ((arms.get(a) or {}).get("test_loss") for a in (arm, MUON))
    if not (_ran(mine) and _ran(theirs)):
        return None
    diff = (real.get("default − other") or {}).get(MUON)
    adamw = (arms.get(ADAMW) or {}).get("test_loss")
    out.append(Row(REAL, _label(REAL), mine, theirs, diff, adamw))
    return out


def ready(s: dict[str, Any]) -> bool:
    return rows(s) is not None


def _tests(rs: list[Row]) -> list[tuple[tuple[str, str], Row, dict[str, Any]]]:
    """Every difference the table shows: ((cell, "steps" | "time"), its row, the paired test)."""
    out = [((r.cell, "steps"), r, r.diff) for r in rs if r.diff]
    return out + [((r.cell, "time"), r, r.equal_time) for r in rs if r.equal_time]


def adjusted_p(rs: list[Row]) -> dict[tuple[str, str], float]:
    """Each difference's p, Holm-corrected over every difference in the table."""
    tests = _tests(rs)
    return {
        key: q for (key, _, _), q in zip(tests, holm([t["p"] for _, _, t in tests]), strict=True)
    }


def bold(rs: list[Row]) -> set[tuple[str, str]]:
    """The differences whose Holm-corrected t test rejects 0 at 5 %."""
    return {key for key, q in adjusted_p(rs).items() if q <= 0.05}


def _pm(xs: list[float]) -> str:
    if not _finite(xs):
        return f"{sum(not math.isfinite(x) for x in xs)} of {len(xs)} diverged"
    ci = mean_ci(xs)
    return f"{ci.mean:.3f} ± {(ci.hi - ci.lo) / 2:.3f}"


def _ci(d: dict[str, Any] | None, strong: bool) -> str:
    if d is None:
        return "— (a run diverged)"
    text = f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"
    return f"**{text}**" if strong else text


def _sizes(s: dict[str, Any]) -> str:
    sizes: dict[str, int] = {}
    for cell in SEVEN:
        for r in s["cells"].get(cell, {}).get("arms", {}).values():
            if r.get("param_count"):
                sizes.setdefault(cell.split("@")[0], int(r["param_count"]))
    return ", ".join(f"`{t}` {n:,}" for t, n in sizes.items())


def headline(s: dict[str, Any]) -> str:
    """The README's results block (v3); raises while :func:`ready` is false."""
    rs = rows(s)
    if rs is None:
        raise ValueError("v3's README table has pending runs: " + ", ".join(s.get("pending", {})))
    strong = bold(rs)
    n_tests = len(_tests(rs))
    arm = s["default"]["arm"]
    coeffs = s["decisions"]["ns_coefficients"]["winner"]
    sizes = f" (parameters: {_sizes(s)})" if _sizes(s) else ""
    dtype = s["decisions"]["ns_dtype"]["per_class"]["native"]["winner"]
    intro = (
        "Final test loss (mean ± half the 95 % interval; "
        f"{len(s['protocol']['seeds']['report'])} seeds, {len(REPORT_SEEDS)} for `llama-bpe`) "
        "from [the defaults study v3](docs/benchmarks.md) "
        f"on a 2-core CPU, {' / '.join(s['meta'].get('cpus') or ['?'])}: byte-level Llama LMs, a "
        f"CNN for `digits`{sizes}, and a `transformers` Llama ({llama_parameters():,} "
        "parameters) on BPE tokens, trained by `rootopt train`. ROOT at its defaults "
        f'(`{arm}`: `ns_coefficients="{coeffs}"`, `ns_dtype="auto"`, {dtype} here); every run '
        "clips the gradient norm at 1. Tuned on other seeds: the learning rate per cell; the "
        "weight decay and AdamW-side lr re-tuned for ROOT and Muon on the rows marked †, "
        "inherited from 150/200 steps on the other study cells, `rootopt train`'s defaults on "
        "`llama-bpe`. "
        "ROOT − Muon: paired (same initialisation and "
        "batches), 95 % interval; at equal time the slower optimizer trains proportionally "
        "fewer steps. Bold: its t test rejects 0 at 5 %, Holm-corrected over the table's "
        f"{n_tests} differences. On `digits` (conv kernels) the Muon column is ROOT's float32 "
        "Muon mode."
    )
    lines = [HEADLINE_BEGIN, "", *_wrap(intro), ""]
    lines += [
        "| task, steps | ROOT (default) | Muon (`torch.optim.Muon`) | ROOT − Muon | "
        "ROOT − Muon, equal time | AdamW |",
        "|---|---|---|---|---|---|",
    ]
    for r in rs:
        timed = r.equal_time_steps is not None
        eq = _ci(r.equal_time, (r.cell, "time") in strong) if timed else "—"
        adamw = _pm(r.adamw) if _ran(r.adamw) else "—"
        lines.append(
            f"| {r.label}{' †' if r.retuned else ''} | {_pm(r.root)} | {_pm(r.muon)} | "
            f"{_ci(r.diff, (r.cell, 'steps') in strong)} | {eq} | {adamw} |"
        )
    lines += ["", HEADLINE_END]
    return "\n".join(lines) + "\n"


def _iv(d: dict[str, Any] | None) -> str:
    """A pooled paired interval with its 90 % (TOST) interval, as the v3 page prints it."""
    if d is None:
        return "pending"
    if "diverged" in d:
        return f"{d['diverged']} diverged"
    return (
        f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] (90 %: [{d['lo90']:+.4f}, "
        f"{d['hi90']:+.4f}], {d['n']} seeds)"
    )


def claims(s: dict[str, Any]) -> list[str]:
    """Each default with its pooled interval, then each difference the README's table shows
    with its interval and Holm-adjusted p (empty parts while pending)."""
    out: list[str] = []
    d = s.get("decisions") or {}
    if q1 := d.get("ns_coefficients"):
        out.append(
            f'`ns_coefficients="{q1["winner"]}"` ({q1["why"]}): `{q1["a"]}` − `{q1["b"]}` '
            f"{_iv(q1['difference'])}, validation, pooled over the LM cells"
        )
    if q2 := d.get("ns_dtype"):
        per = ", ".join(f"{c} {v['winner']}" for c, v in q2["per_class"].items())
        out.append(
            f'`ns_dtype="auto"` ({per}): `{q2["a"]}` − `{q2["b"]}` {_iv(q2["difference"])}, '
            "validation, pooled over the LM cells; the cheaper setting per class"
        )
    rs = rows(s)
    if rs is None:
        return out
    adjusted = adjusted_p(rs)
    for key, r, t in _tests(rs):
        at = (
            "equal steps"
            if key[1] == "steps"
            else f"equal time ({_steps(r.equal_time_steps or {})})"
        )
        q = adjusted[key]
        out.append(
            f"ROOT − `torch.optim.Muon` on {r.cell}{' (re-tuned)' if r.retuned else ''}, {at}: "
            f"{t['mean']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}], Holm-adjusted p {q:.3g}"
            + (" (bold)" if q <= 0.05 else "")
        )
    for r in rs:  # a diverged run: no interval, said as such
        if r.diff is None:
            out.append(
                f"ROOT − `torch.optim.Muon` on {r.cell}: ROOT {_pm(r.root)}, Muon {_pm(r.muon)}"
            )
    return out


def _steps(steps: dict[str, int]) -> str:
    return ", ".join(f"`{a}` {n:,} steps" for a, n in steps.items())


QABL_AT = ("stdlib@150", "stdlib@2400")  # the q ablation's cells (docs/benchmarks.md, v3)


def _pct(x: float) -> str:
    return f"{100 * x:.2g} %" if x < 0.01 else f"{100 * x:.1f} %"


def _range(lo: str, hi: str) -> str:
    return lo if lo == hi else f"{lo}–{hi}"


def threshold_sentences(s: dict[str, Any]) -> str | None:
    """docs/optimizer.md's two sentences on what ``q = 0.9`` does on the study's tasks: what
    it clips (the default's report runs on the LM cells, last evaluation, mean over seeds) and
    the paired test-loss difference without it; None while either is pending."""
    arm = (s.get("default") or {}).get("arm")
    tails = [
        t
        for c in s["protocol"]["lm_cells"]
        if (t := ((s["cells"].get(c, {}).get("arms", {}).get(arm) or {}).get("momentum_tail")))
        and t.get("clipped_share")
    ]
    comp = next(
        (c for c in s.get("comparisons", []) if c["label"] == "no threshold − default"), None
    )
    diffs = [(comp or {"cells": {}})["cells"].get(c) for c in QABL_AT]
    if not arm or len(tails) != len(s["protocol"]["lm_cells"]) or not all(diffs):
        return None

    def span(key: str) -> tuple[float, float]:
        xs = [t[key][-1] for t in tails]
        return min(xs), max(xs)

    share, over3, over10, mass = (
        span(k) for k in ("clipped_share", "clipped_over3rms", "clipped_over10rms",
                          "clipped_norm2_share")
    )  # fmt: skip
    q90 = span("q90_over_rms_median")
    d150, d2400 = (f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" for d in diffs if d)
    return (
        "On the defaults study's language-model tasks `q = 0.9` clips "
        f"{_range(_pct(share[0]), _pct(share[1]))} of the momentum's entries, of which "
        f"{_range(_pct(over3[0]), _pct(over3[1]))} exceed 3 times its RMS and at most "
        f"{_pct(over10[1])} 10 times; the clipped part is {_range(_pct(mass[0]), _pct(mass[1]))} "
        "of the squared norm, and the 0.9-quantile sits at "
        f"{_range(f'{q90[0]:.2f}', f'{q90[1]:.2f}')} times the RMS (a Gaussian's: 1.64), so the "
        "threshold shrinks the largest tenth of a near-Gaussian bulk rather than removing rare outliers. "
        f"Without it the test loss changed by {d150} nats at 150 steps and {d2400} at 2,400 "
        f"(`stdlib`, paired over {diffs[0]['n']} seeds, gradient clipping on; "
        "[benchmarks.md](benchmarks.md))."
    )
