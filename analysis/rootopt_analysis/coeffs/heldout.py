"""Held-out polar error of the Newton–Schulz schedules on matrices recorded from training
(``rootopt coeffs heldout``; docs/adanewton.md, "Held-out evaluation on recorded training
matrices").

AdaNewton's table was fitted on synthetic spectrum families and on spectra recorded from
three small LMs on CPython's stdlib source (docs/adanewton.md). This tool measures the
schedules on data none of that saw:

1. **Record.** Short ROOT runs, with a seed no fit or tuning used (default 9001), of tasks
   and shapes outside the fitting data: the ``kjv`` byte-level LM (another corpus),
   ``stdlib-large`` (the model of ``rootopt train``'s default config: d=128, 4 layers,
   GQA), the ``digits`` CNN (conv kernels flattened to ``(out, in·9)``) and the ``bbc`` MLP
   (a 128×2000 input layer). Models and data come from :mod:`rootopt.tasks`; the
   optimizer is the registry's ``root`` (ROOT at its defaults with ``ns_coefficients="adanewton"`` and float32 iterations) with the bench runner's lr
   protocol. At the capture steps, every matrix that enters Newton–Schulz is captured as
   the optimizer passes it — the clipped Nesterov momentum ``B``, full matrices, together
   with the direction the optimizer computed from it — by wrapping the one
   orthogonalization call of ROOT's functional core (``rootopt.ortho.direction`` as
   ``root_direction`` calls it) for the duration of those steps. The runs are stored under ``--out`` (a cache directory by
   default, never the repository).
2. **Evaluate.** For every captured matrix, every schedule's relative polar error
   ``||X_K − UVᵀ||_F / ||UVᵀ||_F`` after K=5 steps, ``UVᵀ`` from a float64 SVD, with the
   iteration run for real in float32 and in bfloat16. Each schedule goes through the
   optimizer's own path: a ROOT built for that shape, ``ns_coefficients`` and ``ns_dtype``
   resolves the schedule and the iteration options as its step does (the group's
   ``coefficients_for`` lookup and ``root_options``), and the core's ``root_direction``
   runs them (without a second clip) on the stack of matrices the optimizer stacked. For
   AdaNewton in float32 this reproduces the directions recorded during training (checked,
   stack by stack).
3. **Report.** Per task and shape and per dtype: median and worst error of each schedule
   and AdaNewton's ratio to the best published schedule (Muon, You, Polar Express, CANS),
   against the 0.9× target of docs/adanewton.md.

Polar error is a proxy: whether a schedule trains better is decided by training runs
(docs/benchmarks.md), not here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

from rootopt_analysis.coeffs import new_file

if TYPE_CHECKING:
    from rootopt.optim.functional import OrthoMethod
    from rootopt.ortho import GramMode

RECORD_FORMAT = "rootopt.heldout_matrices/1"
SUMMARY_FORMAT = "rootopt.heldout_summary/1"
# A seed no fit, table build or tuning used (they used 0, 7, 1000 and 2024).
DEFAULT_SEED = 9001
CAPTURE_STEPS = (25, 100, 200)
TASK_NAMES = ("kjv", "stdlib-large", "digits", "bbc")
K = 5
DTYPES = ("float32", "bfloat16")
# Evaluated schedules, in report order. "adanewton-static" is not among them: it is an alias
# of "adanewton" (rootopt.coeffs.ALIASES) and would repeat its column.
SCHEDULES = (
    "adanewton",
    "muon",
    "you",
    "polar_express",
    "cans",
    "official",
)
# The published schedules AdaNewton is judged against (docs/adanewton.md: the target is
# AdaNewton <= 0.9 x the best of them).
PUBLISHED = ("muon", "you", "polar_express", "cans")
TARGET = 0.9
LABELS = {
    "adanewton": "AdaNewton",
    # A column of summaries measured before the per-matrix selector was removed
    # (docs/adanewton_heldout.json; docs/adanewton.md): rendered as recorded, never measured.
    "adanewton-plain": "no selector",
    "muon": "Muon",
    "you": "You",
    "polar_express": "Polar Express",
    "cans": "CANS",
    "official": "official",
}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HeldoutError(ValueError):
    """Bad input to the held-out evaluation (one line for the user)."""


# ---------------------------------------------------------------------------------- tasks


def default_out() -> Path:
    """Where recordings go unless ``--out`` says otherwise: the user cache, not the repo."""
    from rootopt_analysis.coeffs.fitcache import cache_dir

    return cache_dir() / "heldout"


def task_of(name: str) -> tuple[Any, str]:
    """``(Task, data key)`` for a held-out task name. ``stdlib-large`` is the bench's stdlib
    task with the model and sequence length of ``rootopt train``'s default config."""
    from rootopt.tasks import TASKS

    if name == "stdlib-large":
        from rootopt.config import DataConfig, ModelConfig
        from rootopt.train.models import LlamaLM

        seq = DataConfig().seq_len
        base = TASKS["stdlib"]
        large = dataclasses.replace(
            base,
            name="stdlib-large",
            description="rootopt train's default model (LlamaLM d=128, 4 layers, GQA) on stdlib",
            model=lambda: LlamaLM(ModelConfig(), seq),
            seq_len=seq,
        )
        return large, "stdlib"
    if name not in TASKS or name == "stdlib":
        # stdlib with the bench's d=64 model is the fitting data's corpus and shape family.
        raise HeldoutError(f"unknown held-out task {name!r} (choose from {', '.join(TASK_NAMES)})")
    return TASKS[name], name


