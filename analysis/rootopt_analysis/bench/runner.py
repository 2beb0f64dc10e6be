"""One benchmark run, and many of them in parallel processes, resumable.

A run is plain data (:class:`RunSpec`); its result is one JSON file named by the spec's hash
under ``<out>/runs/``, written atomically by the worker that ran it. A rerun of the suite
skips every spec whose result file exists, so an interrupted suite resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rootopt._threads import one_thread

# Suites whose runs only choose hyperparameters or feed a decision, and the learning-rate
# sweep: they evaluate at the end only (evaluation draws no random numbers, so the final losses
# are the same either way; an evaluation of both held-out splits costs about ten training
# steps of the small LM).
FINAL_EVAL_ONLY = frozenset({"study", "study-select-v3", "study-decide-v3", "study-sweep-v3"})
# Suites whose runs record no momentum tail (only their final losses are ever read).
NO_TAIL = frozenset({"study", "study-select-v3", "study-decide-v3"})
# Evaluations (and momentum-tail records) per run, at most: a long run evaluates every
# steps / 20 steps instead of its task's interval (the curves keep their shape; the cost stays
# bounded).
MAX_EVALS = 20
FORMAT = 2  # bump when the meaning of a run's result changes; old results are then rerun
PRECISIONS = ("fp32", "bf16")  # bf16: the forward and loss under torch.autocast(bfloat16)


@dataclass(frozen=True)
class Corruption:
    """Gradient corruption injected after ``backward`` and before the optimizer step.

    ``student_t``: every element gets ``scale · rms(g) · t_df`` noise (heavy-tailed).
    ``outliers``: each element, with probability ``rate``, gets ``± scale · rms(g)`` added
    (sparse, large). ``rms(g)`` is the tensor's own gradient RMS at that step.
    """

    kind: str = "none"  # none | student_t | outliers
    scale: float = 0.0
    rate: float = 0.0
    df: int = 2  # integer degrees of freedom (2: infinite variance)

    @property
    def tag(self) -> str:
        if self.kind == "student_t":
            return f"t{self.df:g}x{self.scale:g}"
        if self.kind == "outliers":
            return f"out{self.rate:g}x{self.scale:g}"
        return "clean"


@dataclass(frozen=True)
class RunSpec:
    suite: str
    task: str
    optimizer: str
    lr: float
    seed: int
    steps: int
    weight_decay: float
    clip: float | None = 1.0
    corruption: Corruption = field(default_factory=Corruption)
    lr_mult: float = 1.0  # the robustness suite's lr ×3 / ×10 (lr holds the base value)
    # Extra optimizer options (sorted (key, value) pairs, JSON values), e.g. ns_dtype.
    options: tuple[tuple[str, Any], ...] = ()
    # lr of the parameters an orthogonalizing optimizer leaves to its internal AdamW
    # (embeddings, norms, heads), as a multiple of lr; 1.0 = the same lr.
    side_lr_mult: float = 1.0
    # Training precision (PRECISIONS). Added after results existed: left out of the spec's
    # dict (and so of its id) at its default, so every earlier run keeps its id.
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r} (choose from {PRECISIONS})")

    @property
    def run_id(self) -> str:
        blob = json.dumps({"format": FORMAT, **self.to_dict()}, sort_keys=True)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:10]
        amp = "-amp" if self.precision != "fp32" else ""
        return f"{self.task}{amp}-{self.optimizer}-lr{self.lr:.3g}-s{self.seed}-{self.corruption.tag}-x{self.lr_mult:g}-{digest}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = [list(kv) for kv in self.options]
        if d["precision"] == "fp32":
            del d["precision"]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RunSpec:
        d = dict(d)
        d["corruption"] = Corruption(**d.get("corruption", {}))
        d["options"] = tuple((str(k), v) for k, v in d.get("options", ()))
        return RunSpec(**d)


def _side_groups(opt: Any) -> list[dict[str, Any]]:
    """The param groups that an orthogonalizing optimizer leaves to AdamW."""
    import torch

    from rootopt.optim.registry import OptimizerChain
    from rootopt.optim.root import ROOT

    if isinstance(opt, OptimizerChain):
        return [g for c in opt.children for g in _side_groups(c)]
    if isinstance(opt, ROOT):
        return [g for g in opt.param_groups if g.get("algorithm") == "adamw"]
    if isinstance(opt, torch.optim.AdamW):
        return list(opt.param_groups)
    return []


def build_optimizer(spec: RunSpec, model: Any) -> Any:
    """The spec's optimizer for ``model``: registry entry, options, lr × lr_mult, and the
    AdamW side's lr × side_lr_mult."""
    from rootopt.optim.registry import make_optimizer

    opt, _ = make_optimizer(
        spec.optimizer,
        model,
        lr=spec.lr * spec.lr_mult,
        weight_decay=spec.weight_decay,
        **dict(spec.options),
    )
    if spec.side_lr_mult != 1.0:
        side = _side_groups(opt)
        if not side or len(side) == len(opt.param_groups):
            raise ValueError(f"{spec.optimizer}: side_lr_mult needs an AdamW side to scale")
        for g in side:
            g["lr"] *= spec.side_lr_mult
    return opt


