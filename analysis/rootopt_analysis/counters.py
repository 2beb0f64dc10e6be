"""Count the collectives a piece of code issues, and the bytes each one moves per rank.

:class:`CollectiveCounter` wraps the ``torch.distributed`` collectives (and DTensor's
``full_tensor`` / ``redistribute`` and the functional collectives DTensor uses) for the
duration of a ``with`` block and records, for every call made from Python on this rank,
the operation and the bytes this rank sends and receives. The bytes follow
:func:`collective_bytes`, which states the algorithm each backend uses for the operation;
the cost model (:mod:`rootopt_analysis.costmodel`) predicts with the same formulas, and on gloo
they are checked against the bytes the process actually writes to its sockets
(:func:`bytes_written`, ``/proc/self/io``; docs/distributed.md, "Cost model"). Analysis
for tests and benchmarks: the runtime never imports it (the optimizer counts its own
bytes in :class:`~rootopt.distributed.flat.StepStats`).

Collectives issued from C++ (DDP's gradient all-reduce, FSDP2's own all-gather and
reduce-scatter) do not pass through Python and are not seen; the cost model accounts for
them analytically.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numpy.typing import NDArray
from torch import Tensor

# Operations whose bytes are counted (names of torch.distributed functions).
COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "barrier",
)
# Functional collectives DTensor's redistribute uses (torch.distributed._functional_collectives).
_FUNCOL = ("all_gather_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


def collective_bytes_ranks(
    op: str,
    backend: str,
    world: int,
    *,
    numel: int = 0,
    sizes: Sequence[int] = (),
    in_splits: Sequence[Sequence[int]] = (),
    src: int = 0,
    element_size: int = 4,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Bytes ``(sent, received)`` of every rank in one collective (arrays by rank).

    ``numel``: elements of the tensor (all_reduce, broadcast, reduce), of each rank's part
    (even all-gather) or of the whole input (even reduce-scatter). ``sizes``: every rank's
    part, for the uneven (list) forms. ``in_splits[r][j]``: elements rank r sends to rank
    j in an all-to-all.

    Algorithms (bandwidth terms; latency is counted per collective):

    * all-reduce of N: ring, ``2·(W−1)/W·N`` each way (NCCL; gloo's ring measures the same);
    * all-gather / reduce-scatter with equal parts S: ring, ``(W−1)·S`` each way (NCCL);
      gloo runs a reduce-scatter as an all-reduce of the whole input (measured: its
      socket writes equal the all-reduce's), so it is counted as one there;
    * uneven parts S_j (NCCL runs them as grouped, pipelined broadcasts/reduces):
      ``T − S_rank`` each way, T = sum of the parts;
    * all-to-all: direct, sent = what a rank sends to the others, received = what it
      receives from them (exact split sizes);
    * broadcast / reduce of N: NCCL pipelined ring, N each way except at the root (which
      only sends, or only receives); gloo's broadcast is a binomial tree (measured).
    """
    e = element_size
    W = world
    if W <= 1 or op == "barrier":
        return np.zeros(max(W, 1)), np.zeros(max(W, 1))
    if op == "all_reduce" or (
        backend == "gloo" and op in ("reduce_scatter_tensor", "reduce_scatter_single")
    ):
        b = 2 * (W - 1) / W * numel * e
        return np.full(W, b), np.full(W, b)
    if op in ("all_gather_single", "all_gather_into_tensor"):
        b = float((W - 1) * numel * e)
        return np.full(W, b), np.full(W, b)
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        b = (W - 1) / W * numel * e
        return np.full(W, b), np.full(W, b)
    if op in ("all_gather", "reduce_scatter"):
        if len(sizes) != W:
            raise ValueError(f"{op}: {len(sizes)} part sizes for world size {W}")
        parts = np.asarray(sizes, dtype=np.float64)
        total = float(parts.sum())
        if backend == "gloo" and op == "reduce_scatter":
            b = 2 * (W - 1) / W * total * e
            return np.full(W, b), np.full(W, b)
        out = (total - parts) * e
        return out, out.copy()
    if op == "all_to_all_single":
        m = np.asarray(in_splits, dtype=np.float64)
        if m.shape != (W, W):
            raise ValueError(f"all_to_all_single: split matrix is not {W} x {W}")
        diag = np.diag(m)
        return (m.sum(axis=1) - diag) * e, (m.sum(axis=0) - diag) * e
    if op in ("broadcast", "reduce"):
        n = float(numel * e)
        if op == "broadcast" and backend == "gloo":
            # a binomial tree from the root: relative rank v forwards to v + 2^k for
            # every 2^k > v (the root to ceil(log2 W) ranks)
            sent = np.zeros(W)
            for v in range(W):
                k = 1
                while k < W:
                    if k > v and v + k < W:
                        sent[(src + v) % W] += n
                    k *= 2
            received = np.full(W, n)
            received[src] = 0.0
            return sent, received
        sent, received = np.full(W, n), np.full(W, n)
        if op == "broadcast":
            received[src] = 0.0
        else:
            sent[src] = 0.0
        return sent, received
    raise ValueError(f"unknown collective {op!r}")