# ------------------------------------------------------------------------------ recorder


@contextmanager
def ns_inputs(calls: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """While active, every orthogonalization of ROOT's update — the one
    :func:`rootopt.ortho.direction` call of :mod:`rootopt.optim.functional`, which
    ``root_direction`` makes on each clipped stack for every path (stacked, reference,
    distributed) — appends ``(B, U)`` (copies of its input stack and of its result, the
    latter in float32) to ``calls``.

    The wrapper passes arguments and result through unchanged, so the step is the
    optimizer's own; it is removed on exit. The core's telemetry hook is not used: it
    hands over the momentum before the clip, not the matrix Newton–Schulz receives."""
    from rootopt.optim import functional

    original = getattr(functional, "direction", None)
    if original is None:
        raise RuntimeError(
            "rootopt.optim.functional no longer calls direction; the held-out recorder "
            "must follow the optimizer's step"
        )

    def spy(B: Tensor, *args: Any, **kw: Any) -> Tensor:
        kept = B.detach().clone()  # before the call: what entered the iteration
        U: Tensor = original(B, *args, **kw)
        calls.append((kept, U.detach().to(torch.float32, copy=True)))
        return U

    functional.direction = spy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        functional.direction = original  # type: ignore[attr-defined]


def expected_stacks(
    opt: torch.optim.Optimizer, names: dict[int, str]
) -> list[tuple[int, int, list[tuple[str, int]]]]:
    """The stacks one step of ``opt`` hands to Newton–Schulz, in call order:
    ``(rows, cols, [(parameter name, matrices), ...])``, following the stacked path of
    :func:`rootopt.optim.functional._multi_tensor_root` (groups in order; within a group,
    one stack per shape and state dtype in order of first appearance, which the core may
    cut into consecutive buckets)."""
    from rootopt.optim.functional import matrix_view
    from rootopt.optim.root import algorithm_of, state_dtype

    if getattr(opt, "compile_step", False):
        raise HeldoutError("the recorder follows ROOT's eager step only (compile_step off)")
    out: list[tuple[int, int, list[tuple[str, int]]]] = []
    for group in opt.param_groups:
        by_key: dict[tuple[int, int, torch.dtype], list[tuple[str, int]]] = {}
        for p in group["params"]:
            if p.grad is None or p.numel() == 0 or algorithm_of(group, p) != "root":
                continue
            if not group["batched"] or group.get("ns_split") or group["robust_scaling"]:
                raise HeldoutError("the recorder follows ROOT's default batched step only")
            view = matrix_view(p.shape, group["nd_view"])
            key = (view.rows, view.cols, state_dtype(p))
            by_key.setdefault(key, []).append((names[id(p)], view.batch))
        out += [(r, c, items) for (r, c, _), items in by_key.items()]
    return out


def _stacks_of(
    calls: list[tuple[Tensor, Tensor]], expected: list[tuple[int, int, list[tuple[str, int]]]]
) -> list[tuple[int, int, list[str], Tensor, Tensor]]:
    """Join the captured calls (chunks, in order) into the expected per-shape stacks."""
    out = []
    i = 0
    for rows, cols, items in expected:
        want = sum(b for _, b in items)
        Bs, Us, got = [], [], 0
        while got < want:
            if i >= len(calls):
                raise RuntimeError(
                    f"captured fewer Newton–Schulz inputs than ROOT matrices ({rows}x{cols})"
                )
            B, U = calls[i]
            i += 1
            if tuple(B.shape[-2:]) != (rows, cols):
                raise RuntimeError(
                    f"captured a {tuple(B.shape)} stack where ROOT's step has {rows}x{cols}"
                )
            Bs.append(B.reshape(-1, rows, cols))
            Us.append(U.reshape(-1, rows, cols))
            got += Bs[-1].size(0)
        if got != want:
            raise RuntimeError(f"captured {got} matrices of {rows}x{cols}, expected {want}")
        names = [n if b == 1 else f"{n}[{j}]" for n, b in items for j in range(b)]
        out.append((rows, cols, names, torch.cat(Bs), torch.cat(Us)))
    if i != len(calls):
        raise RuntimeError(
            f"captured {len(calls) - i} Newton–Schulz calls ROOT's step does not make"
        )
    return out


def record_run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Callable[[int], tuple[Tensor, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    steps: int,
    capture: Sequence[int],
    scheduler: Any = None,
) -> tuple[list[dict[str, Any]], list[float]]:
    """Train ``steps`` steps; at the steps in ``capture`` keep every stack that entered
    Newton–Schulz. Returns ``(stacks, train losses)``; a stack is ``{step, rows, cols,
    names, B, U}`` with ``B``/``U`` of shape ``(n, rows, cols)``."""
    names = {id(p): n for n, p in model.named_parameters()}
    stacks: list[dict[str, Any]] = []
    losses: list[float] = []
    want = set(capture)
    for step in range(1, steps + 1):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if step in want:
            calls: list[tuple[Tensor, Tensor]] = []
            expected = expected_stacks(opt, names)
            with ns_inputs(calls):
                opt.step()
            for rows, cols, pnames, B, U in _stacks_of(calls, expected):
                stacks.append(dict(step=step, rows=rows, cols=cols, names=pnames, B=B, U=U))
        else:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        lv = float(loss.detach())
        if not math.isfinite(lv):
            raise RuntimeError(f"the recording run diverged at step {step} (loss {lv})")
        losses.append(lv)
    return stacks, losses


def record_task(name: str, *, seed: int, capture: Sequence[int]) -> dict[str, Any]:
    """One held-out run of task ``name``: ROOT (registry defaults, AdaNewton's float32 schedules), the bench runner's lr
    protocol (registry lr, 10 % warmup, cosine to 0.1× over the run), ``max(capture)``
    steps, seed ``seed`` for the initialisation and the batches."""
    from rootopt.optim.registry import REGISTRY, make_optimizer
    from rootopt.tasks import load_task_data
    from rootopt.train.models import loss_fn
    from rootopt.train.schedule import LRMultiplier

    task, data_key = task_of(name)
    data = load_task_data(data_key)
    steps = max(capture)
    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    model = task.model()
    lr = REGISTRY["root"].lr
    # AdaNewton in float32 explicitly (neither is the default): the directions recorded are
    # then the ones the evaluation's float32 "adanewton" path must reproduce bit for bit
    opt, _ = make_optimizer("root", model, lr=lr, ns_coefficients="adanewton", ns_dtype="float32")
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, LRMultiplier("cosine", warmup=warmup, total=steps, min_ratio=0.1)
    )
    gen = torch.Generator().manual_seed(seed)
    stacks, losses = record_run(
        model,
        opt,
        lambda _step: task.batch(data, gen),
        loss_fn,
        steps=steps,
        capture=capture,
        scheduler=sched,
    )
    root_defaults = {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        for k, v in opt.defaults.items()
        if k.startswith(("ns_", "outlier", "momentum", "nesterov", "weight_decay", "lr_scale"))
    }
    return dict(
        format=RECORD_FORMAT,
        task=name,
        seed=seed,
        capture=list(capture),
        provenance=dict(
            description=task.description,
            steps=steps,
            optimizer="root (rootopt.optim.registry)",
            root_options=root_defaults,
            lr=lr,
            warmup=warmup,
            schedule="cosine to 0.1x",
            batch_size=task.batch_size,
            seq_len=task.seq_len,
            first_loss=losses[0],
            final_loss=losses[-1],
            loss_at_capture={str(s): losses[s - 1] for s in capture},
            record_s=time.perf_counter() - t0,
            record_cpu_s=time.process_time() - c0,
            torch=str(torch.__version__),
            code_version=_git_version(),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        ),
        stacks=stacks,
    )


def recording_path(out: Path, task: str, seed: int) -> Path:
    return out / f"{task}-seed{seed}.pt"


def load_recording(path: Path) -> dict[str, Any]:
    """A recording written by :func:`record_task`; anything else is a :class:`HeldoutError`."""
    try:
        rec = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a file that is not ours
        raise HeldoutError(f"{path} is not a held-out recording ({type(exc).__name__})") from None
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
        raise HeldoutError(f"{path} is not a held-out recording (format {RECORD_FORMAT})")
    return rec


def _save_new(path: Path, obj: dict[str, Any]) -> None:
    """``torch.save`` into a new file at ``path`` via a temporary file; an existing file is
    never replaced (the final link fails instead)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        try:
            os.link(tmp, path)  # fails if path exists: never overwrites
        except FileExistsError:
            raise HeldoutError(f"{path} appeared while recording; left untouched") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def recordings(
    out: Path, tasks: Sequence[str], seed: int, capture: Sequence[int], log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Each task's recording from ``out``, recorded first where missing. A file there with
    other settings (seed, capture steps) is refused, never replaced."""
    found: dict[str, dict[str, Any] | None] = {}
    for name in tasks:  # check everything before the first run or write
        path = recording_path(out, name, seed)
        if not path.exists():
            found[name] = None
            continue
        rec = load_recording(path)
        if (
            rec.get("task") != name
            or rec.get("seed") != seed
            or rec.get("capture") != list(capture)
        ):
            raise HeldoutError(
                f"{path} was recorded with other settings (task {rec.get('task')}, seed "
                f"{rec.get('seed')}, capture steps {rec.get('capture')}); choose another --out"
            )
        found[name] = rec
    out.mkdir(parents=True, exist_ok=True)
    result = []
    for name in tasks:
        known = found[name]
        if known is None:
            log(f"recording {name} (seed {seed}, steps {','.join(map(str, capture))}) ...")
            rec = record_task(name, seed=seed, capture=capture)
            path = recording_path(out, name, seed)
            _save_new(path, rec)
            prov = rec["provenance"]
            log(
                f"  {name}: {sum(s['B'].size(0) for s in rec['stacks'])} matrices, loss "
                f"{prov['first_loss']:.3f} -> {prov['final_loss']:.3f}, {prov['record_s']:.0f}s"
            )
        else:
            log(f"using the recording of {name} in {recording_path(out, name, seed)}")
            rec = known
        result.append(rec)
    return result


# ----------------------------------------------------------------------------- evaluator


def schedules() -> list[str]:
    """The schedules evaluated here: :data:`SCHEDULES` less those this rootopt lacks."""
    from rootopt.coeffs import available

    have = set(available())
    return [s for s in SCHEDULES if s in have]


class NSPath(NamedTuple):
    """What ROOT's stacked step hands to ``root_direction`` for one shape."""

    schedule: Any
    method: OrthoMethod
    dtype: torch.dtype  # the iteration dtype
    gram: GramMode
    certified: bool  # False: the optimizer refuses it; run as published
    resolved: str  # where the schedule came from (Resolution.describe())


@cache
def optimizer_path(name: str, dtype: str, rows: int, cols: int) -> NSPath:
    """The orthogonalization of a ROOT with ``ns_coefficients=name`` and ``ns_dtype=dtype``
    (other options at their defaults) for a ``rows x cols`` matrix, obtained as its step
    obtains it: a ROOT built for that matrix, the group's options as the update sees them
    (``root_options``) and the group's ``(rows, cols) -> schedule`` lookup
    (``coefficients_for``). A published schedule the optimizer refuses for this dtype (CANS
    in bfloat16 fails the certificate) is run as published, ``certified=False``."""
    from rootopt import ROOT
    from rootopt.coeffs import CoefficientError
    from rootopt.coeffs.presets import NAMED_SETS
    from rootopt.optim._coefficients import coefficients_for
    from rootopt.optim._options import _lr, root_options

    cpu = torch.device("cpu")
    try:
        opt = ROOT([torch.zeros(rows, cols)], ns_coefficients=name, ns_dtype=dtype, ns_steps=K)
    except CoefficientError as exc:
        if name not in NAMED_SETS:
            raise
        return NSPath(
            NAMED_SETS[name].schedule(K), "newton_schulz", _TORCH_DTYPES[dtype], None, False,
            f"refused: {exc}",
        )  # fmt: skip
    group = opt.param_groups[0]
    o = root_options(group, cpu, _lr(group))
    schedule = coefficients_for(opt._coeffs, group, cpu)(rows, cols)
    (res,) = opt.coefficient_resolutions()
    return NSPath(schedule, o.method, o.ns_dtype, o.gram, True, res.describe())


def directions(B: Tensor, name: str, dtype: str) -> Tensor:
    """Schedule ``name``'s K-step Newton–Schulz result for the stack ``B`` (``(n, rows,
    cols)``, already clipped), iterated in ``dtype`` by the optimizer's own call
    (``root_direction`` with the schedule and options of :func:`optimizer_path`; no second
    clip), in float32 (the values of a bfloat16 iteration stay bfloat16 numbers, as the
    step adds them to the parameters)."""
    from rootopt.optim.functional import root_direction

    path = optimizer_path(name, dtype, B.size(-2), B.size(-1))
    U = root_direction(
        B,
        path.schedule,
        quantile=None,  # B is the clipped matrix the step orthogonalized
        method=path.method,
        dtype=path.dtype,
        gram=path.gram,
    )
    return U.float()


def gram_statistic(B: Tensor) -> float:
    """``m·s``, ``m = min(rows, cols)``, ``s = ||X₀X₀ᵀ||_F² = Σσ⁴/(Σσ²)²``, in float64: how
    concentrated the spectrum is, ``m`` over an effective rank (1 for a flat spectrum of
    full rank, ``m`` for rank one), reported per matrix to describe the data."""
    S2 = torch.linalg.svdvals(B.double()).square()
    return float(min(B.shape) * S2.square().sum() / S2.sum().square())


def polar_reference(B: Tensor) -> tuple[Tensor, int]:
    """``(U_r V_rᵀ, r)`` of one matrix from a float64 SVD, over its numerically nonzero
    singular values (Newton–Schulz maps an exact zero to zero)."""
    U, S, Vh = torch.linalg.svd(B.double(), full_matrices=False)
    tol = float(S.max()) * max(B.shape) * torch.finfo(torch.float64).eps
    r = int((tol < S).sum())
    return U[:, :r] @ Vh[:r], r


def relative_error(X: Tensor, P: Tensor) -> float:
    """``||X − P||_F / ||P||_F`` in float64."""
    return float(torch.linalg.matrix_norm(X.double() - P) / torch.linalg.matrix_norm(P))


def evaluate(
    recs: Sequence[dict[str, Any]], names: Sequence[str], log: Callable[[str], None] = print
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-matrix errors of every schedule and dtype, and the check that AdaNewton's float32
    directions equal those the optimizer computed while recording."""
    rows_out: list[dict[str, Any]] = []
    same, stacks, worst_diff = 0, 0, 0.0
    for rec in recs:
        t0 = time.perf_counter()
        for st in rec["stacks"]:
            B: Tensor = st["B"]
            errs: dict[str, dict[str, list[float]]] = {}
            refs = [polar_reference(b) for b in B]
            for dtype in DTYPES:
                errs[dtype] = {}
                for name in names:
                    X = directions(B, name, dtype)
                    if name == "adanewton" and dtype == "float32":
                        stacks += 1
                        same += int(torch.equal(X, st["U"]))
                        worst_diff = max(worst_diff, float((X - st["U"]).abs().max()))
                    errs[dtype][name] = [
                        relative_error(x, P) for x, (P, _) in zip(X, refs, strict=True)
                    ]
            for i, pname in enumerate(st["names"]):
                rows_out.append(
                    dict(
                        task=rec["task"],
                        step=st["step"],
                        name=pname,
                        rows=st["rows"],
                        cols=st["cols"],
                        rank=refs[i][1],
                        ms=gram_statistic(B[i]),
                        err={d: {n: errs[d][n][i] for n in names} for d in DTYPES},
                    )
                )
        log(f"evaluated {rec['task']} in {time.perf_counter() - t0:.0f}s")
    check = dict(stacks=stacks, identical=same, max_abs_diff=worst_diff)
    return rows_out, check


# -------------------------------------------------------------------------------- report


def _layer(name: str) -> str:
    """``blocks.2.attn.wq.weight`` -> ``attn.wq``: a parameter's role without its block."""
    parts = name.split("[")[0].split(".")
    if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit():
        parts = parts[2:]
    if parts[-1] == "weight" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def summarize(
    matrices: Sequence[dict[str, Any]], names: Sequence[str], certified: dict[str, dict[str, bool]]
) -> list[dict[str, Any]]:
    """Per (task, shape) and dtype, plus an "all" row per dtype: median and worst error of
    each schedule, AdaNewton's ratios to the best published schedule and the count of
    matrices where AdaNewton is at most 0.9× the best published schedule on that matrix."""
    keys: list[tuple[str, int, int]] = []
    for m in matrices:
        k = (m["task"], m["rows"], m["cols"])
        if k not in keys:
            keys.append(k)
    groups: list[dict[str, Any]] = []
    for dtype in DTYPES:
        sets: list[tuple[str, str, list[str], list[dict[str, Any]]]] = []
        for task, r, c in keys:
            ms = [m for m in matrices if (m["task"], m["rows"], m["cols"]) == (task, r, c)]
            layers = sorted({_layer(m["name"]) for m in ms})
            sets.append((task, f"{r}x{c}", layers, ms))
        sets.append(("all", "", [], list(matrices)))
        for task, shape, layers, ms in sets:
            stats = {}
            for n in names:
                e = [m["err"][dtype][n] for m in ms]
                stats[n] = dict(median=_median(e), worst=max(e))
            pub = [p for p in PUBLISHED if p in names]
            # The same ratio against the published schedules the optimizer accepts in
            # this dtype (CANS fails the bfloat16 certificate).
            pub_ok = [p for p in pub if certified[dtype][p]]
            best_ok = min(pub_ok, key=lambda p: stats[p]["median"])
            best_med = min(pub, key=lambda p: stats[p]["median"])
            best_worst = min(pub, key=lambda p: stats[p]["worst"])
            met = sum(
                m["err"][dtype]["adanewton"] <= TARGET * min(m["err"][dtype][p] for p in pub)
                for m in ms
            )
            groups.append(
                dict(
                    dtype=dtype,
                    task=task,
                    shape=shape,
                    layers=layers,
                    n=len(ms),
                    ms_median=_median([m["ms"] for m in ms]),
                    stats=stats,
                    best_median=best_med,
                    ratio_median=stats["adanewton"]["median"] / stats[best_med]["median"],
                    best_worst=best_worst,
                    ratio_worst=stats["adanewton"]["worst"] / stats[best_worst]["worst"],
                    met=met,
                    best_median_certified=best_ok,
                    ratio_median_certified=stats["adanewton"]["median"] / stats[best_ok]["median"],
                    uncertified=[n for n in names if not certified[dtype][n]],
                )
            )
    return groups


def _g(x: float) -> str:
    if x >= 10:
        return f"{x:.1e}"
    return f"{x:.3f}" if x >= 0.0995 else f"{x:.2g}" if x < 0.001 else f"{x:.4f}"


def render_markdown(summary: dict[str, Any]) -> str:
    """The report's tables (one per dtype), as written into docs/adanewton.md: a column per
    schedule of ``summary["schedules"]``. A summary measured with the removed per-matrix
    selector (docs/adanewton_heldout.json) also has its "spiky" counts, shown as recorded."""
    names = [n for n in summary["schedules"] if n != "official"]
    out = []
    for dtype in DTYPES:
        rows = [g for g in summary["groups"] if g["dtype"] == dtype]
        if not rows:
            continue
        spiky = ["spiky"] if all("spiky" in g for g in rows) else []
        head = ["task", "shape", "layers", "n", *spiky] + [LABELS[n] for n in names]
        head += ["ratio (median)", "ratio (worst)", f"≤ {TARGET}× per matrix"]
        out.append(f"**{dtype} iterations** (median / worst relative polar error):\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for g in rows:
            cells = [
                g["task"],
                g["shape"].replace("x", "×"),
                ", ".join(g["layers"]),
                str(g["n"]),
                *(str(g[k]) for k in spiky),
            ]
            for n in names:
                s = g["stats"][n]
                cell = f"{_g(s['median'])} / {_g(s['worst'])}"
                cells.append(f"{cell}*" if n in g["uncertified"] else cell)
            cells += [
                f"{g['ratio_median']:.2f} ({LABELS[g['best_median']]})",
                f"{g['ratio_worst']:.2f} ({LABELS[g['best_worst']]})",
                f"{g['met']}/{g['n']}",
            ]
            if g["task"] == "all":
                cells = [f"**{c}**" if c else c for c in cells]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _git_version() -> str:
    from rootopt_analysis.coeffs.build import _git_version as version

    return version()


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def run(
    *,
    out: Path,
    tasks: Sequence[str],
    seed: int,
    capture: Sequence[int],
    command: str,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Record (where missing) and evaluate; returns the summary (see :data:`SUMMARY_FORMAT`)."""
    names = schedules()
    skipped = [s for s in SCHEDULES if s not in names]
    if skipped:
        log(f"not offered by this rootopt, skipped: {', '.join(skipped)}")
    coeffs_log = logging.getLogger("rootopt.coeffs")
    level = coeffs_log.level
    # Every shape here is resolved by generalising or by the nearest entry, logged at
    # WARNING each; the summary lists the resolutions instead.
    coeffs_log.setLevel(logging.ERROR)
    try:
        t0 = time.perf_counter()
        recs = recordings(out, tasks, seed, capture, log)
        t1 = time.perf_counter()
        matrices, check = evaluate(recs, names, log)
    finally:
        coeffs_log.setLevel(level)
    # A published schedule the optimizer refuses on any evaluated shape counts as refused.
    shapes = sorted({(m["rows"], m["cols"]) for m in matrices})
    certified = {
        d: {n: all(optimizer_path(n, d, r, c).certified for r, c in shapes) for n in names}
        for d in DTYPES
    }
    groups = summarize(matrices, names, certified)
    resolutions = {
        f"{r}x{c}": {d: optimizer_path("adanewton", d, r, c).resolved for d in DTYPES}
        for r, c in shapes
    }
    return dict(
        format=SUMMARY_FORMAT,
        provenance=dict(
            command=command,
            seed=seed,
            capture_steps=list(capture),
            tasks=list(tasks),
            K=K,
            recordings={
                r["task"]: {
                    k: r["provenance"][k]
                    for k in (
                        "steps",
                        "lr",
                        "first_loss",
                        "final_loss",
                        "record_s",
                        "record_cpu_s",
                        "code_version",
                    )
                    if k in r["provenance"]
                }
                for r in recs
            },
            code_version=_git_version(),
            torch=str(torch.__version__),
            python=platform.python_version(),
            machine=_machine(),
            threads=torch.get_num_threads(),
            record_s=round(t1 - t0, 1),
            evaluate_s=round(time.perf_counter() - t1, 1),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        ),
        schedules=names,
        skipped=skipped,
        published=[p for p in PUBLISHED if p in names],
        target=TARGET,
        certified=certified,
        # None of these shapes is in the paper's table: "official" is Muon's tuple.
        official_equals_muon=all(
            m["err"][d].get("official") == m["err"][d].get("muon") for m in matrices for d in DTYPES
        ),
        adanewton_resolutions=resolutions,
        optimizer_check=check,
        groups=groups,
        matrices=[
            {
                **m,
                "ms": float(f"{m['ms']:.4g}"),
                "err": {
                    d: {n: float(f"{v:.4g}") for n, v in e.items()} for d, e in m["err"].items()
                },
            }
            for m in matrices
        ],
    )


def dumps_summary(summary: dict[str, Any]) -> str:
    """The summary as JSON: indented, one line per matrix (about 90 KB for the default run)."""
    body = {k: v for k, v in summary.items() if k != "matrices"}
    rows = ",\n".join("  " + json.dumps(m, separators=(",", ":")) for m in summary["matrices"])
    return json.dumps(body, indent=1)[:-2] + ',\n "matrices": [\n' + rows + "\n ]\n}\n"


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"steps must be positive integers like 25,100,200, got {text!r}"
        ) from None
    if not steps or steps[0] < 1:
        raise argparse.ArgumentTypeError(
            f"steps must be positive integers like 25,100,200, got {text!r}"
        )
    return steps


def _tasks(text: str) -> tuple[str, ...]:
    names = tuple(t for t in text.split(",") if t)
    bad = [t for t in names if t not in TASK_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown task {bad[0] if bad else text!r} (choose from {', '.join(TASK_NAMES)})"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="rootopt coeffs heldout",
        description="Held-out polar error of Newton–Schulz schedules on matrices recorded "
        "from short ROOT training runs (docs/adanewton.md).",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory of the recorded matrices (reused when present; default: the rootopt "
        "cache directory's heldout/)",
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--tasks", type=_tasks, default=TASK_NAMES, help=",".join(TASK_NAMES))
    ap.add_argument(
        "--steps", type=_steps, default=CAPTURE_STEPS, help="capture steps (the run lasts the last)"
    )
    ap.add_argument("--json", type=new_file, default=None, help="write the summary (a new file)")
    ap.add_argument(
        "--markdown", type=new_file, default=None, help="write the report tables (a new file)"
    )
    a = ap.parse_args(list(argv) if argv is not None else None)
    out = a.out if a.out is not None else default_out()
    if out.exists() and not out.is_dir():
        print(f"rootopt coeffs heldout: --out {out} exists and is not a directory", file=sys.stderr)
        return 2
    from rootopt._threads import one_thread

    command = "rootopt coeffs heldout " + " ".join(argv if argv is not None else sys.argv[1:])
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with one_thread():
            summary = run(
                out=out, tasks=a.tasks, seed=a.seed, capture=a.steps, command=command.strip()
            )
    except HeldoutError as exc:
        print(f"rootopt coeffs heldout: {exc}", file=sys.stderr)
        return 2
    summary["provenance"]["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["provenance"]["cpu_s"] = round(time.process_time() - c0, 1)
    text = render_markdown(summary)
    print(text)
    chk = summary["optimizer_check"]
    print(
        f"AdaNewton float32 through the optimizer's path: {chk['identical']}/{chk['stacks']} "
        f"stacks bit-identical to the directions computed while recording "
        f"(max |diff| {chk['max_abs_diff']:.2g}); {summary['provenance']['wall_s']:.0f}s"
    )
    if a.json is not None:
        with open(a.json, "x", encoding="utf-8") as fh:  # never replaces a file
            fh.write(dumps_summary(summary))
    if a.markdown is not None:
        with open(a.markdown, "x", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
