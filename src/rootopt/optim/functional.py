"""ROOT's update as pure tensor functions: the one core every path calls.

The update of the paper's official code (arXiv 2511.20626; reference numerics in
docs/performance.md, "One update, every path"), per weight matrix::

    buf  = mu * buf + g                          sum-form momentum
    v    = g + mu * buf  (nesterov)  else buf
    eps  = quantile(|v|, q) + 1e-9               per matrix, every step
    B    = clamp(v, -eps, eps)                   = v - O, O = sign(v) relu(|v| - eps)
    U    = NS_K(B)                               orthogonalized on the wide orientation
    p    = p (1 - lr wd) - lr * s(rows, cols) * U

Three units do it, on lists and stacks: :func:`momentum_`, :func:`root_direction`
(threshold → Newton–Schulz, or SVD / QR; the threshold is :func:`outlier_threshold`, the one
definition every path and the telemetry use) and
:func:`apply_` (decay and scaled step). :func:`_single_tensor_root` writes the update
plainly for one parameter, one matrix at a time: the reference. :func:`_multi_tensor_root`
stacks matrices of one shape (a fused projection's Q/K/V blocks are just more entries of a
stack) into buckets and calls the units once per bucket; it and every other path
(compiled, distributed, sharded) are tested equal to the reference on parameters and state
(``tests/test_paths.py``). :class:`rootopt.ROOT` only gathers state and calls these.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rootopt.coeffs import Coeff
from rootopt.optim.quantile import abs_quantile
from rootopt.ortho import GramMode, direction

# Added to the quantile so that an all-zero matrix has a positive threshold (official code).
THRESHOLD_EPS = 1e-9

LrScale = Literal["moonlight", "muon", "none"]
NDView = Literal["auto", "flatten", "batch"]
OrthoMethod = Literal["newton_schulz", "svd", "qr"]
# (rows, cols) of a matrix -> its schedule (resolved ahead)
CoefficientsFor = Callable[[int, int], Sequence[Coeff]]


# ---------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatrixView:
    """How an N-D parameter is seen as ``batch`` matrices of ``rows x cols``."""

    batch: int
    rows: int
    cols: int


def matrix_view(shape: Sequence[int], nd_view: NDView = "auto") -> MatrixView:
    """2-D: itself. 3-D with ``auto``/``batch``: a stack (experts, heads). Otherwise
    (conv weights, ``flatten``): ``(out, prod(rest))``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"ROOT needs a tensor with >= 2 dims, got shape {shape}")
    if len(shape) == 2:
        return MatrixView(1, shape[0], shape[1])
    if nd_view == "batch" or (nd_view == "auto" and len(shape) == 3):
        return MatrixView(math.prod(shape[:-2]), shape[-2], shape[-1])
    return MatrixView(1, shape[0], math.prod(shape[1:]))


def lr_scale_factor(rows: int, cols: int, mode: LrScale) -> float:
    """Shape-dependent multiplier of the orthogonal update.

    ``moonlight``: 0.2·sqrt(max(rows, cols)) matches AdamW's update RMS (Moonlight,
    arXiv 2502.16982; the official ROOT code). ``muon``: sqrt(max(1, rows/cols)) (Keller
    Jordan's Muon). ``none``: 1.
    """
    if mode == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "muon":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "none":
        return 1.0
    raise ValueError(f"lr_scale={mode!r} is unknown; choose 'moonlight', 'muon' or 'none'")


@dataclass(frozen=True)
class RootOptions:
    """One parameter group's options as the update needs them (for one device)."""

    lr: float | Tensor
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    quantile: float | None = 0.9
    method: OrthoMethod = "newton_schulz"
    ns_dtype: torch.dtype = torch.float32
    gram: GramMode = None
    lr_scale: LrScale = "moonlight"
    transposed: bool = False  # weights stored (in, out): the fan-out is the second dim
    nd_view: NDView = "auto"
    robust_window: int = 100
    robust_lambda: float = 0.1
    bucket_bytes: int = 32 << 20  # most bytes of float32 matrices per stack; 0: no limit

    def scale(self, rows: int, cols: int) -> float:
        """``s(rows, cols)`` of a matrix as stored."""
        fan = (cols, rows) if self.transposed else (rows, cols)
        return lr_scale_factor(*fan, self.lr_scale)