def collective_bytes(
    op: str,
    backend: str,
    world: int,
    rank: int,
    *,
    numel: int = 0,
    sizes: Sequence[int] = (),
    in_splits: Sequence[int] = (),
    out_splits: Sequence[int] = (),
    src: int = 0,
    element_size: int = 4,
) -> tuple[float, float]:
    """Bytes ``(sent, received)`` by ``rank`` in one collective, as
    :func:`collective_bytes_ranks` (an all-to-all is described by this rank's own
    ``in_splits`` — what it sends to each rank — and ``out_splits``)."""
    if op == "all_to_all_single":
        if len(in_splits) != world or len(out_splits) != world:
            raise ValueError(f"all_to_all_single: splits of {len(in_splits)}/{len(out_splits)}")
        e = element_size
        if world <= 1:
            return 0.0, 0.0
        return (
            float((sum(in_splits) - in_splits[rank]) * e),
            float((sum(out_splits) - out_splits[rank]) * e),
        )
    s, r = collective_bytes_ranks(
        op, backend, world, numel=numel, sizes=sizes, src=src, element_size=element_size
    )
    return float(s[rank]), float(r[rank])


@dataclass
class Call:
    op: str
    sent: float
    received: float
    elements: int


@dataclass
class CollectiveCounts:
    """What was counted: every call in order, and totals."""

    calls: list[Call] = field(default_factory=list)
    full_tensor: int = 0  # DTensor.full_tensor() calls
    redistribute: int = 0  # DTensor.redistribute() calls
    functional: int = 0  # functional collectives (DTensor's hidden communication)

    @property
    def collectives(self) -> int:
        """Collectives issued (barriers excluded)."""
        return sum(1 for c in self.calls if c.op != "barrier")

    @property
    def bytes_sent(self) -> float:
        return sum(c.sent for c in self.calls)

    @property
    def bytes_received(self) -> float:
        return sum(c.received for c in self.calls)

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            if c.op != "barrier":
                out[c.op] = out.get(c.op, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "collectives": self.collectives,
            "by_op": self.by_op(),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "full_tensor": self.full_tensor,
            "redistribute": self.redistribute,
            "functional": self.functional,
        }


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[i] if len(args) > i else None)


