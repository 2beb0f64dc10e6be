"""``results.json`` → PNG plots and a markdown report (tables generated, never typed in)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# The claimed GLM-130B numbers that docs/benchmarks.md compares against (not reproducible
# here); printed beside our numbers, never used in a computation.
SEED_TABLE = {
    "adam": {"steps_to_target": "125k", "accuracy": "78.2%"},
    "lamb": {"steps_to_target": "98k", "accuracy": "79.1%"},
    "root": {"steps_to_target": "82k", "accuracy": "80.5%"},
}


def _pm(v: Any, fmt: str = "{:.4f}") -> str:
    if not v or v[0] is None or (isinstance(v[0], float) and math.isnan(v[0])):
        return "—"
    return f"{fmt.format(v[0])} ± {fmt.format(v[1])}"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(names: list[str]) -> dict[str, Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab20")
    return {n: cmap(i % 20) for i, n in enumerate(names)}


def plot_curves(conv: dict[str, Any], path: Path) -> None:
    plt = _plt()
    tasks = list(conv["tasks"])
    col = _colors(list(dict.fromkeys(n for tv in conv["tasks"].values() for n in tv["optimizers"])))
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7), squeeze=False)
    for j, task in enumerate(tasks):
        tv = conv["tasks"][task]
        names = list(tv["optimizers"])
        for i, subset in enumerate(
            (
                [n for n in names if not n.startswith("root-")],
                [n for n in names if n.startswith("root") or n == "adamw"],
            )
        ):
            ax = axes[i][j]
            for n in subset:
                curves = tv["optimizers"][n]["curves"]
                L = min(len(c["steps"]) for c in curves)
                if L < 2:
                    continue
                steps = curves[0]["steps"][:L]
                vals = [[c["val_loss"][k] for c in curves] for k in range(L)]
                mean = [sum(v) / len(v) for v in vals]
                lo = [min(v) for v in vals]
                hi = [max(v) for v in vals]
                ax.plot(steps, mean, label=n, color=col[n], lw=1.4)
                ax.fill_between(steps, lo, hi, color=col[n], alpha=0.2)
            ax.axhline(tv["target_val_loss"], color="k", ls=":", lw=0.8)
            ax.set_title(f"{task}: {'baselines' if i == 0 else 'ROOT ablations'}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss")
            finite = [
                v
                for n in subset
                for c in tv["optimizers"][n]["curves"]
                for v in c["val_loss"][1:]
                if math.isfinite(v)
            ]
            if finite:
                lo_all = min(finite)
                ax.set_ylim(lo_all * 0.97, min(max(finite), lo_all * 2.5))
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle("validation loss at each optimizer's best lr (mean, band = min..max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_lr(lrr: dict[str, Any], path: Path) -> None:
    plt = _plt()
    tasks = list(lrr)
    col = _colors(list(dict.fromkeys(n for rows in lrr.values() for n in rows)))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0][j]
        names = list(lrr[task])
        for n in names:
            row = lrr[task][n]
            ys = [y if math.isfinite(y) else float("nan") for y in row["final_val_loss"]]
            ax.plot(
                row["lrs"],
                ys,
                marker="o",
                ms=3,
                label=n,
                color=col[n],
                ls="--" if n.startswith("root-") else "-",
            )
        ax.set_xscale("log")
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("peak lr")
        ax.set_ylabel("final validation loss (seed 0)")
        finite = [y for n in names for y in lrr[task][n]["final_val_loss"] if math.isfinite(y)]
        if finite:
            ax.set_ylim(min(finite) * 0.97, min(max(finite), min(finite) * 2.5))
    axes[0][-1].legend(fontsize=6, ncol=2, loc="upper right")
    fig.suptitle("lr sensitivity: final loss over each optimizer's lr grid (gaps = diverged)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_robustness(rob: dict[str, Any], path: Path) -> None:
    plt = _plt()
    conds = [c["label"] for c in rob["conditions"]]
    opts = list(rob["table"][conds[0]])
    col = _colors(opts)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(conds)), 7), sharex=True)
    w = 0.8 / len(opts)
    for k, o in enumerate(opts):
        xs = [i + (k - (len(opts) - 1) / 2) * w for i in range(len(conds))]
        loss = [rob["table"][c][o]["final_val_loss"][0] for c in conds]
        err = [rob["table"][c][o]["final_val_loss"][1] for c in conds]
        div = [rob["table"][c][o]["diverged_fraction"] or 0.0 for c in conds]
        axes[0].bar(
            xs,
            [v if math.isfinite(v) else 0 for v in loss],
            w,
            yerr=[e if math.isfinite(e) else 0 for e in err],
            color=col[o],
            label=o,
        )
        axes[1].bar(xs, div, w, color=col[o])
    finite = [rob["table"][c][o]["final_val_loss"][0] for c in conds for o in opts]
    finite = [v for v in finite if math.isfinite(v)]
    if finite:
        axes[0].set_ylim(min(finite) * 0.9, max(finite) * 1.05)
    axes[0].set_ylabel("final val loss (non-diverged)")
    axes[1].set_ylabel("fraction diverged")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_xticks(range(len(conds)), conds, rotation=20, fontsize=8)
    axes[0].legend(fontsize=7, ncol=4)
    fig.suptitle(f"gradient corruption and lr stress on {rob['task']} (no grad clipping)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_overhead(ov: dict[str, Any], path: Path) -> None:
    plt = _plt()
    models = list(ov["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for j, m in enumerate(models):
        rows = ov["models"][m]["optimizers"]
        names = list(rows)
        ax = axes[0][j]
        xs = range(len(names))
        ax.bar(
            [x - 0.2 for x in xs],
            [rows[n]["step_vs_adamw"] for n in names],
            0.4,
            label="step time ×AdamW",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [rows[n]["state_vs_adamw"] or 0 for n in names],
            0.4,
            label="optimizer state ×AdamW",
        )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs), names, rotation=60, fontsize=7, ha="right")
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


SECTIONS = ("convergence", "lr_robustness", "robustness", "overhead")


def finished_sections(results: dict[str, Any]) -> list[str]:
    """The sections of ``results`` that hold at least one finished run (or, for
    ``overhead``, a measurement); a ``--finished-only`` report of a partial suite shows only
    these, and none means there is nothing to report."""
    found = []
    for name in SECTIONS:
        sec = results.get(name)
        if not sec:
            continue
        if name == "convergence":
            ok = bool(sec.get("tasks"))
        elif name == "lr_robustness":
            ok = any(sec.values())
        elif name == "robustness":
            ok = any(c.get("runs") for row in sec.get("table", {}).values() for c in row.values())
        else:
            ok = True
        if ok:
            found.append(name)
    return found


def write_plots(results: dict[str, Any], out: Path, prefix: str = "bench_") -> list[str]:
    made = []
    if "convergence" in results:
        plot_curves(results["convergence"], out / f"{prefix}curves.png")
        made.append(f"{prefix}curves.png")
    if "lr_robustness" in results:
        plot_lr(results["lr_robustness"], out / f"{prefix}lr.png")
        made.append(f"{prefix}lr.png")
    if "robustness" in results:
        plot_robustness(results["robustness"], out / f"{prefix}robustness.png")
        made.append(f"{prefix}robustness.png")
    if "overhead" in results:
        plot_overhead(results["overhead"], out / f"{prefix}overhead.png")
        made.append(f"{prefix}overhead.png")
    return made


# --------------------------------------------------------------------------- markdown


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def convergence_md(conv: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for task, tv in conv["tasks"].items():
        lines += [
            f"### {task}: {tv['description']}",
            "",
            f"{tv['steps']} steps; target = tuned AdamW's mean final validation loss = "
            f"{tv['target_val_loss']:.4f}. Sorted by final validation loss.",
            "",
        ]
        rows = []
        items = sorted(
            tv["optimizers"].items(),
            key=lambda kv: (
                kv[1]["final_val_loss"][0] if math.isfinite(kv[1]["final_val_loss"][0]) else 1e9
            ),
        )
        for opt, r in items:
            st = r["steps_to_target"]
            rows.append(
                [
                    opt,
                    f"{r['best_lr']:.3g}",
                    _pm(r["final_val_loss"]),
                    _pm(r["final_val_acc"], "{:.3f}") if r["final_val_acc"] else "—",
                    (f"{st[0]:.0f} ± {st[1]:.0f}" if st else "—")
                    + f" ({r['reached_target']}/{r['seeds']})",
                    f"{r['train_s_to_target']:.1f}" if r["train_s_to_target"] else "—",
                    f"{r['step_time_ms']:.1f}",
                    f"{r['optimizer_state_bytes'] / 1024:.0f}",
                    f"{r['smoothness'][0]:.2e}" if math.isfinite(r["smoothness"][0]) else "—",
                    str(r["diverged"]),
                ]
            )
        lines += _table(
            [
                "optimizer",
                "best lr",
                "final val loss",
                "val acc",
                "steps to target (reached)",
                "train s to target",
                "step ms",
                "state KiB",
                "smoothness",
                "diverged",
            ],
            rows,
        )
        lines.append("")
    return lines


def seed_table_md(conv: dict[str, Any]) -> list[str]:
    tasks = conv["tasks"]
    lm = "stdlib" if "stdlib" in tasks else next(iter(tasks))
    cls = "bbc" if "bbc" in tasks else None
    rows = []
    for opt, claim in SEED_TABLE.items():
        r = tasks[lm]["optimizers"].get(opt)
        if r is None:
            continue
        st = r["steps_to_target"]
        acc = tasks[cls]["optimizers"].get(opt, {}).get("final_val_acc") if cls else None
        rows.append(
            [
                opt,
                claim["steps_to_target"],
                (
                    f"{st[0]:.0f} ({r['reached_target']}/{r['seeds']} seeds)"
                    if st
                    else f"not reached (0/{r['seeds']})"
                ),
                claim["accuracy"],
                (f"{100 * acc[0]:.1f}% ± {100 * acc[1]:.1f}" if acc else "—"),
            ]
        )
    return _table(
        [
            "optimizer",
            "claimed (GLM-130B): steps to target",
            f"ours ({lm}): steps to target",
            "claimed (GLM-130B): final accuracy",
            f"ours ({cls}): final accuracy",
        ],
        rows,
    )


def lr_md(lrr: dict[str, Any]) -> list[str]:
    lines = []
    for task, rows in lrr.items():
        lines += [f"#### {task}", ""]
        out = []
        for opt, r in rows.items():
            cells = [f"{v:.3f}" if math.isfinite(v) else "div" for v in r["final_val_loss"]]
            out.append(
                [
                    opt,
                    " / ".join(cells),
                    f"{r['within_5pct_of_best']}/{len(cells)}",
                    f"{r['worst_over_best']:.2f}" if r["worst_over_best"] else "—",
                    str(r["diverged"]),
                ]
            )
        lines += _table(
            [
                "optimizer",
                "final loss over its lr grid (low → high)",
                "grid points within 5% of best",
                "worst / best",
                "diverged",
            ],
            out,
        )
        lines.append("")
    return lines


def robustness_md(rob: dict[str, Any]) -> list[str]:
    conds = [c["label"] for c in rob["conditions"]]
    opts = list(rob["table"][conds[0]])
    rows = []
    for c in conds:
        row = [c]
        for o in opts:
            e = rob["table"][c][o]
            m = e["final_val_loss"][0]
            if not e["runs"]:
                row.append("not run")
                continue
            row.append(
                (f"{m:.3f}" if math.isfinite(m) else "—") + f" ({e['diverged_fraction']:.0%} div)"
            )
        rows.append(row)
    return _table(["condition", *opts], rows)


def overhead_md(ov: dict[str, Any]) -> list[str]:
    lines = []
    for m, mv in ov["models"].items():
        lines += [f"#### {m} ({mv['config']})", ""]
        rows = [
            [
                n,
                f"{r['step_ms']:.1f}",
                f"{r['opt_step_ms']:.1f}",
                f"{r['step_vs_adamw']:.2f}",
                f"{r['state_bytes'] / 1024:.0f}",
                f"{r['state_vs_adamw']:.2f}" if r["state_vs_adamw"] is not None else "—",
                f"{r['train_memory_vs_adamw']:.2f}",
            ]
            for n, r in mv["optimizers"].items()
        ]
        lines += _table(
            [
                "optimizer",
                "step ms",
                "optimizer.step ms",
                "step ×AdamW",
                "state KiB",
                "state ×AdamW",
                "params+grads+state ×AdamW",
            ],
            rows,
        )
        lines.append("")
    mm = ov["matmul"]
    lines += [
        f"Measured float32 matmul peak (one thread): **{mm['peak_gflops']:.1f} GFLOP/s** "
        f"({', '.join(f'{k}²: {v:.1f}' for k, v in mm['gflops_by_size'].items())}).",
        "",
    ]
    rows = [
        [
            "×".join(map(str, o["shape"])),
            f"{o['ms']:.2f}",
            f"{o['gflops']:.1f}",
            f"{100 * o['fraction_of_peak']:.0f}%",
        ]
        for o in ov["orthogonalization"]
    ]
    lines += _table(["matrix", "5-step NS ms", "GFLOP/s", "of matmul peak"], rows)
    return lines


def markdown(results: dict[str, Any], plots: list[str], img_prefix: str = "") -> str:
    lines = ["# rootopt benchmark report (generated)", ""]
    meta = results.get("meta", {})
    if meta:
        lines += [f"- {k}: {v}" for k, v in meta.items()] + [""]
    if "convergence" in results:
        conv = results["convergence"]
        lines += ["## Convergence", ""]
        lines += [
            f"lr grid: registry lr × {', '.join(f'{m:.3g}' for m in conv['grid_multipliers'])}; "
            f"{conv['seeds']} seeds at each optimizer's best grid lr; warmup 10 % + cosine to 0.1×; "
            f"grad-norm clip 1.0; wall {conv['wall_s']:.0f} s.",
            "",
        ]
        lines += convergence_md(conv)
        lines += [
            "### Beside the claimed GLM-130B table (claims, not reproducible here; ours are measured)",
            "",
        ]
        lines += [*seed_table_md(conv), ""]
    if "lr_robustness" in results:
        lines += ["## lr robustness", "", *lr_md(results["lr_robustness"])]
    if "robustness" in results:
        rob = results["robustness"]
        lines += [
            "## Robustness to gradient corruption",
            "",
            f"Task {rob['task']}, {rob['steps']} steps (own warmup + cosine), {rob['seeds']} seeds, no gradient clipping, lr per optimizer: "
            + ", ".join(f"{o} {v:.3g} ({rob['lr_source'][o]})" for o, v in rob["lr"].items())
            + f"; wall {rob['wall_s']:.0f} s. Cells: mean final val loss of non-diverged runs "
            "(fraction diverged).",
            "",
        ]
        lines += [*robustness_md(rob), ""]
    if "overhead" in results:
        lines += ["## Overhead", "", *overhead_md(results["overhead"]), ""]
    for p in plots:
        lines += [f"![{p}]({img_prefix}{p})", ""]
    return "\n".join(lines)