@dataclass(frozen=True)
class Matrix:
    """Matrices ``start .. start+batch`` of a parameter's view, or one fused block
    ``(dim, offset, size)`` of a 2-D weight, with its step scale ``s``."""

    batch: int
    rows: int
    cols: int
    scale: float
    start: int = 0
    block: tuple[int, int, int] | None = None

    def of(self, t: Tensor, view: MatrixView) -> Tensor:
        """Its ``(batch, rows, cols)`` part of a parameter-shaped ``t`` (a view of a
        contiguous ``t``; reading only otherwise)."""
        if self.block is not None:
            dim, offset, size = self.block
            return t.narrow(dim, offset, size).unsqueeze(0)
        return t.reshape(view.batch, view.rows, view.cols).narrow(0, self.start, self.batch)


def matrices(view: MatrixView, o: RootOptions, blocks: Sequence[int] | None) -> list[Matrix]:
    """The matrices ROOT orthogonalizes in a parameter: its view, or the blocks of a fused
    projection (``ns_split``: Q/K/V or gate/up output sizes, each orthogonalized and scaled
    as the matrix it would be unfused; docs/integrations.md, "Fused projections")."""
    if blocks is None:
        return [Matrix(view.batch, view.rows, view.cols, o.scale(view.rows, view.cols))]
    out, offset, dim = [], 0, 1 if o.transposed else 0
    for n in blocks:
        rows, cols = (view.rows, n) if o.transposed else (n, view.cols)
        out.append(Matrix(1, rows, cols, o.scale(rows, cols), block=(dim, offset, n)))
        offset += n
    return out


# ---------------------------------------------------------------------------------------
# the three units
# ---------------------------------------------------------------------------------------
def momentum_(
    bufs: list[Tensor],
    grads: list[Tensor],
    *,
    momentum: float,
    nesterov: bool,
    out: Sequence[Tensor | None] | None = None,
) -> list[Tensor]:
    """``buf = mu buf + g`` in place (sum form, as the official code); returns the vectors
    to orthogonalize: ``g + mu buf`` (Nesterov; written into ``out[i]`` where given, else
    new tensors) or the buffers themselves. ``grads`` in the buffers' dtype."""
    if bufs and bufs[0].device.type == "cpu" and not torch.compiler.is_compiling():
        # One pass per buffer (g + mu buf, fused): on the CPU a pass over memory costs more
        # than a call; on an accelerator the two _foreach calls are two launches in all.
        for b, g in zip(bufs, grads):
            torch.add(g, b, alpha=momentum, out=b)
    else:
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads)
    if not nesterov:
        return list(bufs)
    if out is None or all(o is None for o in out):
        return list(torch._foreach_add(grads, bufs, alpha=momentum))
    return [
        g.add(b, alpha=momentum) if o is None else torch.add(g, b, alpha=momentum, out=o)
        for g, b, o in zip(grads, bufs, out)
    ]


def robust_moments_(
    means: list[Tensor], sqs: list[Tensor], grads: list[Tensor], *, window: int
) -> None:
    """Running (EMA) estimates of ``E[g]`` and ``E[g²]`` with factor ``1 - 1/window``."""
    beta = 1.0 - 1.0 / window
    torch._foreach_lerp_(means, grads, 1 - beta)
    torch._foreach_mul_(sqs, beta)
    torch._foreach_addcmul_(sqs, grads, grads, value=1 - beta)


