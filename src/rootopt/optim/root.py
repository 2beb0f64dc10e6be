"""The ROOT optimizer as a ``torch.optim.Optimizer``: defaults, groups, state and ``step``.

The update is :mod:`rootopt.optim.functional` (momentum → threshold → orthogonalize →
decay and scaled step), the AdamW part :mod:`rootopt.optim.adamw`, option checks
:mod:`rootopt.optim._options`, telemetry :mod:`rootopt.optim.telemetry`, coefficients a
:class:`~rootopt.coeffs.cache.CoefficientCache`. This class gathers parameters, gradients
and state and calls them: ``batched=True`` (default) the stacked path, ``batched=False`` the
per-matrix reference, tested equal (``tests/test_paths.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from rootopt.coeffs import CoefficientError, CoefficientSpec, Resolution
from rootopt.coeffs.cache import CoefficientCache
from rootopt.optim import _options
from rootopt.optim.adamw import adamw_
from rootopt.optim.functional import (
    CoefficientsFor,
    LrScale,
    Matrix,
    NDView,
    OrthoMethod,
    Record,
    RootOptions,
    _multi_tensor_root,
    _single_tensor_root,
    matrices,
    matrix_view,
)
from rootopt.optim.routing import check_splits, fused_splits, warn_lora
from rootopt.optim.telemetry import matrix_telemetry

Algorithm = Literal["root", "adamw"]
NonFinite = Literal["error", "skip"]
DEFAULT_BUCKET_BYTES = _options.CPU_BUCKET_BYTES  # "auto" on the CPU
# Attributes rebuilt on unpickling instead of saved (see ROOT.__getstate__).
_NOT_PICKLED = frozenset({"_coeffs", "telemetry", "_compiled"})

__all__ = ["ROOT", "NonFiniteGradientError", "algorithm_of", "fused_splits", "state_dtype"]


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf; nothing was updated."""


def state_dtype(p: Tensor) -> torch.dtype:
    """dtype of a parameter's optimizer state: the higher of float32 and the parameter's
    (bfloat16/float16 parameters keep float32 state, float64 parameters float64)."""
    return torch.promote_types(p.dtype, torch.float32) if p.is_floating_point() else torch.float32


def algorithm_of(group: dict[str, Any], p: Tensor) -> Algorithm:
    """The update a parameter of ``group`` gets: the group's ``algorithm`` when it names
    one, else (``"auto"``, a user group) ROOT for tensors with ``ndim >= 2``, AdamW for
    the rest."""
    algo = group.get("algorithm")
    if algo in ("root", "adamw"):
        return cast(Algorithm, algo)
    return "root" if p.ndim >= 2 else "adamw"


def _lr(group: dict[str, Any]) -> float | Tensor:
    """The group's lr: a number, or a tensor lr kept as a tensor in a traced step (reading
    it would be a guard; schedulers fill it in place)."""
    lr = group["lr"]
    return lr if isinstance(lr, Tensor) and torch.compiler.is_compiling() else float(lr)


def _at(record: Record | None, i: int) -> Record | None:
    """``record`` for the reference path, which numbers its one parameter 0."""
    if record is None:
        return None

    def at(_: int, m: Matrix, M: Tensor, U: Tensor) -> None:
        record(i, m, M, U)

    return at