def _describe(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float, int]:
    group = kwargs.get("group")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    backend = str(dist.get_backend(group))
    if op == "barrier":
        return 0.0, 0.0, 0
    if op in ("all_reduce", "broadcast", "reduce"):
        t: Tensor = _arg(args, kwargs, 0, "tensor")
        src = kwargs.get("src", kwargs.get("dst", args[1] if len(args) > 1 else 0))
        if op != "all_reduce" and group is not None:
            src = dist.get_group_rank(group, src)
        s, r = collective_bytes(
            op, backend, world, rank, numel=t.numel(), src=int(src), element_size=t.element_size()
        )
        return s, r, t.numel()
    if op in ("all_gather_single", "all_gather_into_tensor"):
        inp: Tensor = _arg(args, kwargs, 1, "input_tensor")
        s, r = collective_bytes(
            op, backend, world, rank, numel=inp.numel(), element_size=inp.element_size()
        )
        return s, r, inp.numel()
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        inp = _arg(args, kwargs, 1, "input")
        s, r = collective_bytes(
            op, backend, world, rank, numel=inp.numel(), element_size=inp.element_size()
        )
        return s, r, inp.numel()
    if op == "all_gather":
        parts: list[Tensor] = _arg(args, kwargs, 0, "tensor_list")
        sizes = [p.numel() for p in parts]
        s, r = collective_bytes(
            op, backend, world, rank, sizes=sizes, element_size=parts[rank].element_size()
        )
        return s, r, sum(sizes)
    if op == "reduce_scatter":
        parts = _arg(args, kwargs, 1, "input_list")
        sizes = [p.numel() for p in parts]
        s, r = collective_bytes(
            op, backend, world, rank, sizes=sizes, element_size=parts[0].element_size()
        )
        return s, r, sum(sizes)
    if op == "all_to_all_single":
        out: Tensor = _arg(args, kwargs, 0, "output")
        inp = _arg(args, kwargs, 1, "input")
        osp = _arg(args, kwargs, 2, "output_split_sizes")
        isp = _arg(args, kwargs, 3, "input_split_sizes")
        if osp is None:
            osp = [out.numel() // world] * world
        if isp is None:
            isp = [inp.numel() // world] * world
        s, r = collective_bytes(
            op,
            backend,
            world,
            rank,
            in_splits=list(isp),
            out_splits=list(osp),
            element_size=inp.element_size(),
        )
        return s, r, inp.numel()
    raise ValueError(op)


@contextmanager
def CollectiveCounter() -> Iterator[CollectiveCounts]:
    """Count collectives issued from Python on this rank inside the ``with`` block.

    A collective that calls another one (``all_gather_single`` → ``all_gather_into_tensor``)
    counts once. Not thread-safe across concurrent counters (one at a time per process).
    """
    counts = CollectiveCounts()
    depth = threading.local()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(depth, "n", 0) == 0
            depth.n = getattr(depth, "n", 0) + 1
            try:
                if outer:
                    s, r, n = _describe(op, args, kwargs)
                    counts.calls.append(Call(op, s, r, n))
                return fn(*args, **kwargs)
            finally:
                depth.n -= 1

        return counted

    def patch(owner: Any, name: str, new: Callable[..., Any]) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    for op in COUNTED:
        if hasattr(dist, op):
            patch(dist, op, wrap(op, getattr(dist, op)))
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.tensor import DTensor

    full, redis = DTensor.full_tensor, DTensor.redistribute

    def counted_full(self: Any, *a: Any, **k: Any) -> Any:
        counts.full_tensor += 1
        return full(self, *a, **k)

    def counted_redis(self: Any, *a: Any, **k: Any) -> Any:
        counts.redistribute += 1
        return redis(self, *a, **k)

    patch(DTensor, "full_tensor", counted_full)
    patch(DTensor, "redistribute", counted_redis)
    for name in _FUNCOL:
        fn = getattr(funcol, name, None)
        if fn is None:
            continue

        def counted_funcol(*a: Any, __fn: Any = fn, **k: Any) -> Any:
            counts.functional += 1
            return __fn(*a, **k)

        patch(funcol, name, counted_funcol)
    try:
        yield counts
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


def bytes_written() -> int | None:
    """Bytes this process has written through ``write``-family system calls (Linux
    ``/proc/self/io`` ``wchar``; sockets included), or None where unavailable. gloo sends
    every payload byte through such calls, so the difference around a step is the bytes
    the step sent, plus gloo's small per-message headers."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------
# elementwise traffic: the bytes the non-matmul kernels of a block read and write
# ---------------------------------------------------------------------------------------
# Matrix products: Newton–Schulz FLOPs, costed at a FLOP rate, not as traffic.
_MATMUL = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "_addmm_activation"})
# Allocations: no bytes touched.
_ALLOC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Ops that overwrite their first argument without reading it.
_OVERWRITE = frozenset({"copy_", "fill_", "zero_", "copy"})


@dataclass
class Traffic:
    """Bytes read + written by the kernels of a block, per op name, and the calls."""

    bytes_by_op: dict[str, int] = field(default_factory=dict)
    calls_by_op: dict[str, int] = field(default_factory=dict)
    off: int = 0  # > 0 inside paused()

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave a region out of the count (e.g. the Newton–Schulz and threshold a
        caller costs apart)."""
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1

    def add(self, op: str, nbytes: int) -> None:
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0) + nbytes
        self.calls_by_op[op] = self.calls_by_op.get(op, 0) + 1


def _tensors(tree: Any) -> list[Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


def _nbytes(ts: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@contextmanager
def TrafficCounter(apart: Sequence[tuple[object, str]] = ()) -> Iterator[Traffic]:
    """Count, for every aten op this thread runs inside the block, the bytes of its tensor
    inputs (read) and outputs (written): the elementwise traffic the cost model charges at
    a streaming rate (``costmodel.Estimate.traffic``). Not counted: matrix products (FLOPs),
    allocations, views (an output that shares an input's storage, unless the op writes in
    place), and collectives (``c10d``: bytes on the wire, :class:`CollectiveCounter`).
    The destination of ``copy_``/``fill_``/``zero_`` and ``out=`` tensors are written, not
    read. An upper bound where a kernel reads only part of an input (a reduction with
    early exit); exact for the streaming passes of a step. ``apart``: ``(class, method)``
    pairs, or ``(module, function)``, run paused inside the block (e.g.
    ``(rootopt.optim.functional, "root_direction")``: the threshold + Newton–Schulz the
    cost model charges apart), restored on exit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    traffic = Traffic()

    def paused_call(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with traffic.paused():
                return method(*args, **kwargs)

        return call

    class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if traffic.off or name in _MATMUL or name in _ALLOC or func.namespace != "aten":
                return out
            ins = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
            outs = _tensors(out)
            inplace = name.endswith("_") or "out" in kwargs
            if name.endswith("_") and not outs:  # _foreach_*_ return nothing: self written
                outs = _tensors(args[:1])
            if not inplace and outs:
                stores = {t.untyped_storage().data_ptr() for t in ins}
                if all(o.untyped_storage().data_ptr() in stores for o in outs):
                    return out  # a view
            read = _nbytes(ins)
            if name in _OVERWRITE and ins:
                read -= _nbytes(ins[:1])
            traffic.add(name, read + _nbytes(outs))
            return out

    originals = [(cls, name, cls.__dict__.get(name)) for cls, name in apart]
    try:
        for cls, name, _ in originals:
            setattr(cls, name, paused_call(getattr(cls, name)))
        with _Mode():  # type: ignore[no-untyped-call]
            yield traffic
    finally:
        for cls, name, own in originals:  # the class's own method back, or its parent's
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