def robust_scale(
    U: Tensor,
    mean: Tensor,
    sq: Tensor,
    *,
    bias_correction: float | Tensor,
    lam: float,
    eps: float = 1e-8,
) -> Tensor:
    """Per-element robust scaling (an option beyond the paper; docs/performance.md,
    "One update, every path"), made norm-preserving.

    ``mean`` / ``sq`` are running estimates of E[g] and E[g²] (bias corrected by
    ``bias_correction = 1 - beta^t``), so ``delta = sqrt(E[g²] - E[g]²)``; then
    ``sigma = 1 / (|mu| + lam delta + eps)``. The update becomes
    ``U ⊙ sigma · ||U||_F / ||U ⊙ sigma||_F`` per matrix: the same Frobenius norm as ``U``
    (so the lr keeps its meaning), redistributed towards entries whose gradient is small and
    steady relative to its noise; the result is no longer orthogonal.
    """
    mu = mean / bias_correction
    var = (sq / bias_correction - mu * mu).clamp_min(0.0)
    sigma = 1.0 / (mu.abs() + lam * var.sqrt() + eps)
    S = U * sigma.reshape(U.shape)
    dims = (-2, -1)
    ratio = U.norm(dim=dims, keepdim=True) / S.norm(dim=dims, keepdim=True).clamp_min(1e-30)
    scaled: Tensor = S * ratio
    return scaled


def outlier_threshold(M: Tensor, quantile: float) -> Tensor:
    """ROOT's threshold per matrix of ``M`` (``(rows, cols)`` or a stack ``(batch, rows,
    cols)``): ``eps = quantile(|M|, q) + 1e-9`` (the official code's), float32, shaped
    ``(1, 1)`` / ``(batch, 1, 1)``. The clip is ``clamp(M, -eps, eps)``: the kept part ``B``
    of ``M = B + O``, the outliers ``O = sign(M) relu(|M| - eps)`` dropped."""
    return abs_quantile(M, quantile).add_(THRESHOLD_EPS)


def root_direction(
    V: Tensor,
    schedule: Sequence[Coeff],
    *,
    quantile: float | None,
    method: OrthoMethod = "newton_schulz",
    dtype: torch.dtype = torch.float32,
    gram: GramMode = None,
    thresholds: list[Tensor] | None = None,
) -> Tensor:
    """``U`` for a matrix or a stack ``(batch, rows, cols)``: each matrix clipped at its own
    threshold (:func:`outlier_threshold`; in place on ``V``; ``quantile=None``: no clip),
    then :func:`rootopt.ortho.direction` — Newton–Schulz with ``schedule`` in ``dtype``, or
    the SVD / QR factor (float32). Returns ``V``'s shape,
    contiguous, in the iteration dtype. ``rootopt.orthogonalize`` is this without the clip.
    ``thresholds``: where given, the thresholds the clip used are appended to it (the
    values telemetry reports).
    """
    if quantile is not None:  # the clamp is V - sign(V) relu(|V| - eps), in one pass
        eps = outlier_threshold(V, quantile)
        if thresholds is not None:
            thresholds.append(eps)
        if V.device.type == "cpu" and not torch.compiler.is_compiling():
            # Python bounds per matrix: several times faster than broadcast tensor bounds
            # on the CPU, where reading eps is no synchronisation.
            for Vi, e in zip(V.unbind(0) if V.ndim == 3 else (V,), eps.flatten().tolist()):
                Vi.clamp_(-e, e)
        else:
            V = V.clamp_(min=-eps, max=eps)
    if method != "newton_schulz":
        dtype = torch.float32
    return direction(V, schedule, method=method, dtype=dtype, gram=gram)