def _corrupt(params: Sequence[Any], c: Corruption, gen: Any) -> None:
    import torch

    for p in params:
        g = p.grad
        if g is None:
            continue
        rms = g.pow(2).mean().sqrt()
        if c.kind == "student_t":
            # t_df = z / sqrt(chi2_df / df), chi2_df a sum of df squared normals (integer df),
            # all drawn from the run's own noise generator so corruption is repeatable.
            k = max(1, round(c.df))
            z = torch.randn(g.shape, generator=gen)
            chi2 = torch.randn((k, *g.shape), generator=gen).pow(2).sum(0)
            g.add_(z / (chi2 / k).sqrt() * rms * c.scale)
        elif c.kind == "outliers":
            mask = torch.rand(g.shape, generator=gen) < c.rate
            sign = torch.randint(0, 2, g.shape, generator=gen).mul_(2).sub_(1)
            g.add_(mask * sign * rms * c.scale)


def _orthogonalized(opt: Any) -> list[tuple[Any, Any]]:
    """``(param, v)`` for every matrix that ``opt`` (ROOT, ``torch.optim.Muon``, or a chain of
    them) orthogonalized in its last step, ``v`` the vector it orthogonalized: ROOT's
    ``g + mu * buf`` (sum-form momentum; the input of its threshold, rootopt.optim.functional),
    Muon's ``g.lerp(buf, mu)`` (torch.optim.Muon's Nesterov form)."""
    import torch

    from rootopt.optim.registry import OptimizerChain
    from rootopt.optim.root import ROOT

    out: list[tuple[Any, Any]] = []
    kids = opt.children if isinstance(opt, OptimizerChain) else [opt]
    for o in kids:
        is_root = isinstance(o, ROOT)
        if not is_root and not isinstance(o, torch.optim.Muon):
            continue
        for g in o.param_groups:
            alg = g.get("algorithm")
            if is_root and alg == "adamw":
                continue
            mu, nesterov = float(g["momentum"]), bool(g["nesterov"])
            for p in g["params"]:
                if is_root and alg != "root" and p.ndim < 2:  # "auto": ROOT takes ndim >= 2
                    continue
                buf = o.state.get(p, {}).get("momentum_buffer")
                if buf is None or p.grad is None:
                    continue
                grad = p.grad.to(buf.dtype)
                if not nesterov:
                    v = buf
                elif is_root:
                    v = grad + mu * buf
                else:
                    v = grad.lerp(buf, mu)
                out.append((p, v))
    return out