class ROOT(Optimizer):
    r"""ROOT: Robust Orthogonalized OpTimizer (He et al., arXiv 2511.20626).

    For every weight matrix (``algorithm="root"``), per step::

        buf = momentum * buf + g;   v = g + momentum * buf  (nesterov)  else buf
        eps = quantile(|v|, outlier_quantile) + 1e-9           # per matrix
        B   = clamp(v, -eps, eps)                               # outliers removed
        U   = NewtonSchulz_K(B; shape-specific coefficients)    # ≈ polar factor of B
        p   = p * (1 - lr * weight_decay) - lr * s(rows, cols) * U

    with ``s = 0.2 * sqrt(max(rows, cols))`` (``lr_scale="moonlight"``). Every other
    tensor (``algorithm="adamw"``: embeddings, heads, norms, biases) gets bias-corrected
    AdamW with ``adamw_betas``/``adamw_eps`` and the group's ``lr``/``weight_decay``.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts. A group without
            ``"algorithm"`` routes per parameter: ``ndim >= 2`` ROOT, the rest AdamW.
            :func:`rootopt.param_groups` builds safe groups from a model.
        lr, momentum, nesterov, weight_decay: as in the update above.
        ns_steps: Newton–Schulz iterations K.
        ns_coefficients: ``"adanewton"`` (shape-specific, stable, per-matrix selection),
            ``"official"`` (the paper's 4-shape table + Muon fallback), ``"muon"``,
            ``"polar_express"``, ``"you"``, ``"cans"``, ``"cubic"``, ``"quintic"``, an
            ``(a, b, c)`` tuple, a list of K tuples, or a callable ``(rows, cols, K) -> tuples``.
        ns_dtype: iteration dtype: ``"auto"`` (per device, ``_options.AUTO_NS_DTYPE``:
            float32 everywhere today; TF32 follows torch's own setting), ``"float32"``,
            ``"bfloat16"``, ``"float16"``, ``"float64"``.
        ortho_method: ``"newton_schulz"``, ``"svd"`` (exact UVᵀ) or ``"qr"``.
        outlier_quantile: quantile q of the soft threshold; ``None`` disables it.
        lr_scale: ``"moonlight"``, ``"muon"`` or ``"none"``.
        nd_view: how N-D weights become matrices: ``"auto"`` (3-D = stack of matrices,
            4-D+ = flattened to ``(out, rest)``), ``"flatten"`` or ``"batch"``.
        robust_scaling, robust_window, robust_lambda: per-element robust scaling (off by
            default; :func:`rootopt.optim.functional.robust_scale`).
        adamw_betas, adamw_eps: the internal AdamW's constants.
        batched: stack same-shape matrices (fast path) instead of the reference loop.
        ns_gram: ``"auto"`` runs Newton–Schulz in Gram space where it was measured to pay
            and hold (:func:`rootopt.ortho.prefer_gram`), ``"on"``/``"off"`` force it.
        bucket_bytes: most bytes of float32 matrices stacked at once (0: no limit);
            ``"auto"``: 32 MiB on the CPU, up to 1 GiB on an accelerator (fewer launches).
        ns_fit: opt-in offline fitting for ``"adanewton"``: a shape the table lacks is read
            from the user cache or fitted and cached while the optimizer is built. Off by
            default: coefficients come from the shipped table or its certified
            generalisation, with no file read or written.
        telemetry: record per-matrix diagnostics in ``self.telemetry`` after each step
            (or set ``self.telemetry_enabled`` on the steps to record).
        record_spectra: with telemetry, also the normalised singular values of ``B``.
        nonfinite: ``"error"`` raises :class:`NonFiniteGradientError` before anything is
            updated; ``"skip"`` leaves parameters with NaN/Inf gradients (and their state)
            untouched and lists them in ``self.skipped``. One host sync per step.
        compile_step: run the whole step (gradient check, both parts) through
            ``torch.compile``: ``True`` (default mode) or a mode name
            (``"reduce-overhead"`` captures CUDA graphs). The first step runs eagerly
            (it creates the state) and the second compiles; steps with telemetry on run
            eagerly (docs/performance.md, "Launches").
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_coefficients: CoefficientSpec = "adanewton",
        ns_dtype: str | torch.dtype = "auto",
        ortho_method: OrthoMethod = "newton_schulz",
        outlier_quantile: float | None = 0.9,
        lr_scale: LrScale = "moonlight",
        nd_view: NDView = "auto",
        robust_scaling: bool = False,
        robust_window: int = 100,
        robust_lambda: float = 0.1,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        batched: bool = True,
        ns_gram: Literal["auto", "on", "off"] = "auto",
        bucket_bytes: int | Literal["auto"] = "auto",
        ns_fit: bool = False,
        telemetry: bool = False,
        record_spectra: bool = False,
        nonfinite: NonFinite = "error",
        compile_step: bool | str = False,
    ) -> None:
        defaults: dict[str, Any] = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            ortho_method=ortho_method, outlier_quantile=outlier_quantile, lr_scale=lr_scale,
            nd_view=nd_view, robust_scaling=robust_scaling, robust_window=robust_window,
            robust_lambda=robust_lambda, adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
            batched=batched, ns_gram=ns_gram, bucket_bytes=bucket_bytes, ns_fit=ns_fit,
        )  # fmt: skip
        _options.check_options(defaults)
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"Invalid nonfinite: {nonfinite!r} (choose 'error' or 'skip')")
        if not isinstance(telemetry, bool) or not isinstance(record_spectra, bool):
            raise ValueError("Invalid telemetry/record_spectra: must be True or False")
        if not isinstance(compile_step, bool) and compile_step not in _options.COMPILE_MODES:
            raise ValueError(
                f"Invalid compile_step: {compile_step!r} (True, False or one of "
                f"{_options.COMPILE_MODES})"
            )
        self.nonfinite: NonFinite = nonfinite
        self.telemetry_enabled = telemetry
        self.record_spectra = record_spectra
        self.compile_step = compile_step
        self.telemetry: dict[str, dict[str, Any]] = {}
        self.skipped: list[str] = []
        self._coeffs = CoefficientCache()  # resolved in add_param_group, never in step()
        self._compiled: Callable[[], None] | None = None
        super().__init__(params, defaults)

    # ------------------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group; it stays one entry of ``param_groups``, as with any torch
        optimizer. Atomic: when it raises, nothing was added."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        items = param_group["params"]
        if isinstance(items, set):
            # torch.optim.Optimizer.add_param_group's error, raised before anything changes.
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but "
                "the ordering of tensors in sets will change between runs. "
                "Please use a list instead."
            )
        items = [items] if isinstance(items, Tensor) else list(items)
        tensors = [i[1] if isinstance(i, tuple) else i for i in items]
        for t in tensors:
            if isinstance(t, Tensor) and t.is_complex():
                raise RuntimeError(
                    f"ROOT does not support complex parameters (shape {tuple(t.shape)})"
                )
        names = param_group.get("param_names")
        if names is not None and len(names) != len(items):
            raise ValueError(
                f"param_names lists {len(names)} names for {len(items)} parameters; they must match"
            )
        param_group = dict(
            param_group, params=items, algorithm=param_group.get("algorithm") or "auto"
        )
        merged = {**self.defaults, **param_group}
        if isinstance(merged.get("adamw_betas"), list):
            param_group["adamw_betas"] = merged["adamw_betas"] = tuple(merged["adamw_betas"])
        _options.check_options(merged)
        if "ns_dtype" in param_group:
            param_group["ns_dtype"] = merged["ns_dtype"]
        for item, t in zip(items, tensors):
            if param_group["algorithm"] == "root" and isinstance(t, Tensor) and t.ndim < 2:
                name = item[0] if isinstance(item, tuple) else f"shape {tuple(t.shape)}"
                raise ValueError(
                    f"ROOT group got a {t.ndim}-D parameter ({name}); route it to algorithm='adamw'"
                )
        check_splits(param_group, tensors, merged["robust_scaling"])
        if param_group["algorithm"] == "auto":
            warn_lora(items, names, stacklevel=5)  # the caller of ROOT(...)
        before = len(self.param_groups)
        super().add_param_group(param_group)  # torch's checks (duplicates, leaves, names)
        try:
            self._resolve_group(self.param_groups[-1])
        except BaseException:
            del self.param_groups[before:]
            raise

    # ------------------------------------------------------------------------ coefficients
    def _matrices(self, group: dict[str, Any], pi: int, p: Tensor) -> list[Matrix]:
        splits = group.get("ns_split")
        blocks = splits[pi] if splits else None
        o = RootOptions(
            lr=0.0, lr_scale=group["lr_scale"], transposed=bool(group.get("transposed"))
        )
        return matrices(matrix_view(p.shape, group["nd_view"]), o, blocks)

    def _coefficients(self, group: dict[str, Any], device: torch.device) -> CoefficientsFor:
        spec, steps, fit = group["ns_coefficients"], group["ns_steps"], group.get("ns_fit", False)
        dtype = _options.ns_dtype_name(group["ns_dtype"], device)
        cache = self._coeffs
        return lambda r, c: cache.schedule(spec, r, c, steps, dtype, fitted=fit)

    def _resolve_group(self, group: dict[str, Any]) -> None:
        """Resolve (and certify) the coefficients of every matrix of a group's ROOT
        parameters now, naming the parameter when one fails; nothing is fitted or written
        unless ``ns_fit=True``."""
        if group["ortho_method"] != "newton_schulz":
            return
        fitter = None
        if group.get("ns_fit", False):
            # Opt-in fitting: the one place the runtime reaches the offline tools, and only
            # while the optimizer is being built.
            from rootopt.tools.fitcache import fitted_resolution

            fitter = lambda r, c, k, dt: fitted_resolution(r, c, k, dtype=dt)  # noqa: E731
        for pi, p in enumerate(group["params"]):
            if p.numel() == 0 or algorithm_of(group, p) != "root":
                continue
            dtype = _options.ns_dtype_name(group["ns_dtype"], p.device)
            try:
                for m in self._matrices(group, pi, p):
                    self._coeffs.get(
                        group["ns_coefficients"], m.rows, m.cols, group["ns_steps"], dtype,
                        fitter=fitter,
                    )  # fmt: skip
            except (CoefficientError, ValueError) as exc:
                names = group.get("param_names")
                name = names[pi] if names is not None else f"of shape {tuple(p.shape)}"
                v = matrix_view(p.shape, group["nd_view"])
                raise CoefficientError(
                    f"parameter {name} ({v.rows}x{v.cols} matrix, K={group['ns_steps']}, "
                    f"{dtype}): {exc}"
                ) from None

    def coefficient_resolutions(self) -> list[Resolution]:
        """What was resolved for every distinct matrix shape (for reports): schedule,
        source, certificate peak and the per-matrix selector."""
        return self._coeffs.records()

    # ------------------------------------------------------------- pickling, state dicts
    def __getstate__(self) -> dict[str, Any]:
        """torch's state plus the options kept as attributes, so that ``copy.deepcopy``,
        ``pickle`` and ``torch.save(opt)`` give a working optimizer; coefficients (they may
        hold a user callable) and the compiled step are rebuilt on load."""
        out = super().__getstate__()
        for key, value in self.__dict__.items():
            if key not in out and not key.startswith("_optimizer_") and key not in _NOT_PICKLED:
                out[key] = value
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        d = self.__dict__
        for key, value in (("nonfinite", "error"), ("telemetry_enabled", False),
                           ("record_spectra", False), ("compile_step", False)):  # fmt: skip
            d.setdefault(key, value)
        d.setdefault("telemetry", {})
        d.setdefault("skipped", [])
        d.setdefault("_compiled", None)
        for st in self.state.values():  # step counts saved as Python numbers (before 0.2)
            if "step" in st and not isinstance(st["step"], Tensor):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        if "_coeffs" not in d:
            self._coeffs = CoefficientCache()
            for group in self.param_groups:
                group.setdefault("algorithm", "auto")
                self._resolve_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with: state kept at :func:`state_dtype` (torch casts floating
        state to the parameter's dtype, which would round a bf16 parameter's float32
        momentum; the dict the user's pre-hooks return is the one read), step counts as
        tensors, coefficients resolved now (not in ``step()``), post-hooks run last."""
        final: list[dict[str, Any]] = []
        handle = self.register_load_state_dict_pre_hook(lambda _o, sd: final.append(sd))
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
            self._optimizer_load_state_dict_post_hooks = post_hooks
        sd = final[-1]
        saved_ids = [pid for g in sd["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            for key, value in (sd["state"].get(pid) or {}).items():
                if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                    self.state[p][key] = value.to(device=p.device, dtype=state_dtype(p)).clone()
        for group in self.param_groups:
            group.setdefault("algorithm", "auto")
            self._resolve_group(group)
        for hook in post_hooks.values():
            hook(self)

    # -------------------------------------------------------------------------------- step
    def _name(self, gi: int, group: dict[str, Any], pi: int) -> str:
        names = group.get("param_names")
        return str(names[pi]) if names is not None else f"group{gi}.param{pi}"

    def _collect(self) -> tuple[list[list[tuple[int, Tensor, str]]], float | Tensor]:
        """Per group: ``(index, param, name)`` of the parameters that will be updated, and
        what their step counts advance by. Checks gradient kinds, and finiteness with one
        host synchronisation."""
        entries: list[tuple[int, int, Tensor, str]] = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None or p.numel() == 0:
                    continue
                name = self._name(gi, group, pi)
                if p.grad.is_sparse or p.grad.is_complex():
                    kind = "sparse" if p.grad.is_sparse else "complex"
                    raise RuntimeError(f"ROOT does not support {kind} gradients ({name})")
                entries.append((gi, pi, p, name))
        finite = [True] * len(entries)
        count: float | Tensor = 1.0
        if entries:
            # max |g| per gradient, one _foreach call: NaN propagates and ±Inf shows
            norms = torch._foreach_norm([cast(Tensor, e[2].grad) for e in entries], float("inf"))
            ok = torch.stack([n.to(norms[0].device, torch.float32) for n in norms]).isfinite()
            if torch.compiler.is_compiling() and self.nonfinite == "error":
                # No host sync, no graph break: the assertion precedes every update in the
                # graph, so a failing step changes nothing. The counts advance by the check
                # itself: a compiler may order the CPU counters' update before the assertion.
                every = ok.all()
                msg = "non-finite gradient (NaN/Inf) in a parameter; nothing was updated"
                torch._assert_async(every, msg)
                count = every.to(torch.float32)
            else:
                finite = ok.tolist()  # the one host sync of the step
        bad = [e[3] for e, f in zip(entries, finite) if not f]
        if bad and self.nonfinite == "error":
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN/Inf) in parameter {bad[0]}{more}; nothing was updated"
            )
        self.skipped = bad
        per_group: list[list[tuple[int, Tensor, str]]] = [[] for _ in self.param_groups]
        for (gi, pi, p, name), f in zip(entries, finite):
            if f:
                per_group[gi].append((pi, p, name))
        return per_group, count

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (``closure`` re-evaluates the loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compile_step and not self.telemetry_enabled and self.state:
            # From the second step on: the first creates the state eagerly, so the one
            # graph compiled is the one every later step runs.
            if self._compiled is None:
                mode = None if self.compile_step is True else self.compile_step
                self._compiled = torch.compile(self._step, mode=mode)
            self._compiled()
        else:
            self._step()
        return loss

    def _step(self) -> None:
        per_group, count = self._collect()
        if self.telemetry_enabled:
            self.telemetry = {}
        steps = [
            self._init_state(group, p)["step"]
            for group, entries in zip(self.param_groups, per_group)
            for _, p, _ in entries
        ]
        if isinstance(count, Tensor):  # (a list: the one-tensor overload reads it on the host)
            torch._foreach_add_(steps, [count] * len(steps))
        elif steps:
            torch._foreach_add_(steps, count)
        for group, entries in zip(self.param_groups, per_group):
            by_part: dict[tuple[str, torch.device], list[tuple[int, Tensor, str]]] = {}
            for e in entries:
                by_part.setdefault((algorithm_of(group, e[1]), e[1].device), []).append(e)
            for (algo, device), part in by_part.items():
                if algo == "adamw":
                    self._adamw(group, part)
                else:
                    self._root(group, part, device)

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        if not state:
            keys = ("exp_avg", "exp_avg_sq") if algorithm_of(group, p) == "adamw" else (
                ("momentum_buffer", "robust_mean", "robust_sq")
                if group["robust_scaling"] else ("momentum_buffer",)
            )  # fmt: skip
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in keys:
                state[key] = torch.zeros_like(p, dtype=state_dtype(p))
        return state

    def _adamw(self, group: dict[str, Any], part: list[tuple[int, Tensor, str]]) -> None:
        states = [self.state[p] for _, p, _ in part]
        steps = [s["step"] for s in states]
        adamw_(
            [p for _, p, _ in part], [cast(Tensor, p.grad) for _, p, _ in part],
            [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps,
            lr=_lr(group), betas=group["adamw_betas"], eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )  # fmt: skip

    def _options(self, group: dict[str, Any], device: torch.device) -> RootOptions:
        dtype = _options.ns_dtype_name(group["ns_dtype"], device)
        gram = group.get("ns_gram", "auto")
        return RootOptions(
            lr=_lr(group), momentum=group["momentum"], nesterov=group["nesterov"],
            weight_decay=group["weight_decay"], quantile=group["outlier_quantile"],
            method=group["ortho_method"], ns_dtype=_options.DTYPES[dtype],
            gram=None if gram == "auto" else gram == "on", lr_scale=group["lr_scale"],
            transposed=bool(group.get("transposed", False)), nd_view=group["nd_view"],
            robust_window=group["robust_window"], robust_lambda=group["robust_lambda"],
            bucket_bytes=_options.bucket_budget(group.get("bucket_bytes", "auto"), device),
        )  # fmt: skip

    def _root(
        self, group: dict[str, Any], part: list[tuple[int, Tensor, str]], device: torch.device
    ) -> None:
        o, coefficients = self._options(group, device), self._coefficients(group, device)
        params = [p for _, p, _ in part]
        states = [self.state[p] for p in params]
        bufs = [s["momentum_buffer"] for s in states]
        grads = [cast(Tensor, p.grad) for p in params]
        grads = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, bufs)]
        splits = group.get("ns_split")
        blocks = [splits[pi] for pi, _, _ in part] if splits else None
        robust = group["robust_scaling"]
        pieces: dict[tuple[int, Any], list[tuple[Tensor, Tensor, float]]] = {}
        record: Record | None = None
        if self.telemetry_enabled:

            def record(i: int, m: Matrix, M: Tensor, U: Tensor) -> None:
                pieces.setdefault((i, m.block), []).append((M, U, m.scale))

        if group["batched"]:
            _multi_tensor_root(
                params, grads, bufs, [s["step"] for s in states], o, coefficients,
                blocks=blocks, record=record,
                robust=([s["robust_mean"] for s in states], [s["robust_sq"] for s in states])
                if robust else None,
            )  # fmt: skip
        else:
            for i, (p, g, s) in enumerate(zip(params, grads, states)):
                _single_tensor_root(
                    p, g, s["momentum_buffer"], s["step"], o, coefficients,
                    blocks=None if blocks is None else blocks[i],
                    robust=(s["robust_mean"], s["robust_sq"]) if robust else None,
                    record=_at(record, i),
                )  # fmt: skip
        for (i, block), got in pieces.items():
            name = (
                part[i][2] if block is None else f"{part[i][2]}[{block[1]}:{block[1] + block[2]}]"
            )
            M, U = torch.cat([x[0] for x in got]), torch.cat([x[1] for x in got])
            self.telemetry[name] = matrix_telemetry(
                M, U, quantile=o.quantile, update=U * (float(o.lr) * got[0][2]),
                param=params[i], spectra=self.record_spectra,
            )  # fmt: skip