def apply_(
    params: list[Tensor],
    updates: list[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float,
    scales: Sequence[float],
) -> None:
    """``p = p (1 - lr wd) - lr s U`` per parameter: decoupled decay with the unscaled lr,
    then the step scaled by its ``s`` (one ``_foreach`` call per distinct ``s``).
    Float32/float64 parameters in place; lower precision in float32, rounded once."""
    if not params:
        return
    work = [p if p.dtype in (torch.float32, torch.float64) else p.float() for p in params]
    torch._foreach_mul_(work, 1 - lr * weight_decay)
    by_scale: dict[float, list[int]] = {}
    for i, s in enumerate(scales):
        by_scale.setdefault(s, []).append(i)
    for s, idx in by_scale.items():
        ws, us = [work[i] for i in idx], [updates[i] for i in idx]
        if isinstance(lr, Tensor):  # a tensor lr in a compiled step: no Python scalar
            torch._foreach_sub_(ws, torch._foreach_mul(us, lr * s))
        else:
            torch._foreach_add_(ws, us, alpha=-lr * s)
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)


# ---------------------------------------------------------------------------------------
# the reference: one parameter, one matrix at a time
# ---------------------------------------------------------------------------------------
# (param index, matrix, M before the clip, its thresholds eps as (batch, 1, 1) or None
# without a clip, U), M and U as (batch, rows, cols); for telemetry
Record = Callable[[int, "Matrix", Tensor, Tensor | None, Tensor], None]


def _single_tensor_root(
    p: Tensor,
    grad: Tensor,
    buf: Tensor,
    step: Tensor,
    o: RootOptions,
    coefficients: CoefficientsFor,
    *,
    blocks: Sequence[int] | None = None,
    robust: tuple[Tensor, Tensor] | None = None,
    record: Record | None = None,
) -> None:
    """One ROOT step for one parameter, in place: the paper's update, plainly (ground
    truth). ``step`` already counts this step."""
    g = grad.to(buf.dtype)
    buf.mul_(o.momentum).add_(g)  # 1. momentum, sum form
    v = g + o.momentum * buf if o.nesterov else buf
    beta = 1.0 - 1.0 / o.robust_window
    if robust is not None:  # (option) running moments of g for robust scaling
        robust[0].lerp_(g, 1 - beta)
        robust[1].mul_(beta).addcmul_(g, g, value=1 - beta)
    view = matrix_view(p.shape, o.nd_view)
    update = torch.zeros(p.shape, dtype=buf.dtype, device=p.device)
    for m in matrices(view, o, blocks):
        for j in range(m.batch):  # one matrix at a time
            M = m.of(v, view)[j]
            B, eps = M, None
            if o.quantile is not None:  # 2. threshold: clamp at the per-matrix quantile
                eps = outlier_threshold(M, o.quantile)
                B = M.clamp(-eps, eps)
            schedule = coefficients(m.rows, m.cols)
            dtype = o.ns_dtype if o.method == "newton_schulz" else torch.float32
            U = direction(B, schedule, method=o.method, dtype=dtype, gram=o.gram)
            if record is not None:
                record(0, m, M[None], None if eps is None else eps[None], U[None])
            if robust is not None:  # (option) robust per-element scaling
                U = robust_scale(
                    U[None],
                    m.of(robust[0], view)[j : j + 1],
                    m.of(robust[1], view)[j : j + 1],
                    bias_correction=1.0 - beta ** _count(step),
                    lam=o.robust_lambda,
                )[0]
            m.of(update, view)[j] = U * m.scale  # 3. orthogonalized and scaled
    p32 = p if p.dtype in (torch.float32, torch.float64) else p.float()
    p32.mul_(1 - o.lr * o.weight_decay)  # 4. decoupled decay, unscaled lr
    p32.sub_(o.lr * update)  # 5. the step
    if p32 is not p:
        p.copy_(p32)