def momentum_tail(opt: Any, step: int) -> dict[str, Any] | None:
    """The tail of what the optimizer orthogonalized this step, per matrix: kurtosis
    (``E[(x-m)^4] / Var^2``; 3 for a Gaussian), the share of entries above 10x the RMS, and the
    0.9-quantile of ``|x|`` over the RMS (where ROOT's default threshold clips). Summarised as
    the median and maximum over matrices (the share also pooled over all entries); None when
    the optimizer orthogonalizes nothing (AdamW).

    Where a threshold q clips (ROOT), also what it clips (pooled over the matrices it
    thresholds): the share of entries above the q-quantile of ``|x|``, the shares of those
    clipped entries that exceed 3x and 10x the RMS, and the clipped part's share of the squared
    norm, ``||x - clamp(x, -t, t)||² / ||x||²`` (docs/benchmarks.md, v3 "Mechanism")."""
    import torch

    pairs = _orthogonalized(opt)
    if not pairs:
        return None
    kurt, share, q90 = [], [], []
    above = total = 0
    clip = {"entries": 0, "clipped": 0, "over3": 0, "over10": 0, "mass": 0.0, "norm": 0.0}
    for p, v in pairs:
        x = v.detach().float().flatten()
        rms = x.pow(2).mean().sqrt().clamp_min(1e-30)
        c = x - x.mean()
        var = c.pow(2).mean().clamp_min(1e-30)
        kurt.append(float(c.pow(4).mean() / var**2))
        n_above = int((x.abs() > 10 * rms).sum())
        above, total = above + n_above, total + x.numel()
        share.append(n_above / x.numel())
        q90.append(float(torch.quantile(x.abs(), 0.9) / rms))
        q = _threshold_quantile(opt, p)
        if q is not None:
            a = x.abs()
            t = torch.quantile(a, q)
            cut = a > t
            clip["entries"] += x.numel()
            clip["clipped"] += int(cut.sum())
            clip["over3"] += int((cut & (a > 3 * rms)).sum())
            clip["over10"] += int((cut & (a > 10 * rms)).sum())
            clip["mass"] += float((a - t).clamp_min(0).pow(2).sum())
            clip["norm"] += float(x.pow(2).sum())

    def r4(x: float) -> float:
        return float(f"{x:.4g}")

    out = {
        "step": step,
        "matrices": len(pairs),
        "kurtosis_median": r4(statistics.median(kurt)),
        "kurtosis_max": r4(max(kurt)),
        "above10rms_share": r4(above / total),
        "above10rms_max": r4(max(share)),
        "q90_over_rms_median": r4(statistics.median(q90)),
    }
    if clip["entries"]:
        n = max(clip["clipped"], 1)
        out["clipped_share"] = r4(clip["clipped"] / clip["entries"])
        out["clipped_over3rms"] = r4(clip["over3"] / n)
        out["clipped_over10rms"] = r4(clip["over10"] / n)
        out["clipped_norm2_share"] = r4(clip["mass"] / max(clip["norm"], 1e-30))
    return out


def _threshold_quantile(opt: Any, p: Any) -> float | None:
    """The outlier quantile ROOT applies to parameter ``p`` (None: no threshold, or not ROOT)."""
    from rootopt.optim.registry import OptimizerChain
    from rootopt.optim.root import ROOT

    kids = opt.children if isinstance(opt, OptimizerChain) else [opt]
    for o in kids:
        if isinstance(o, ROOT):
            for g in o.param_groups:
                if any(q is p for q in g["params"]):
                    q = g.get("outlier_quantile")
                    return float(q) if q is not None else None
    return None


def run_one(spec: RunSpec, out_dir: str, progress: Any = None) -> dict[str, Any]:
    """Train one run and write ``<out_dir>/runs/<run_id>.json``; returns the result.

    Runs on one thread (the runner's parallelism is across processes) and restores the
    caller's thread count afterwards, so an in-process call leaves no global state."""
    with one_thread():
        return _run_one(spec, out_dir, progress)


