"""What distributed ROOT costs at a world size: a model of bytes, collectives, Newton–Schulz
work, memory and time per rank, for several designs (docs/distributed.md, "Cost model").

Given the parameters (shape and whether ROOT or AdamW updates them), a world size W and a
design, :func:`estimate` returns per rank: the bytes sent and received in one step, the
collectives issued, the Newton–Schulz FLOPs (their maximum over ranks is the critical
path), the load imbalance and the peak optimizer memory. :func:`step_time` turns that
into seconds for a :class:`Hardware` and compares it with the forward/backward time of a
:class:`Workload`.

Designs (``DESIGNS``):

* ``replicated`` — DDP AdamW's gradient all-reduce, then every rank thresholds and
  orthogonalizes every matrix (no optimizer communication; all the work on every rank):
  the baseline.
* ``owner`` — :class:`rootopt.distributed.DistributedROOT` on plain tensors: reduce-scatter
  of the gradients in owner-aligned buckets (started during backward), owner threshold +
  Newton–Schulz, all-gather of the new parameters: DDP AdamW's bytes (ZeRO-1/2 style;
  Moonlight, arXiv 2502.16982 §2.3). ``Options(average_grads=False)``: under DDP, whose
  all-reduce comes first.
* ``fsdp`` — FSDP2-sharded parameters: FSDP2's own reduce-scatter / all-gathers, and two
  all-to-alls per round that move each matrix's shards to its owner and the update back.

Byte formulas are those of :func:`rootopt_analysis.counters.collective_bytes` (ring algorithms
on NCCL; gloo's own algorithms on gloo), so a measured run with a
:class:`~rootopt_analysis.counters.CollectiveCounter` checks the model exactly. The owner
layout and the sharded rounds are :mod:`rootopt.distributed.layout`'s, the functions the
optimizer itself calls. Everything here is pure Python on shapes: no tensors are
allocated. Analysis, not runtime: ``import rootopt`` and ``rootopt train`` never load it
(``rootopt plan`` and the benchmarks do).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from rootopt.distributed.layout import LayoutItem, owner_layout, owner_rounds
from rootopt.distributed.owners import ns_cost
from rootopt.optim.functional import matrix_view
from rootopt_analysis.counters import collective_bytes_ranks

Design = Literal["replicated", "owner", "fsdp"]
DESIGNS: tuple[Design, ...] = ("replicated", "owner", "fsdp")
Vec = NDArray[np.float64]
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_BUCKET_BYTES = 32 * MiB  # rootopt.optim.root.DEFAULT_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MiB  # torch DistributedDataParallel(bucket_cap_mb=25)
# float32 passes over each ROOT element its owner thresholds that are not streaming passes
# counted in Estimate.traffic: the quantile selection (~4) and the clamp (2). The
# streaming passes (momentum, Nesterov, decay and update, AdamW, copies) are counted per
# design from the code (momentum_bytes, apply_bytes, ...).
CLIP_PASSES = 6.0
# The link constants of the time model, one per collective primitive: gloo's all-gather,
# all-to-all and all-reduce run different algorithms at measured rates 2-3x apart
# (docs/results/distributed.md, calibration). A reduce-scatter is charged at
# the all-to-all's rate (the owner design runs it as one on gloo).
LINK_KINDS = ("all_gather", "all_to_all", "all_reduce")
LINK_OF = {
    "all_gather": "all_gather",
    "all_to_all": "all_to_all",
    "reduce_scatter": "all_to_all",
    "all_reduce": "all_reduce",
}


# ---------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, shape and whether ROOT (``root``) or AdamW updates it."""

    name: str
    shape: tuple[int, ...]
    algorithm: Literal["root", "adamw"] = "root"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-3 decoder's sizes (Llama 3 paper, arXiv 2407.21783, Table 3; vocabulary
    size from the released configs)."""

    name: str
    layers: int
    d_model: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


LLAMA3: dict[str, LlamaShape] = {
    "llama3-8b": LlamaShape("llama3-8b", 32, 4096, 14336, 32, 8),
    "llama3-70b": LlamaShape("llama3-70b", 80, 8192, 28672, 64, 8),
    "llama3-405b": LlamaShape("llama3-405b", 126, 16384, 53248, 128, 8),
}


def llama3_params(model: str | LlamaShape) -> list[ParamSpec]:
    """The parameters of a Llama-3 model in module order: per layer the attention
    projections q, k, v, o and the SwiGLU gate, up and down projections (ROOT), two RMSNorm
    weights (AdamW); the token embedding, the final norm and the untied output head
    (AdamW, the usual split for Muon-family optimizers: hidden matrices only)."""
    shape = LLAMA3[model] if isinstance(model, str) else model
    d, kv = shape.d_model, shape.kv_heads * shape.head_dim
    out = [ParamSpec("tok_embeddings.weight", (shape.vocab, d), "adamw")]
    for i in range(shape.layers):
        pre = f"layers.{i}."
        out += [
            ParamSpec(pre + "attention.wq.weight", (d, d)),
            ParamSpec(pre + "attention.wk.weight", (kv, d)),
            ParamSpec(pre + "attention.wv.weight", (kv, d)),
            ParamSpec(pre + "attention.wo.weight", (d, d)),
            ParamSpec(pre + "feed_forward.w1.weight", (shape.ffn, d)),
            ParamSpec(pre + "feed_forward.w3.weight", (shape.ffn, d)),
            ParamSpec(pre + "feed_forward.w2.weight", (d, shape.ffn)),
            ParamSpec(pre + "attention_norm.weight", (d,), "adamw"),
            ParamSpec(pre + "ffn_norm.weight", (d,), "adamw"),
        ]
    out += [
        ParamSpec("norm.weight", (d,), "adamw"),
        ParamSpec("output.weight", (shape.vocab, d), "adamw"),
    ]
    return out


def _view(p: ParamSpec, nd_view: str = "auto") -> tuple[int, int, int]:
    v = matrix_view(p.shape, nd_view)  # type: ignore[arg-type]
    return v.batch, v.rows, v.cols


def ns_flops(p: ParamSpec, ns_steps: int) -> float:
    """Newton–Schulz FLOPs of one parameter: ``T·(4s²l + 2s³)`` per matrix for an
    ``l × s`` matrix (``X Xᵀ``, ``A·A``, ``B·X``; two FLOPs per multiply-add, i.e.
    ``2·ns_cost``)."""
    if p.algorithm != "root" or p.numel == 0:
        return 0.0
    return 2.0 * ns_cost(*_view(p), ns_steps)


def items_from_specs(
    params: Sequence[ParamSpec], ns_steps: int = 5, element_size: int = 4
) -> list[LayoutItem]:
    out = []
    for i, p in enumerate(params):
        cost = ns_cost(*_view(p), ns_steps) if p.algorithm == "root" else 0.0
        out.append(
            LayoutItem(i, p.name, p.numel, cost, p.algorithm == "root", "grad", element_size)
        )
    return out


# ---------------------------------------------------------------------------------------
# estimate
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """What the implementation is configured with.

    ``grad_bytes``: element size of the gradients exchanged (4: float32, 2: bfloat16);
    ``param_bytes``: of the parameters all-gathered by ``owner``; ``state_bytes``: of
    momentum / AdamW moments; ``ns_bytes``: of the Newton–Schulz work matrices.
    ``average_grads``: the optimizer synchronises the gradients (``owner``
    reduce-scatters them, starting in backward, hidden like DDP's all-reduce) instead of
    DDP (``DistributedROOT(average_grads=...)``). ``gpus_per_node``: ranks of one node
    (they share a machine's compute units in :func:`step_time`).
    """

    ns_steps: int = 5
    grad_bytes: int = 4
    param_bytes: int = 4
    state_bytes: int = 4
    ns_bytes: int = 4
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ddp_bucket_bytes: int = DDP_BUCKET_BYTES
    backend: str = "nccl"
    average_grads: bool = True
    fsdp_reshard_after_forward: bool = True
    gpus_per_node: int = 8


@dataclass
class Estimate:
    """Per-rank quantities of one step of one design (lists are indexed by rank).

    Bytes come in two kinds: ``sync_*`` is gradient (and, for ``owner``, parameter)
    synchronisation that replaces what DDP/FSDP2 AdamW moves; ``opt_*`` is moved by the
    optimizer step on top of it. ``step_*`` is what the step issues itself from Python
    (what :class:`~rootopt_analysis.counters.CollectiveCounter` counts: ``opt_*`` plus the
    ``owner`` reduce-scatter/all-gather). ``exposed`` is what is not hidden behind
    backward (inter-node link) and ``node`` what runs on the intra-node link.
    """

    design: str
    world: int
    options: Options
    params: int  # all parameter elements
    root_params: int  # ROOT matrix elements
    sync_sent: Vec
    sync_received: Vec
    opt_sent: Vec
    opt_received: Vec
    step_sent: Vec  # issued by the optimizer's step itself (what a counter sees)
    step_received: Vec
    exposed: Vec  # max(sent, received) per rank, not hidden behind backward
    node: Vec  # bytes per rank on the intra-node link (none in the designs priced today)
    collectives: dict[str, int]  # per step, on every rank (gradient sync included)
    sync_collectives: int  # of which: DDP's / FSDP2's own (hidden behind compute)
    exposed_collectives: int  # issued by the optimizer step
    flops: Vec  # Newton–Schulz FLOPs per rank
    largest_flops: float  # of the most expensive single matrix, unsplit
    elements: Vec  # ROOT elements thresholded + orthogonalized per rank
    memory: Vec  # peak optimizer bytes per rank (state + transient buffers)
    adamw_bytes: float  # per rank and step: AdamW under the same wrapper (DDP or FSDP2)
    buckets: int = 0  # rounds (fsdp) or buckets (owner)
    notes: list[str] = field(default_factory=list)
    # bytes read + written per rank by the step's streaming elementwise passes (momentum,
    # decay + update, AdamW, copies into and out of flat buffers, sums, divisions): every
    # pass the code runs, not only the owner's (``_traffic_*`` below); the quantile and
    # clamp of the ``elements`` a rank thresholds are charged separately (``clip_passes``)
    traffic: Vec = field(default_factory=lambda: np.zeros(0))
    # per link kind (:data:`LINK_KINDS`): exposed bytes per rank, and collectives issued
    exposed_kind: dict[str, Vec] = field(default_factory=dict)
    # of ``exposed_kind``: what no order of this design's step can hide behind its compute
    # (the collectives before its first Newton–Schulz or after its last: the first
    # round's shards to their owners and the last round's updates back, the first
    # reduce-scatter and the last all-gather)
    serial_kind: dict[str, Vec] = field(default_factory=dict)
    collectives_kind: dict[str, int] = field(default_factory=dict)
    # Newton–Schulz FLOPs on the step's path when every round (gather, fsdp) or bucket
    # (owner) ends in a collective all ranks wait for: the sum over rounds of the
    # busiest rank's FLOPs in that round, >= flops.max() (0: no rounds, flops.max())
    path_flops: float = 0.0

    @property
    def sent(self) -> Vec:
        return self.sync_sent + self.opt_sent

    @property
    def received(self) -> Vec:
        return self.sync_received + self.opt_received

    @property
    def bytes_per_rank(self) -> float:
        """The most bytes any rank sends or receives in one step."""
        return float(max(self.sent.max(), self.received.max()))

    @property
    def vs_adamw(self) -> float:
        return self.bytes_per_rank / self.adamw_bytes if self.adamw_bytes else math.nan

    @property
    def total_collectives(self) -> int:
        return sum(self.collectives.values())

    @property
    def total_flops(self) -> float:
        return float(self.flops[0] if self.design == "replicated" else self.flops.sum())

    @property
    def critical_flops(self) -> float:
        return float(self.flops.max())

    @property
    def lower_bound_flops(self) -> float:
        """No owner schedule does better than max(total / W, the largest single matrix)."""
        return max(self.total_flops / self.world, self.largest_flops)

    @property
    def imbalance(self) -> float:
        """Critical path over the mean work per rank: 1 is perfect balance."""
        mean = self.total_flops / self.world
        return self.critical_flops / mean if mean else math.nan

    @property
    def peak_memory(self) -> float:
        return float(self.memory.max())


def _ns_workspace(b: int, rows: int, cols: int, nbytes: int) -> float:
    """Newton–Schulz work matrices of a stack of ``b`` matrices: X and the result (b·l·s),
    A and the polynomial in A (b·s²)."""
    s, l = min(rows, cols), max(rows, cols)
    return float(nbytes) * (2 * b * l * s + 2 * b * s * s)


def _units(params: Sequence[ParamSpec]) -> int:
    """FSDP2 units when each transformer block is wrapped (names ``...layers.<i>....``)
    plus the root module."""
    blocks = set()
    for p in params:
        parts = p.name.split(".")
        for j, part in enumerate(parts[:-1]):
            if part in ("layers", "blocks", "h") and parts[j + 1].isdigit():
                blocks.add(".".join(parts[: j + 2]))
                break
    return len(blocks) + 1


# ---------------------------------------------------------------------------------------
# elementwise traffic: bytes read + written per element by the passes the step runs
# ---------------------------------------------------------------------------------------
def _convert(a: int, b: int) -> int:
    """A dtype conversion ``x.to(...)``: read ``a`` bytes, write ``b`` (none when equal)."""
    return a + b if a != b else 0


def momentum_bytes(o: Options) -> int:
    """Per ROOT element, ``DistributedROOT._momentum_local`` → ``optim.functional.momentum_``:
    the gradient in the state dtype (``g.to``), ``buf = g + mu buf`` (on the CPU one fused
    ``torch.add(out=buf)``: read 2, write 1; elsewhere ``_foreach_mul_`` + ``_foreach_add_``:
    2 + 3) and Nesterov's ``g + mu buf`` into a new tensor (read 2, write 1)."""
    s = o.state_bytes
    buf = 3 * s if o.backend == "gloo" else 5 * s
    return _convert(o.grad_bytes, s) + buf + 3 * s


def apply_bytes(o: Options) -> int:
    """Per ROOT element, ``DistributedROOT._apply_local`` → ``optim.functional.apply_``:
    ``p *= 1 - lr wd`` (read 1, write 1) and ``p -= lr s U`` (read p and the float32 U,
    write p); a parameter below float32 goes through a float32 copy and back."""
    pb = o.param_bytes
    if pb >= 4:
        return 2 * pb + 2 * pb + 4
    return _convert(pb, 4) + 8 + 12 + _convert(4, pb)


def adamw_bytes(o: Options) -> int:
    """Per AdamW element, ``optim.adamw.adamw_`` (state in ``state_bytes``): decay
    ``_foreach_mul_`` (2), ``lerp_`` of the first moment (3), ``mul_`` + ``addcmul_`` of the
    second (2 + 3), ``sqrt`` into a new tensor, ``div_``, ``add_`` (2 + 2 + 2),
    ``addcdiv_`` (read 3, write 1): 20 passes, plus the conversions of parameter (there and
    back) and gradient when they are not in the state dtype."""
    s = o.state_bytes
    return _convert(o.param_bytes, s) * 2 + _convert(o.grad_bytes, s) + 20 * s


def root_state_bytes(o: Options) -> int:
    """Per ROOT element: momentum + Nesterov + decay and update (what the ``replicated``
    design runs for every matrix on every rank, the others for the elements a rank
    holds)."""
    return momentum_bytes(o) + apply_bytes(o)


def finite_check_bytes(o: Options) -> int:
    """Per element of every gradient a rank holds, ``optim._finite.finite_flags`` (the
    non-finite check of every design and of ROOT's own step): one read (min and max in one
    pass on the CPU, max |g| elsewhere)."""
    return o.grad_bytes


def estimate(
    params: Sequence[ParamSpec],
    world: int,
    design: Design,
    options: Options | None = None,
) -> Estimate:
    """Bytes, collectives, Newton–Schulz FLOPs and memory per rank for one step of
    ``design`` at world size ``world`` (see the module docstring)."""
    o = options or Options()
    if design not in DESIGNS:
        raise ValueError(f"unknown design {design!r}; choose one of {', '.join(DESIGNS)}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    W = world
    specs = [p for p in params if p.numel > 0]
    roots = [p for p in specs if p.algorithm == "root"]
    P_all = sum(p.numel for p in specs)

    def zeros() -> Vec:
        return np.zeros(W)

    est = Estimate(
        design=design,
        world=W,
        options=o,
        params=P_all,
        root_params=sum(p.numel for p in roots),
        sync_sent=zeros(),
        sync_received=zeros(),
        opt_sent=zeros(),
        opt_received=zeros(),
        step_sent=zeros(),
        step_received=zeros(),
        exposed=zeros(),
        node=zeros(),
        collectives={},
        sync_collectives=0,
        exposed_collectives=0,
        flops=zeros(),
        largest_flops=max((ns_flops(p, o.ns_steps) for p in roots), default=0.0),
        elements=zeros(),
        memory=zeros(),
        adamw_bytes=0.0,
        traffic=zeros(),
    )
    ddp = 2 * (W - 1) / W * P_all * o.grad_bytes
    ddp_colls = max(1, math.ceil(P_all * o.grad_bytes / o.ddp_bucket_bytes)) if W > 1 else 0
    gathers = 2 if o.fsdp_reshard_after_forward else 1
    fsdp = (1 + gathers) * (W - 1) / W * P_all * o.grad_bytes
    est.adamw_bytes = fsdp if design == "fsdp" else ddp
    if design == "replicated":  # every rank checks every gradient
        est.traffic += P_all * finite_check_bytes(o)
    if design == "replicated":
        _sync(est, "all_reduce", ddp, ddp_colls)
        est.flops += sum(ns_flops(p, o.ns_steps) for p in roots)
        est.elements += est.root_params
        # every rank: momentum, decay and update of every matrix, AdamW of the rest (the
        # same functions as DistributedROOT's, optim.functional / optim.adamw)
        est.traffic += est.root_params * root_state_bytes(o)
        est.traffic += (P_all - est.root_params) * adamw_bytes(o)
        state = sum(_state_bytes(p, o) for p in specs)
        ws = max((_ns_workspace(*_view(p), o.ns_bytes) for p in roots), default=0.0)
        est.memory += state + ws
    elif design == "owner":
        _owner(est, specs, o, ddp, ddp_colls)
    else:
        _sync(est, "fsdp_sync", fsdp, (1 + gathers) * _units(specs) if W > 1 else 0)
        _fsdp(est, specs, o)
    return est


def _state_bytes(p: ParamSpec, o: Options) -> float:
    return float(o.state_bytes * p.numel * (1 if p.algorithm == "root" else 2))


def _sync(est: Estimate, kind: str, nbytes: float, colls: int) -> None:
    """Synchronisation done by DDP/FSDP2 (C++ hooks, overlapped with compute)."""
    if est.world == 1:
        return
    est.sync_sent += nbytes
    est.sync_received += nbytes
    est.collectives[kind] = est.collectives.get(kind, 0) + colls
    est.sync_collectives += colls


def _issue(
    est: Estimate,
    kind: str,
    sent: Vec,
    received: Vec,
    *,
    sync: bool = False,
    exposed: bool = True,
    link: str | None = None,
    serial: bool = False,
) -> None:
    """One collective issued by the optimizer on every rank. ``link``: the primitive that
    runs it, for the per-kind link constants (:data:`LINK_KINDS`; default: from ``kind``)
    — on gloo the owner design's reduce-scatter and uneven all-gather are all-to-alls.
    ``serial``: before the step's first Newton–Schulz or after its last, so no schedule
    hides it behind compute (``Estimate.serial_kind``)."""
    if est.world == 1:
        return
    lk = link or LINK_OF[kind]
    est.collectives_kind[lk] = est.collectives_kind.get(lk, 0) + 1
    if exposed:
        wire = np.maximum(sent, received)
        est.exposed_kind[lk] = est.exposed_kind.get(lk, np.zeros(est.world)) + wire
        if serial:
            est.serial_kind[lk] = est.serial_kind.get(lk, np.zeros(est.world)) + wire
    est.step_sent += sent
    est.step_received += received
    if sync:
        est.sync_sent += sent
        est.sync_received += received
    else:
        est.opt_sent += sent
        est.opt_received += received
    if exposed:
        est.exposed += np.maximum(sent, received)
    est.collectives[kind] = est.collectives.get(kind, 0) + 1
    est.exposed_collectives += 1


def _flags(est: Estimate, n_params: int, backend: str) -> None:
    """The all-reduce (SUM) of DistributedROOT.sync_grads: per parameter two float64 flags
    (has a gradient; non-finite), one for a gradient changed after its bucket started and
    the sum of squares of the gradients."""
    s, r = collective_bytes_ranks(
        "all_reduce", backend, est.world, numel=2 * n_params + 2, element_size=8
    )
    _issue(est, "all_reduce", s, r, exposed=False)


def _chunks(rows: int, world: int) -> Vec:
    """:func:`chunk_rows` as an array."""
    c = -(-rows // world) if rows else 0
    return np.clip(rows - np.arange(world) * c, 0, c).astype(np.float64)


def _owner(
    est: Estimate, specs: Sequence[ParamSpec], o: Options, ddp: float, ddp_colls: int
) -> None:
    """DistributedROOT on plain tensors (:mod:`rootopt.distributed.replicated`): per bucket
    of :func:`~rootopt.distributed.layout.owner_layout`, a reduce-scatter started during
    backward (with ``average_grads``; under DDP its all-reduce instead), the owner's
    update, and an all-gather of the new parameters waited for at once."""
    W = est.world
    items = items_from_specs(specs, o.ns_steps, o.grad_bytes)
    layout = owner_layout(items, W, o.bucket_bytes)
    est.buckets = len(layout.buckets)
    _flags(est, len(specs), o.backend)
    if not o.average_grads:
        _sync(est, "all_reduce", ddp, ddp_colls)
        # under DDP every rank checks its whole copy of the gradients (sync_grads)
        est.traffic += est.params * finite_check_bytes(o)
    copies = W if o.backend == "gloo" else 1
    gloo = o.backend == "gloo"
    gb, pb = o.grad_bytes, o.param_bytes
    peak = np.zeros(W)
    last = len(layout.buckets) - 1
    held = np.zeros(W)  # summed gradient segments, held from the reduce-scatters on
    for k, b in enumerate(layout.buckets):
        seg = np.asarray(b.segments, dtype=np.float64)
        held += seg
        if W > 1:
            # replicated._gather_params: the owner's parameters copied into ``send``, and
            # after the all-gather every other owner's copied into the parameters; on gloo
            # an uneven all-gather first repeats ``send`` W times (flat.start_gather)
            est.traffic += 2 * pb * seg + 2 * pb * (b.numel - seg)
            if gloo and not b.even:
                est.traffic += pb * seg * (1 + W)
        if o.average_grads and W > 1:
            # replicated._start: the flat bucket zeroed and every gradient copied in, then
            # this rank's segment divided by W; on gloo the W received segments summed
            # (flat.start_reduce_scatter)
            est.traffic += 3 * gb * b.numel + 2 * gb * seg
            if gloo:
                est.traffic += (W + 1) * gb * seg
        if o.average_grads:
            if gloo:
                # all_to_all_single: rank r sends segment j to rank j, sums what it receives
                s, r = (b.numel - seg) * gb, (W - 1) * seg * gb
            elif b.even:
                s, r = collective_bytes_ranks(
                    "reduce_scatter_tensor", o.backend, W, numel=b.numel, element_size=gb
                )
            else:
                s, r = collective_bytes_ranks(
                    "reduce_scatter", o.backend, W, sizes=b.segments, element_size=gb
                )
            # started in backward: hidden behind it, as DDP's all-reduce
            _issue(est, "reduce_scatter", s, r, sync=True, exposed=False, link="all_to_all")
        if b.even:
            s, r = collective_bytes_ranks(
                "all_gather_into_tensor", o.backend, W, numel=b.segments[0], element_size=pb
            )
        elif gloo:
            # all_to_all_single: rank r sends its segment to every rank
            s, r = (W - 1) * seg * pb, (b.numel - seg) * pb
        else:
            s, r = collective_bytes_ranks(
                "all_gather", o.backend, W, sizes=b.segments, element_size=pb
            )
        link = "all_to_all" if gloo and not b.even else "all_gather"
        _issue(est, "all_gather", s, r, sync=o.average_grads, link=link, serial=k == last)
        # a bucket's flat gradient copy (gloo: with its W received segments) is alive from
        # backward until the step, and its all-gather buffers while it is gathered
        per_rank = b.numel * (gb + pb) + copies * seg * (gb + pb)
        peak = np.maximum(peak, per_rank)
    buf = np.zeros(W)
    if W > 1:
        buf = buf + peak
        if o.average_grads:
            # every bucket's flat copy (and on gloo its W received segments) may be in
            # flight at once at the end of backward; the summed segments are held to the
            # updates
            buf = buf + gb * (sum(b.numel for b in layout.buckets) + copies * held)
    state = np.zeros(W)
    ws = np.zeros(W)
    item_flops = np.zeros(len(layout.items))  # a ROOT matrix is never cut into pieces
    for n, (it, ow) in enumerate(zip(layout.items, layout.owner)):
        p = specs[it.index]
        state[ow] += _state_bytes(p, o) * it.numel / p.numel
        # the owner's update: ROOT._root / ROOT._adamw (or an AdamW piece), and the norm
        # (and, when it reduced them, the non-finite check) of the synchronised gradient
        # it owns
        est.traffic[ow] += it.numel * (
            root_state_bytes(o) if p.algorithm == "root" else adamw_bytes(o)
        )
        est.traffic[ow] += it.numel * (2 if o.average_grads else 1) * finite_check_bytes(o)
        if p.algorithm == "root":
            item_flops[n] = ns_flops(p, o.ns_steps)
            est.flops[ow] += item_flops[n]
            est.elements[ow] += p.numel
            ws[ow] = max(ws[ow], _ns_workspace(*_view(p), o.ns_bytes))
    per_bucket = []
    for b in layout.buckets:
        per = np.zeros(W)
        np.add.at(per, list(b.owners), item_flops[list(b.items)])
        per_bucket.append(per)
    est.path_flops = owner_path(per_bucket)
    est.memory += state + ws + buf


def owner_path(per_bucket: Sequence[Vec]) -> float:
    """Newton–Schulz FLOPs on the step's path of the ``owner`` design, from each bucket's
    FLOPs per rank: each bucket's all-gather is waited for before the next bucket is
    updated, so every bucket waits for its busiest rank."""
    return float(sum(float(per.max()) for per in per_bucket))


def _fsdp(est: Estimate, specs: Sequence[ParamSpec], o: Options) -> None:
    """Shards to owners and updates back, one pair of all-to-alls per round of
    :func:`~rootopt.distributed.layout.owner_rounds` (:mod:`rootopt.distributed.sharded`)."""
    W = est.world
    roots = [p for p in specs if p.algorithm == "root"]
    _flags(est, len(specs), o.backend)
    views = [_view(p) for p in roots]
    # elements rank s sends for each matrix: its shard
    pieces = [
        np.array([n * (p.numel // max(p.shape[0], 1)) for n in _chunks(p.shape[0], W)])
        for p in roots
    ]
    rounds = owner_rounds(
        [ns_flops(p, o.ns_steps) / 2 for p in roots],
        [4 * p.numel for p in roots],
        [(v[1], v[2]) for v in views],
        W,
        o.bucket_bytes,
    )
    ws = np.zeros(W)
    peak = np.zeros(W)
    ret_bytes = min(4, o.ns_bytes)  # the updates' element size on their way back
    for k, rnd in enumerate(rounds):
        before = est.flops.copy()  # each round ends in all-to-alls every rank waits for
        sent = np.zeros(W)
        received = np.zeros(W)
        held = np.zeros(W)
        for i, ow in rnd:
            p = roots[i]
            est.flops[ow] += ns_flops(p, o.ns_steps)
            piece = 4.0 * pieces[i]
            est.elements[ow] += p.numel
            ws[ow] = max(ws[ow], _ns_workspace(*views[i], o.ns_bytes))
            held[ow] += piece.sum()
            mine = piece[ow]
            sent += piece
            sent[ow] -= mine
            received[ow] += piece.sum() - mine
        # to the owners (float32 momentum), and the same pieces back (the updates, in
        # the Newton–Schulz dtype: sharded.update_dtype); the first round's inbound
        # precedes every Newton–Schulz, the last round's return follows them all
        back = ret_bytes / 4
        _issue(est, "all_to_all", sent, received, serial=k == 0)
        _issue(est, "all_to_all", received * back, sent * back, serial=k == len(rounds) - 1)
        peak = np.maximum(peak, 3 * held)  # gathered matrices, updates, send buffer
        est.path_flops += float((est.flops - before).max())
    est.buckets = len(rounds)
    shard = np.zeros(W)
    for p in specs:
        per_row = p.numel // max(p.shape[0], 1)
        mult = 1 if p.algorithm == "root" else 2
        rows = per_row * _chunks(p.shape[0], W)
        shard += o.state_bytes * mult * rows
        # sharded.step on the local shards: momentum, decay + update (and the shard copied
        # into the send buffer, ``torch.cat``), or AdamW; the non-finite check and norm of
        # the local gradient; updates received in a narrower dtype are cast to float32 once
        est.traffic += rows * (root_state_bytes(o) + 8 if p.algorithm == "root" else adamw_bytes(o))
        est.traffic += rows * 2 * finite_check_bytes(o)
        if p.algorithm == "root" and ret_bytes < 4:
            est.traffic += rows * (ret_bytes + 4)
    # the owner rebuilds each matrix from its W shards (``torch.cat``, float32: read +
    # write) and cuts the update into rows for them (``torch.cat`` in the return dtype;
    # a narrower one first cast from the float32 update, as on a GPU)
    est.traffic += (8.0 + 2 * ret_bytes + (4 + ret_bytes if ret_bytes < 4 else 0)) * est.elements
    est.memory += shard + peak + ws


# ---------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """The constants a time estimate assumes. ``link``: bytes/s one rank sends (and
    receives) between nodes in a large collective; ``node_link``: the same inside a node;
    ``latency``: seconds per collective; ``flops``: peak matmul rate in the Newton–Schulz
    dtype; ``ns_efficiency``: the fraction of it Newton–Schulz reaches; ``memory_bw``:
    bytes/s (read + written) of a streaming elementwise pass, charged for
    ``Estimate.traffic``; ``clip_passes``: float32 passes at ``memory_bw`` that the
    quantile selection and clamp cost per thresholded element. ``compute_units``:
    independent compute units the ranks of one node share (CPU cores with one thread per
    rank; infinite for one GPU per rank): a rank computes at ``min(1, compute_units /
    ranks on its node)`` of ``flops`` and ``memory_bw``. ``links``: per collective kind
    (:data:`LINK_KINDS`) its own ``(latency s, bytes/s)``, used instead of ``latency`` and
    ``link`` for that kind (empty: one link for all). ``sources``: where each number
    comes from."""

    name: str
    link: float
    node_link: float
    latency: float
    flops: float
    ns_efficiency: float
    memory_bw: float
    memory: float = math.inf  # device memory per rank, bytes
    sources: tuple[str, ...] = ()
    compute_units: float = math.inf
    clip_passes: float = CLIP_PASSES
    links: tuple[tuple[str, float, float], ...] = ()  # (kind, latency s, bytes/s)

    def link_of(self, kind: str) -> tuple[float, float]:
        """``(latency s, bytes/s)`` of a collective of ``kind`` between nodes."""
        for k, lat, bw in self.links:
            if k == kind:
                return lat, bw
        return self.latency, self.link


# NVIDIA H100 SXM5 in DGX/HGX H100 nodes of 8 GPUs.
H100 = Hardware(
    name="H100-SXM5 (bf16), 8 per node, 400 Gb/s InfiniBand per GPU",
    link=0.8 * 50e9,
    node_link=0.8 * 450e9,
    latency=50e-6,
    flops=989e12,
    ns_efficiency=0.6,
    memory_bw=3.35e12,
    memory=80e9,
    sources=(
        "bf16 dense tensor-core rate 989 TFLOP/s, HBM3 3.35 TB/s, 80 GB: NVIDIA H100 "
        "Tensor Core GPU datasheet (SXM5)",
        "between nodes: one 400 Gb/s NDR InfiniBand adapter per GPU (DGX H100: 8 ConnectX-7) "
        "= 50 GB/s per direction; inside a node: NVLink 4, 900 GB/s = 450 GB/s per "
        "direction (same datasheet); 80 % of either reached by large collectives (assumed)",
        "50 µs per collective launch at 1,024 ranks (assumed)",
        "Newton–Schulz GEMMs at 60 % of the bf16 peak (assumed)",
        "elementwise passes (momentum, update, AdamW, bucket copies: bytes read + written "
        "counted per design from the code) at the HBM3 3.35 TB/s of the datasheet; "
        "quantile + clamp 6 float32 passes per thresholded element (assumed); one link "
        "for every collective kind (NCCL's bus bandwidth, above)",
    ),
)


@dataclass(frozen=True)
class Workload:
    """What one step trains on: tokens per step, sequence length, and the MFU of the
    model's forward/backward."""

    tokens: int
    seq_len: int
    mfu: float
    source: str = ""


# 4M-token batches of 8,192-token sequences at the MFU Llama 3 reports (38–43 % bf16 MFU
# on 8K–16K H100s: arXiv 2407.21783, Table 4).
LLAMA3_WORKLOAD = Workload(
    tokens=4 * 1024 * 1024,
    seq_len=8192,
    mfu=0.40,
    source="4M tokens per step, 8,192-token sequences, 40 % MFU (Llama 3, arXiv 2407.21783, Table 4)",
)


def train_flops_per_token(
    params: Sequence[ParamSpec], layers: int, d_model: int, seq_len: int
) -> float:
    """Forward + backward FLOPs per token: 6·N for the weights plus causal attention,
    6·layers·d_model·seq_len (12·L·d·seq halved by the mask)."""
    n = sum(p.numel for p in params)
    return 6.0 * n + 6.0 * layers * d_model * seq_len


@dataclass
class StepTime:
    ns: float  # Newton–Schulz seconds on the path: each round waits for its busiest rank
    elementwise: float  # streaming passes (traffic) + quantile/clamp on the busiest rank
    comm: float  # communication not hidden behind backward, serial
    latency: float  # collectives issued by the step × latency
    fwd_bwd: float  # forward + backward of the model
    # optimizer seconds when the communication overlaps the compute, all but ``serial``
    # (a bound for the design: the code overlaps only the owner reduce-scatters, with
    # backward)
    overlapped: float
    threshold: float = 0.0  # of elementwise: the busiest rank's quantile + clamp
    serial: float = 0.0  # of comm: before the first Newton–Schulz or after the last

    @property
    def optimizer(self) -> float:
        """Optimizer seconds per step with nothing overlapped (an upper bound)."""
        return self.ns + self.elementwise + self.comm + self.latency

    @property
    def fraction(self) -> float:
        return self.optimizer / self.fwd_bwd if self.fwd_bwd else math.nan

    @property
    def fraction_overlapped(self) -> float:
        return self.overlapped / self.fwd_bwd if self.fwd_bwd else math.nan


def step_time(
    est: Estimate, hw: Hardware, work: Workload | None = None, flops_per_token: float = 0.0
) -> StepTime:
    """Seconds per step for ``est`` on ``hw``. What the AdamW baseline also moves behind
    backward (DDP's all-reduce, FSDP2's reduce-scatter and gathers; ``owner``'s
    reduce-scatter when it starts in backward) is not optimizer time."""
    W = est.world
    share = min(1.0, hw.compute_units / min(W, est.options.gpus_per_node))
    traffic = est.traffic if est.traffic.size else np.zeros(W)
    rate = hw.flops * hw.ns_efficiency * share
    ns_r = est.flops / rate  # per rank: Newton–Schulz, quantile + clamp, streaming passes
    threshold_r = est.elements * (4 * hw.clip_passes) / hw.memory_bw / share
    compute = ns_r + threshold_r + traffic / hw.memory_bw / share
    busiest = int(compute.argmax())
    threshold = float(threshold_r[busiest])
    elementwise = float(compute[busiest] - ns_r[busiest])
    # on the path: every round waits for its own busiest rank (Estimate.path_flops)
    ns = max(est.path_flops / rate, float(ns_r[busiest]))
    # each kind's exposed bytes at its own link; what _issue did not attribute (none
    # today) at the generic one
    wire = est.node / hw.node_link
    rest = est.exposed.copy()
    for kind, nbytes in est.exposed_kind.items():
        wire = wire + nbytes / hw.link_of(kind)[1]
        rest = rest - nbytes
    comm_r = wire + np.clip(rest, 0, None) / hw.link
    comm = float(comm_r.max())
    # what no schedule hides behind compute (Estimate.serial_kind), per rank
    serial_r = est.node / hw.node_link
    for kind, nbytes in est.serial_kind.items():
        serial_r = serial_r + nbytes / hw.link_of(kind)[1]
    serial = float(serial_r[int(comm_r.argmax())]) if W > 1 else 0.0
    counted = sum(est.collectives_kind.values())
    latency = sum(n * hw.link_of(k)[0] for k, n in est.collectives_kind.items())
    latency += max(0, est.exposed_collectives - counted) * hw.latency
    fwd_bwd = 0.0
    if work is not None and flops_per_token:
        fwd_bwd = flops_per_token * work.tokens / (W * hw.flops * work.mfu)
    # the rest of the communication overlapped with the compute
    overlapped = max(ns + elementwise, comm - serial) + serial + latency
    return StepTime(ns, elementwise, comm, latency, fwd_bwd, overlapped, threshold, serial)


def measured_hardware(
    name: str,
    *,
    ns_flops_per_s: float,
    memory_bytes_per_s: float,
    clip_s_per_element: float,
    links: dict[str, tuple[float, float]],
    compute_units: float,
    sources: tuple[str, ...] = (),
) -> Hardware:
    """A :class:`Hardware` from measured constants of one machine (the calibration of
    ``benchmarks/bench_dist.py --calibrate``): the Newton–Schulz rate one rank reaches
    alone (``ns_efficiency`` 1: the rate is already what Newton–Schulz achieves), the
    bytes/s of streaming elementwise passes (``memory_bw``), the seconds per thresholded
    element of the quantile selection and clamp (turned into ``clip_passes`` float32
    passes at that rate), ``(latency s, bytes/s)`` for each of :data:`LINK_KINDS`, and
    the compute units the ranks share. Every constant must be positive and finite
    (``compute_units`` may be infinite)."""
    missing = [k for k in LINK_KINDS if k not in links]
    if missing:
        raise ValueError(f"links: no constants for {', '.join(missing)}")
    checks = [
        ("ns_flops_per_s", ns_flops_per_s),
        ("memory_bytes_per_s", memory_bytes_per_s),
        ("clip_s_per_element", clip_s_per_element),
    ]
    for k in LINK_KINDS:
        checks += [(f"{k} latency", links[k][0]), (f"{k} link", links[k][1])]
    for key, v in checks:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{key} must be positive and finite, got {v!r}")
    if not compute_units > 0:
        raise ValueError(f"compute_units must be positive, got {compute_units!r}")
    lat, bw = links["all_to_all"]
    return Hardware(
        name=name,
        link=bw,
        node_link=bw,
        latency=lat,
        flops=ns_flops_per_s,
        ns_efficiency=1.0,
        memory_bw=memory_bytes_per_s,
        sources=sources,
        compute_units=compute_units,
        clip_passes=clip_s_per_element * memory_bytes_per_s / 4,
        links=tuple((k, links[k][0], links[k][1]) for k in LINK_KINDS),
    )


def fit_link(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(latency s, link bytes/s)`` of ``t = latency + bytes / link`` from ``(bytes per
    rank, seconds)`` measurements of single collectives: the latency is the time of the
    smallest message, the link the least-squares slope of the others' time above it
    (a line fitted through all points lets the large messages decide the intercept)."""
    if len(points) < 2:
        raise ValueError("need at least two (bytes, seconds) points")
    pts = sorted(points)
    latency = pts[0][1]
    x = np.array([b - pts[0][0] for b, _ in pts[1:]], dtype=np.float64)
    t = np.array([s - latency for _, s in pts[1:]], dtype=np.float64)
    slope = float(x @ t / (x @ x)) if float(x @ x) > 0 else math.nan
    if not (latency > 0 and math.isfinite(latency)):
        raise ValueError(f"latency must be positive and finite, got {latency!r}")
    if not (slope > 0 and math.isfinite(slope)):
        raise ValueError(f"time does not grow with bytes (slope {slope!r}): no link rate")
    return latency, 1.0 / slope


def llama3_flops_per_token(model: str, seq_len: int = LLAMA3_WORKLOAD.seq_len) -> float:
    shape = LLAMA3[model]
    return train_flops_per_token(llama3_params(model), shape.layers, shape.d_model, seq_len)


# The settings the large-scale table assumes: bf16 gradients, parameters and
# Newton–Schulz (ROOT's ns_dtype="bfloat16"), float32 state, 1 GiB buckets, the owner
# reduce-scatter started in backward (no DDP wrapper).
SCALE_OPTIONS = Options(grad_bytes=2, param_bytes=2, ns_bytes=2, bucket_bytes=GiB)


def table_rows(
    models: Iterable[str],
    worlds: Iterable[int],
    designs: Iterable[Design],
    options: Options = SCALE_OPTIONS,
    hw: Hardware = H100,
    work: Workload = LLAMA3_WORKLOAD,
) -> list[dict[str, Any]]:
    """One row per (model, W, design): what the CLI prints and plots."""
    rows = []
    worlds = list(worlds)
    designs = list(designs)
    for model in models:
        params = llama3_params(model)
        fpt = llama3_flops_per_token(model, work.seq_len)
        for w in worlds:
            for d in designs:
                e = estimate(params, w, d, options)
                t = step_time(e, hw, work, fpt)
                rows.append(
                    {
                        "model": model,
                        "world": w,
                        "design": d,
                        "matrices": len([p for p in params if p.algorithm == "root"]),
                        "bytes_per_rank": e.bytes_per_rank,
                        "vs_adamw": e.vs_adamw,
                        "collectives": e.total_collectives,
                        "step_collectives": e.exposed_collectives,
                        "critical_tflop": e.critical_flops / 1e12,
                        "lower_bound_tflop": e.lower_bound_flops / 1e12,
                        "path_tflop": max(e.path_flops, e.critical_flops) / 1e12,
                        "imbalance": e.imbalance,
                        "memory_gib": e.peak_memory / GiB,
                        "optimizer_s": t.optimizer,
                        "overlapped_s": t.overlapped,
                        "fwd_bwd_s": t.fwd_bwd,
                        "fraction": t.fraction,
                        "fraction_overlapped": t.fraction_overlapped,
                    }
                )
    return rows


def model_state_bytes(est: Estimate) -> float:
    """Parameters and gradients a rank holds (activations not counted): all of them in
    the DDP designs, a 1/W shard with FSDP2."""
    per = est.options.param_bytes + est.options.grad_bytes
    if est.design == "fsdp":
        return per * est.params / est.world
    return float(per * est.params)


@dataclass
class Verdict:
    model: str
    world: int
    rows: list[dict[str, Any]]  # per design: fraction, fraction_overlapped, fits, ...
    best: str | None  # the design with the smallest optimizer time among those that fit
    target: float

    @property
    def best_row(self) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["design"] == self.best), None)

    def _best_line(self, label: str, b: dict[str, Any]) -> str:
        ok = "meets" if b["fraction"] <= self.target else "misses"
        ok_o = "meets" if b["fraction_overlapped"] <= self.target else "misses"
        return (
            f"  {label}: {b['design']}: {100 * b['fraction']:.2f} % with nothing "
            f"overlapped ({ok} the {100 * self.target:.0f} % target), "
            f"{100 * b['fraction_overlapped']:.2f} % with communication overlapped ({ok_o} it); "
            f"Newton–Schulz {b['path_tflop']:.1f} TFLOP on the step's path (the busiest "
            f"rank {b['critical_tflop']:.1f}, lower bound {b['lower_bound_tflop']:.1f}), "
            f"forward/backward {b['fwd_bwd_s']:.2f} s"
        )

    def lines(self, hw: Hardware, work: Workload, options: Options) -> list[str]:
        out = [f"verdict: {self.model} at W = {self.world:,}"]
        for r in self.rows:
            fit = "fits" if r["fits"] else "does not fit"
            out.append(
                f"  {r['design']:<10} optimizer {1e3 * r['optimizer_s']:8.1f} ms = "
                f"{100 * r['fraction']:6.2f} % of forward/backward "
                f"({100 * r['fraction_overlapped']:.2f} % overlapped); "
                f"{r['memory_gib'] + r['model_state_gib']:.0f} GiB/rank ({fit})"
            )
        b = self.best_row
        if b is None:
            out.append("  no design fits in device memory")
        else:
            out.append(self._best_line("best that fits", b))
        out.append("assumptions:")
        out.append(f"  hardware: {hw.name}")
        out += [f"    - {src}" for src in hw.sources]
        out.append(f"  workload: {work.source}")
        out.append(
            f"  settings: gradients {options.grad_bytes} B, parameters {options.param_bytes} B, "
            f"Newton–Schulz {options.ns_bytes} B per element ({options.ns_steps} iterations), "
            f"state {options.state_bytes} B; buckets {options.bucket_bytes / MiB:.0f} MiB; "
            "owner's reduce-scatter "
            + ("started in backward" if options.average_grads else "replaced by DDP's all-reduce")
        )
        out.append(
            "  optimizer time = Newton–Schulz on the path (each round waits for its busiest rank) + elementwise passes + exposed "
            "communication + latency × collectives issued by the step; what AdamW under the "
            "same wrapper also moves behind backward is not counted; activations not in memory; "
            "overlapped: all communication but what precedes the first Newton–Schulz or "
            "follows the last hidden behind compute (a bound: the code overlaps only the "
            "owner reduce-scatters, with backward)"
        )
        return out


def verdict(
    model: str,
    world: int,
    designs: Iterable[Design] = DESIGNS,
    options: Options = SCALE_OPTIONS,
    hw: Hardware = H100,
    work: Workload = LLAMA3_WORKLOAD,
    target: float = 0.02,
) -> Verdict:
    """The optimizer's share of a step for ``model`` at ``world`` ranks, per design, and
    the best design that fits in device memory."""
    rows = table_rows([model], [world], designs, options, hw, work)
    params = llama3_params(model)
    for r in rows:
        e = estimate(params, world, r["design"], options)
        r["model_state_gib"] = model_state_bytes(e) / GiB
        r["fits"] = (model_state_bytes(e) + e.peak_memory) <= hw.memory
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["optimizer_s"])["design"] if fitting else None
    return Verdict(model, world, rows, best, target)