# ---------------------------------------------------------------------------------------
# the batched path: stacks of same-shape matrices
# ---------------------------------------------------------------------------------------
def _buckets(
    entries: list[tuple[int, Matrix]], keys: Sequence[Hashable], budget: int
) -> list[list[tuple[int, Matrix]]]:
    """Entries of one key (shape, dtype) in runs of at most ``budget`` bytes of float32
    matrices; a larger stack is cut into pieces of that size."""
    by_key: dict[Hashable, tuple[int, list[tuple[int, Matrix]]]] = {}
    for (i, m), key in zip(entries, keys):
        per = max(1, budget // (m.rows * m.cols * 4)) if budget > 0 else 1 << 62
        pieces = [
            Matrix(min(per, m.batch - s), m.rows, m.cols, m.scale, m.start + s, m.block)
            for s in range(0, m.batch, per)
        ]
        by_key.setdefault(key, (per, []))[1].extend((i, piece) for piece in pieces)
    out: list[list[tuple[int, Matrix]]] = []
    for per, items in by_key.values():
        cur: list[tuple[int, Matrix]] = []
        for item in items:
            if cur and sum(m.batch for _, m in cur) + item[1].batch > per:
                out.append(cur)
                cur = []
            cur.append(item)
        out.append(cur)
    return out


def _directions(
    shapes: list[torch.Size],
    dtypes: list[torch.dtype],
    o: RootOptions,
    coefficients: CoefficientsFor,
    open_: Callable[[list[int], list[Tensor | None]], tuple[list[Tensor], bool]],
    *,
    device: torch.device,
    blocks: Sequence[Sequence[int] | None] | None = None,
    record: Record | None = None,
) -> Iterator[tuple[list[int], list[Tensor], list[float]]]:
    """Stack the matrices of same-shape parameters bucket by bucket and yield, per bucket,
    the parameters it finished: ``(indices, updates U shaped like them, scales s)`` (a
    fused block's ``s`` is folded into its part of ``U``; its scale is then 1). ``dtypes``:
    each parameter's state dtype (stacks hold one dtype).

    ``open_(indices, out)`` returns the vectors to orthogonalize of those parameters (their
    first bucket is being stacked), written into ``out[i]`` where it is given (their place
    in the stack), and whether they are private copies (then clipped in place where no
    stack copy is needed)."""
    views = [matrix_view(s, o.nd_view) for s in shapes]
    entries = [
        (i, m)
        for i, view in enumerate(views)
        for m in matrices(view, o, None if blocks is None else blocks[i])
    ]
    keys = [(m.rows, m.cols, dtypes[i]) for i, m in entries]
    buckets = _buckets(entries, keys, o.bucket_bytes)
    remaining = Counter(i for bucket in buckets for i, _ in bucket)
    vs: dict[int, Tensor] = {}
    private = False
    parts_of: dict[int, Tensor] = {}
    # On the CPU a whole parameter's vector is written straight into its place in the stack
    # (no stack copy); elsewhere one cat per stack (one launch).
    into_stack = device.type == "cpu" and not torch.compiler.is_compiling()
    for bucket in buckets:
        first, (rows, cols) = bucket[0][0], (bucket[0][1].rows, bucket[0][1].cols)
        new = list(dict.fromkeys(i for i, _ in bucket if i not in vs))
        slots: dict[int, Tensor] = {}
        if into_stack:
            total = sum(m.batch for _, m in bucket)
            V = torch.empty((total, rows, cols), dtype=dtypes[first], device=device)
            off = 0
            for i, m in bucket:
                if i in new and m.block is None and m.batch == views[i].batch:
                    slots[i] = V.narrow(0, off, m.batch).view(shapes[i])
                off += m.batch
        if new:
            opened, private = open_(new, [slots.get(i) for i in new])
            vs.update(zip(new, opened))
            slots = {i: t for i, t in slots.items() if vs[i] is t}  # written in place
        if into_stack:
            off = 0
            for i, m in bucket:
                if i not in slots:
                    V.narrow(0, off, m.batch).copy_(m.of(vs[i], views[i]))
                off += m.batch
        else:
            parts = [m.of(vs[i], views[i]) for i, m in bucket]
            V = parts[0] if len(parts) == 1 and private else torch.cat(parts)
        M = V.clone() if record is not None else None
        thresholds: list[Tensor] = []
        U = root_direction(
            V, coefficients(rows, cols), quantile=o.quantile, method=o.method,
            dtype=o.ns_dtype, gram=o.gram, thresholds=thresholds if record else None,
        )  # fmt: skip
        eps = thresholds[0] if thresholds else None
        if U.dtype != dtypes[first] and U.device.type != "cpu":
            # one cast per stack keeps the step's _foreach calls on their fused path
            U = U.to(dtypes[first])
        done: list[int] = []
        updates: list[Tensor] = []
        scales: list[float] = []
        off = 0
        for i, m in bucket:
            Um = U.narrow(0, off, m.batch)
            if record is not None and M is not None:
                e = None if eps is None else eps.narrow(0, off, m.batch)
                record(i, m, M.narrow(0, off, m.batch), e, Um)
            off += m.batch
            remaining[i] -= 1
            whole = m.block is None and m.batch == views[i].batch
            if not whole:  # a fused block or a piece of a large stack: assemble
                full = parts_of.get(i)
                if full is None:
                    full = parts_of[i] = torch.empty(shapes[i], dtype=U.dtype, device=U.device)
                m.of(full, views[i]).copy_(Um if m.block is None else Um * m.scale)
            if remaining[i] == 0:
                del vs[i]
                done.append(i)
                updates.append(Um.reshape(shapes[i]) if whole else parts_of.pop(i))
                scales.append(m.scale if m.block is None else 1.0)
        yield done, updates, scales
        del V, M, U, updates  # before the next stack: temporaries stay within one bucket


def _multi_tensor_root(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    steps: list[Tensor],
    o: RootOptions,
    coefficients: CoefficientsFor,
    *,
    blocks: Sequence[Sequence[int] | None] | None = None,
    robust: tuple[list[Tensor], list[Tensor]] | None = None,
    record: Record | None = None,
) -> None:
    """:func:`_single_tensor_root` for many parameters (one device, ``grads`` in the
    buffers' dtype, ``steps`` counting this step) with stacks: momentum for a bucket's parameters when the bucket is
    built (temporaries stay within ``bucket_bytes``), one threshold and one batched
    iteration per bucket, decay and step per bucket with ``_foreach`` calls."""
    if not params:
        return

    def open_(idx: list[int], out: list[Tensor | None]) -> tuple[list[Tensor], bool]:
        gs = [grads[i] for i in idx]
        if robust is not None:
            robust_moments_(
                [robust[0][i] for i in idx], [robust[1][i] for i in idx], gs,
                window=o.robust_window,
            )  # fmt: skip
        bs = [bufs[i] for i in idx]
        return momentum_(bs, gs, momentum=o.momentum, nesterov=o.nesterov, out=out), o.nesterov

    for done, updates, scales in _directions(
        [p.shape for p in params], [b.dtype for b in bufs], o, coefficients, open_,
        device=params[0].device, blocks=blocks, record=record,
    ):  # fmt: skip
        if robust is not None:
            updates = [
                _robust(U, robust[0][i], robust[1][i], steps[i], o) for i, U in zip(done, updates)
            ]
        apply_(
            [params[i] for i in done], updates, lr=o.lr, weight_decay=o.weight_decay,
            scales=scales,
        )  # fmt: skip
        del updates  # so that the generator frees this bucket before it builds the next


def _count(step: Tensor) -> float | Tensor:
    """A step count as a Python number (eager: read from the CPU), or the tensor itself in a
    traced step, where reading it would make it a guard."""
    return step if torch.compiler.is_compiling() else float(step)


def _robust(U: Tensor, mean: Tensor, sq: Tensor, step: Tensor, o: RootOptions) -> Tensor:
    """:func:`robust_scale` of a parameter's update (per matrix of its view)."""
    view = matrix_view(U.shape, o.nd_view)
    shape = (view.batch, view.rows, view.cols)
    bc = 1.0 - (1.0 - 1.0 / o.robust_window) ** _count(step)
    out = robust_scale(
        U.reshape(shape), mean.reshape(shape), sq.reshape(shape), bias_correction=bc,
        lam=o.robust_lambda,
    )  # fmt: skip
    return out.reshape(U.shape)
