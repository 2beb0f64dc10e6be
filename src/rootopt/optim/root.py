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

from rootopt.coeffs import CoefficientSpec, Resolution
from rootopt.coeffs.cache import CoefficientCache
from rootopt.optim import _options
from rootopt.optim._coefficients import coefficients_for, resolve_group
from rootopt.optim._finite import NonFiniteGradientError, check_finite
from rootopt.optim._options import _lr, algorithm_of, state_dtype
from rootopt.optim.adamw import adamw_
from rootopt.optim.functional import (
    LrScale,
    NDView,
    OrthoMethod,
    _multi_tensor_root,
    _single_tensor_root,
)
from rootopt.optim.routing import check_splits, fused_splits, warn_lora
from rootopt.optim.telemetry import Recorder

NonFinite = Literal["error", "skip"]
DEFAULT_BUCKET_BYTES = _options.CPU_BUCKET_BYTES  # "auto" on the CPU
# Attributes rebuilt on unpickling instead of saved (see ROOT.__getstate__).
_NOT_PICKLED = frozenset({"_coeffs", "telemetry", "_compiled"})

__all__ = ["ROOT", "NonFiniteGradientError", "algorithm_of", "fused_splits", "state_dtype"]


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
            ``"algorithm"`` routes per parameter: ``ndim >= 2`` ROOT, the rest AdamW
            (:func:`rootopt.param_groups` builds safe groups from a model).
        lr, momentum, nesterov, weight_decay: as in the update above.
        ns_steps, ns_coefficients: K iterations; ``"muon"`` (the default: Muon's tuple,
            chosen by the defaults study, docs/benchmarks.md), ``"polar_express"``, ``"adanewton"``
            (shape-specific, certified stable; ``"adanewton-static"`` is an alias of it),
            ``"official"`` (the paper's table + Muon fallback), ``"you"``, ``"cans"``,
            ``"cubic"``, ``"quintic"``, an ``(a, b, c)`` tuple, K tuples or ``(rows, cols, K) -> tuples``.
        ns_dtype: iteration dtype: ``"auto"`` (the default: bfloat16 where the device
            multiplies it natively, i.e. CUDA with bf16 units and x86 CPUs with AVX-512 BF16
            or AMX, float32 elsewhere; docs/optimizer.md), ``"bfloat16"`` or ``"float32"``;
            TF32 is torch's own setting.
        ortho_method: ``"newton_schulz"``, ``"svd"`` (exact UVᵀ) or ``"qr"``.
        outlier_quantile: quantile q of the soft threshold; ``None`` disables it.
        lr_scale: ``"moonlight"``, ``"muon"`` or ``"none"``.
        nd_view: N-D weights as matrices: ``"auto"`` (3-D: a stack, 4-D+: ``(out, rest)``),
            ``"flatten"`` or ``"batch"``.
        robust_scaling, robust_window, robust_lambda: per-element robust scaling (off;
            :func:`rootopt.optim.functional.robust_scale`).
        adamw_betas, adamw_eps: the internal AdamW's constants.
        batched: stack same-shape matrices (fast path) instead of the reference loop.
        ns_gram: ``"auto"``: Newton–Schulz in Gram space where measured to pay and hold
            (:func:`rootopt.ortho.prefer_spectral`, then :func:`rootopt.ortho.prefer_gram`);
            ``"on"``: the Gram-space recursion; ``"spectral"``: the same map through the
            Gram matrix's eigendecomposition; ``"off"``: the plain iteration.
        bucket_bytes: most bytes of float32 matrices stacked at once (0: no limit;
            ``"auto"``: 32 MiB on the CPU, up to 1 GiB on an accelerator).
        ns_fit: opt-in: shapes the AdaNewton table lacks are fitted and cached while the
            optimizer is built (off: the shipped table or its certified generalisation);
            needs the rootopt-analysis package (``pip install ./analysis``).
        telemetry, record_spectra: per-matrix diagnostics in ``self.telemetry`` after each
            step (or on the steps ``self.telemetry_enabled`` is set), with spectra of ``B``.
        nonfinite: ``"error"`` raises :class:`NonFiniteGradientError` before anything is
            updated; ``"skip"`` leaves parameters with NaN/Inf gradients (and their state)
            untouched and lists them in ``self.skipped``. One host sync per step.
        compile_step: the whole step through ``torch.compile``: ``True`` or a mode name
            (``"reduce-overhead"`` captures CUDA graphs). The first step runs eagerly (it
            creates the state); steps with telemetry on too (docs/performance.md).
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
        ns_coefficients: CoefficientSpec = "muon",
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
        ns_gram: Literal["auto", "on", "off", "spectral"] = "auto",
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
            ns_auto="native",  # how "auto" resolves: _options.group_ns_dtype
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
    def _resolve_group(self, group: dict[str, Any]) -> None:
        resolve_group(self._coeffs, group, lambda p: algorithm_of(group, p) == "root")

    def coefficient_resolutions(self) -> list[Resolution]:
        """What was resolved for every distinct matrix shape (for reports): schedule,
        source and certificate peak."""
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
        for st in self.state.values():  # step counts saved as Python numbers (older versions)
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
        what their step counts advance by (:func:`~rootopt.optim._finite.check_finite`)."""
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
        finite, count = check_finite(
            [cast(Tensor, e[2].grad) for e in entries], [e[3] for e in entries],
            skip=self.nonfinite == "skip",
        )  # fmt: skip
        self.skipped = [e[3] for e, f in zip(entries, finite) if not f]
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

    def _adamw(
        self,
        group: dict[str, Any],
        part: list[tuple[int, Tensor, str]],
        grads: list[Tensor] | None = None,
    ) -> None:
        """AdamW on ``part`` (its step counts already advanced); ``grads``: the gradients
        to use instead of ``p.grad`` (the distributed step's synchronised ones)."""
        states = [self.state[p] for _, p, _ in part]
        steps = [s["step"] for s in states]
        if grads is None:
            grads = [cast(Tensor, p.grad) for _, p, _ in part]
        adamw_(
            [p for _, p, _ in part], grads,
            [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps,
            lr=_lr(group), betas=group["adamw_betas"], eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )  # fmt: skip

    def _root(
        self,
        group: dict[str, Any],
        part: list[tuple[int, Tensor, str]],
        device: torch.device,
        grads: list[Tensor] | None = None,
    ) -> None:
        """ROOT's update of ``part`` (its step counts already advanced); ``grads``: the
        gradients to use instead of ``p.grad`` (the distributed step's synchronised ones:
        :mod:`rootopt.distributed.replicated` runs this very update on what a rank owns)."""
        o = _options.root_options(group, device, _lr(group))
        coefficients = coefficients_for(self._coeffs, group, device)
        params = [p for _, p, _ in part]
        states = [self.state[p] for p in params]
        bufs = [s["momentum_buffer"] for s in states]
        if grads is None:
            grads = [cast(Tensor, p.grad) for p in params]
        grads = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, bufs)]
        splits = group.get("ns_split")
        blocks = [splits[pi] for pi, _, _ in part] if splits else None
        robust = group["robust_scaling"]
        rec = Recorder() if self.telemetry_enabled else None
        if group["batched"]:
            _multi_tensor_root(
                params, grads, bufs, [s["step"] for s in states], o, coefficients,
                blocks=blocks, record=None if rec is None else rec.record,
                robust=([s["robust_mean"] for s in states], [s["robust_sq"] for s in states])
                if robust else None,
            )  # fmt: skip
        else:
            for i, (p, g, s) in enumerate(zip(params, grads, states)):
                _single_tensor_root(
                    p, g, s["momentum_buffer"], s["step"], o, coefficients,
                    blocks=None if blocks is None else blocks[i],
                    robust=(s["robust_mean"], s["robust_sq"]) if robust else None,
                    record=None if rec is None else rec.at(i),
                )  # fmt: skip
        if rec is not None:
            self.telemetry.update(
                rec.finish(
                    [name for _, _, name in part], params, lr=float(o.lr),
                    spectra=self.record_spectra,
                )
            )  # fmt: skip