def _run_one(spec: RunSpec, out_dir: str, progress: Any) -> dict[str, Any]:
    import torch

    from rootopt._atomic import atomic_write
    from rootopt.optim import NonFiniteGradientError
    from rootopt.tasks import load_task_data, task
    from rootopt.train.models import loss_fn
    from rootopt.train.schedule import LRMultiplier

    t_all = time.perf_counter()
    started = time.time()
    t = task(spec.task)
    data = load_task_data(spec.task)
    torch.manual_seed(spec.seed)
    model = t.model()
    opt = build_optimizer(spec, model)
    warmup = max(1, spec.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, LRMultiplier("cosine", warmup=warmup, total=spec.steps, min_ratio=0.1)
    )
    gen = torch.Generator().manual_seed(10_000 + spec.seed)
    noise_gen = torch.Generator().manual_seed(20_000 + spec.seed)
    params = [p for p in model.parameters() if p.requires_grad]

    def evaluate(step: int) -> dict[str, Any]:
        vl, va = t.evaluate(model, data, "val")
        tl, ta = t.evaluate(model, data, "test")
        return {
            "step": step,
            "val_loss": vl,
            "val_acc": va,
            "test_loss": tl,
            "test_acc": ta,
            "train_s": train_s,
            "cpu_s": cpu_s,
        }

    train_s = cpu_s = 0.0
    evals: list[dict[str, Any]] = [evaluate(0)]
    init_loss = evals[0]["val_loss"]
    train_loss: list[float] = []
    step_times: list[float] = []
    tail: dict[str, list[Any]] = {}
    diverged, error = False, ""
    every = max(t.eval_every, spec.steps // MAX_EVALS)
    # the tail at every evaluation (a run evaluated at its end only: at its end)
    tail_every = 0 if spec.suite in NO_TAIL else every
    if spec.suite in FINAL_EVAL_ONLY and tail_every:
        tail_every = spec.steps
    amp = spec.precision == "bf16"
    for step in range(1, spec.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = t.batch(data, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if spec.corruption.kind != "none":
            _corrupt(params, spec.corruption, noise_gen)
        if spec.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.clip)
        try:
            opt.step()
        except NonFiniteGradientError as exc:
            diverged, error = True, f"non-finite gradient: {exc}"
        sched.step()
        lv = float(loss.detach())
        dt = time.perf_counter() - t0
        step_times.append(dt)
        train_s += dt
        cpu_s += time.process_time() - c0
        train_loss.append(lv)
        if not math.isfinite(lv) or diverged:
            diverged = True
            error = error or "non-finite training loss"
            break
        if tail_every and (step % tail_every == 0 or step == spec.steps):
            rec = momentum_tail(opt, step)
            for key, value in (rec or {}).items():  # columns: {"step": [...], ...}
                tail.setdefault(key, []).append(value)
        if step == spec.steps or (step % every == 0 and spec.suite not in FINAL_EVAL_ONLY):
            evals.append(evaluate(step))
            if not math.isfinite(evals[-1]["val_loss"]):
                diverged, error = True, "non-finite validation loss"
                break
        if progress is not None and (step % 10 == 0 or step == spec.steps):
            progress.put((spec.run_id, step, spec.steps))
    final = evals[-1]
    if not diverged and final["val_loss"] >= init_loss:
        diverged, error = True, "final validation loss not below the initial loss"
    state_bytes = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in (s.values() if isinstance(s, dict) else [])
        if isinstance(v, torch.Tensor)
    )
    sorted_times = sorted(step_times[len(step_times) // 5 :] or step_times)
    result: dict[str, Any] = {
        "format": FORMAT,
        "run_id": spec.run_id,
        "spec": spec.to_dict(),
        "initial_val_loss": init_loss,
        "final_val_loss": final["val_loss"] if not diverged else float("nan"),
        "final_val_acc": final["val_acc"] if not diverged else None,
        "final_test_loss": final["test_loss"] if not diverged else float("nan"),
        "final_test_acc": final["test_acc"] if not diverged else None,
        "last_eval": final,
        "evals": evals,
        "train_loss": train_loss,
        "diverged": diverged,
        "error": error,
        "steps_done": len(train_loss),
        "step_time_s": sorted_times[len(sorted_times) // 2] if sorted_times else None,
        "optimizer_state_bytes": state_bytes,
        "param_count": sum(p.numel() for p in params),
        "train_cpu_s": cpu_s,
        "wall_s": time.perf_counter() - t_all,
        # information only (no result depends on a clock): when the run started and ended
        "started": started,
        "ended": time.time(),
        "initial_test_loss": evals[0]["test_loss"],
        "momentum_tail": tail,
    }
    path = Path(out_dir) / "runs" / f"{spec.run_id}.json"
    atomic_write(path, json.dumps(result).encode())
    return result


def load_result(out_dir: Path, spec: RunSpec) -> dict[str, Any] | None:
    path = out_dir / "runs" / f"{spec.run_id}.json"
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a torn or foreign file: the run is redone
    return data if data.get("format") == FORMAT and data.get("run_id") == spec.run_id else None


def _worker_init() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


class Progress:
    """Overall bar (runs done / total) plus the step of every active run, on stderr."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.done, self.label, self.enabled = total, 0, label, enabled
        self.active: dict[str, tuple[int, int]] = {}
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def step(self, run_id: str, step: int, steps: int) -> None:
        self.active[run_id] = (step, steps)
        self.show()

    def finish(self, run_id: str, line: str) -> None:
        self.done += 1
        self.active.pop(run_id, None)
        if self.enabled:
            self._clear()
            el = time.perf_counter() - self.t0
            print(f"[{self.label} {self.done}/{self.total} {el:5.0f}s] {line}", file=sys.stderr)
        self.show(force=True)

    def _clear(self) -> None:
        if self.tty:
            print("\r\033[K", end="", file=sys.stderr)

    def show(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or not self.tty or (not force and now - self.last < 0.3):
            return
        self.last = now
        runs = "  ".join(
            f"{rid.split('-')[0]}/{rid.split('-')[1]} {s}/{n}"
            for rid, (s, n) in self.active.items()
        )
        print(
            f"\r\033[K{self.label}: {self.done}/{self.total} runs done | {runs}",
            end="",
            file=sys.stderr,
            flush=True,
        )


def summary_line(r: dict[str, Any]) -> str:
    s = r["spec"]
    fin = r["last_eval"]
    acc = f" acc {fin['val_acc']:.3f}" if fin.get("val_acc") is not None else ""
    status = "DIVERGED " if r["diverged"] else ""
    return (
        f"{s['task']:<7} {s['optimizer']:<20} lr {s['lr'] * s['lr_mult']:.2e} seed {s['seed']} "
        f"{s['corruption']['kind'] if s['corruption']['kind'] != 'none' else ''} "
        f"{status}val {fin['val_loss']:.4f}{acc} ({r['wall_s']:.1f}s)"
    )


def run_many(
    specs: Sequence[RunSpec],
    out_dir: Path,
    *,
    workers: int,
    label: str,
    show: bool = True,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    compute: bool = True,
) -> list[dict[str, Any] | None]:
    """Run every spec not already finished under ``out_dir``; returns all results in order.

    ``compute=False``: run nothing; specs without a finished result give ``None`` (a report
    of a partly finished suite).
    """
    import multiprocessing as mp

    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    todo: list[RunSpec] = []
    for s in dict.fromkeys(specs):  # dedupe, keep order
        r = load_result(out_dir, s)
        if r is not None:
            results[s.run_id] = r
        else:
            todo.append(s)
    if not compute:
        if show and todo:
            print(f"[{label}] {len(todo)} runs not finished; left out", file=sys.stderr)
        return [results.get(s.run_id) for s in specs]
    prog = Progress(len(todo), label, show)
    if show and len(results):
        print(f"[{label}] {len(results)} finished runs reused, {len(todo)} to run", file=sys.stderr)
    if todo:
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            queue = manager.Queue()
            with ProcessPoolExecutor(
                max_workers=max(1, workers), mp_context=ctx, initializer=_worker_init
            ) as pool:
                pending: dict[Future[dict[str, Any]], RunSpec] = {
                    pool.submit(run_one, s, str(out_dir), queue): s for s in todo
                }
                while pending:
                    done, _ = wait(list(pending), timeout=0.5, return_when=FIRST_COMPLETED)
                    while not queue.empty():
                        prog.step(*queue.get_nowait())
                    for fut in done:
                        spec = pending.pop(fut)
                        r = fut.result()  # a worker error is a bug: let it surface
                        results[spec.run_id] = r
                        prog.finish(spec.run_id, summary_line(r))
                        if on_result is not None:
                            on_result(r)
        prog._clear()
    return [results[s.run_id] for s in specs]
