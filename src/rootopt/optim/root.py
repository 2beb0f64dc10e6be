"""The ROOT optimizer as a ``torch.optim.Optimizer``.

The class validates options, creates state lazily and calls the pure functions of
:mod:`rootopt.optim.functional`. Two step implementations exist:

* ``_root_reference``: one parameter and one matrix at a time, mirroring the math; the
  ground truth.
* ``_root_batched`` (default, ``batched=True``): matrices of one shape across all the
  group's parameters are stacked and clipped/orthogonalized together; tested equal to the
  reference on parameters and state.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from rootopt.coeffs import (
    CoefficientError,
    CoefficientSpec,
    GramSelector,
    Resolution,
    Schedule,
    resolve_record,
    validate_spec,
)
from rootopt.optim.functional import (
    LrScale,
    MatrixView,
    NDView,
    OrthoMethod,
    adamw_update_,
    adamw_update_foreach_,
    clip_outliers,
    clip_outliers_,
    lr_scale_factor,
    matrix_telemetry,
    matrix_view,
    orthogonal_direction,
    robust_scale,
    root_update_,
)
from rootopt.ortho import METHODS

Algorithm = Literal["root", "adamw"]
NonFinite = Literal["error", "skip"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


# Most bytes of float32 matrices the batched path stacks at once (docs/performance.md).
DEFAULT_BUCKET_BYTES = 32 << 20
GRAM_MODES = ("auto", "on", "off")


# Attributes rebuilt on unpickling instead of saved (see ROOT.__getstate__).
_NOT_PICKLED = frozenset({"_resolutions", "telemetry"})


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf; nothing was updated."""


def _dtype_name(value: object) -> str:
    if isinstance(value, torch.dtype):
        for name, dt in _DTYPES.items():
            if dt == value:
                return name
    if isinstance(value, str) and value in _DTYPES:
        return value
    raise ValueError(f"Invalid ns_dtype: {value!r} (choose one of {sorted(_DTYPES)})")


def _check_options(g: dict[str, Any]) -> None:
    """Validate one group's (or the defaults') hyperparameters; raise naming the bad one."""

    def bad(key: str, rule: str) -> ValueError:
        return ValueError(f"Invalid {key}: {g[key]!r} ({rule})")

    def number(key: str) -> float:
        v = g[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(key, "must be a finite number")
        return float(v)

    lr = g["lr"]
    if isinstance(lr, Tensor):
        # As torch.optim.Adam: a 1-element tensor lr is accepted (schedulers fill it in place).
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point() or not math.isfinite(float(lr)) or float(lr) < 0:
            raise bad("lr", "must be a finite number >= 0")
    elif number("lr") < 0:
        raise bad("lr", "must be >= 0")
    if not 0.0 <= number("momentum") < 1.0:
        raise bad("momentum", "must be in [0, 1)")
    if number("weight_decay") < 0:
        raise bad("weight_decay", "must be >= 0")
    if not isinstance(g["nesterov"], bool):
        raise bad("nesterov", "must be True or False")
    steps = g["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise bad("ns_steps", "must be an integer in [1, 100]")
    validate_spec(g["ns_coefficients"])
    g["ns_dtype"] = _dtype_name(g["ns_dtype"])
    if g["ortho_method"] not in METHODS:
        raise bad("ortho_method", f"choose one of {METHODS}")
    q = g["outlier_quantile"]
    if q is not None and (
        isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q <= 1.0
    ):
        raise bad("outlier_quantile", "must be in (0, 1], or None to disable")
    if g["lr_scale"] not in ("moonlight", "muon", "none"):
        raise bad("lr_scale", "choose 'moonlight', 'muon' or 'none'")
    if g["nd_view"] not in ("auto", "flatten", "batch"):
        raise bad("nd_view", "choose 'auto', 'flatten' or 'batch'")
    if not isinstance(g["robust_scaling"], bool):
        raise bad("robust_scaling", "must be True or False")
    if number("robust_window") < 1:
        raise bad("robust_window", "must be >= 1")
    if number("robust_lambda") < 0:
        raise bad("robust_lambda", "must be >= 0")
    betas = g["adamw_betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise bad("adamw_betas", "must be two numbers in [0, 1)")
    if number("adamw_eps") < 0:
        raise bad("adamw_eps", "must be >= 0")
    if not isinstance(g["batched"], bool):
        raise bad("batched", "must be True or False")
    if g.get("ns_gram", "auto") not in GRAM_MODES:
        raise bad("ns_gram", f"choose one of {GRAM_MODES}")
    b = g.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise bad("bucket_bytes", "must be an integer >= 0 (0: no limit)")
    if not isinstance(g.get("ns_fit", False), bool):
        raise bad("ns_fit", "must be True or False")
    if g.get("algorithm") not in (None, "auto", "root", "adamw"):
        raise bad("algorithm", "choose 'root', 'adamw' or 'auto'")


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


def _lr(group: dict[str, Any]) -> float:
    """The group's lr as a number; a tensor lr stays a tensor in a step traced by
    ``torch.compile`` (reading it would break the graph; schedulers fill it in place)."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and _compiling():
        return cast(float, lr)
    return float(lr)


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
            ``"algorithm"`` is split: tensors with ``ndim >= 2`` get ROOT, the rest AdamW.
            :func:`rootopt.param_groups` builds safe groups from a model.
        lr, momentum, nesterov, weight_decay: as in the update above.
        ns_steps: Newton–Schulz iterations K.
        ns_coefficients: ``"adanewton"`` (shape-specific, stable), ``"official"`` (the
            paper's 4-shape table + Muon fallback), ``"muon"``, ``"polar_express"``,
            ``"you"``, ``"cans"``, ``"cubic"``, ``"quintic"``, an ``(a, b, c)`` tuple, a
            list of K tuples, or a callable ``(rows, cols, K) -> tuples``.
        ns_dtype: iteration dtype, ``"float32"`` (default) or ``"bfloat16"`` etc.
        ortho_method: ``"newton_schulz"``, ``"svd"`` (exact UVᵀ) or ``"qr"``.
        outlier_quantile: quantile q of the soft threshold; ``None`` disables it.
        lr_scale: ``"moonlight"``, ``"muon"`` or ``"none"``.
        nd_view: how N-D weights become matrices: ``"auto"`` (3-D = stack of matrices,
            4-D+ = flattened to ``(out, rest)``), ``"flatten"`` or ``"batch"``.
        robust_scaling, robust_window, robust_lambda: per-element robust scaling
            (off by default; docs/performance.md, "One reference, several fast paths"),
            see :func:`rootopt.optim.functional.robust_scale`.
        adamw_betas, adamw_eps: the internal AdamW's constants.
        batched: stack same-shape matrices (fast path) instead of the reference loop.
        ns_gram: ``"auto"`` runs Newton–Schulz in Gram space where it was measured to pay
            and hold (:func:`rootopt.ortho.prefer_gram`), ``"on"``/``"off"`` force it.
        bucket_bytes: most bytes of float32 matrices stacked at once by the batched path
            (0: no limit); bounds its temporary memory.
        ns_fit: opt-in offline fitting for ``ns_coefficients="adanewton"``: a shape the
            table lacks is read from the user cache or fitted (seconds per shape, under a
            file lock so concurrent processes fit it once) and cached, while the optimizer
            is built. Off by default: then coefficients come from the shipped table or are
            generalised from it (certified), with no file read or written.
        telemetry: record per-matrix diagnostics in ``self.telemetry`` after each step.
        record_spectra: with telemetry, also the normalised singular values of ``B``.
        nonfinite: ``"error"`` raises :class:`NonFiniteGradientError` before anything is
            updated; ``"skip"`` leaves parameters with NaN/Inf gradients (and their
            state) untouched and lists them in ``self.skipped``. One host sync per step.
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
        ns_dtype: str | torch.dtype = "float32",
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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        ns_fit: bool = False,
        telemetry: bool = False,
        record_spectra: bool = False,
        nonfinite: NonFinite = "error",
    ) -> None:
        defaults: dict[str, Any] = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            ortho_method=ortho_method,
            outlier_quantile=outlier_quantile,
            lr_scale=lr_scale,
            nd_view=nd_view,
            robust_scaling=robust_scaling,
            robust_window=robust_window,
            robust_lambda=robust_lambda,
            adamw_betas=tuple(adamw_betas) if isinstance(adamw_betas, list) else adamw_betas,
            adamw_eps=adamw_eps,
            batched=batched,
            ns_gram=ns_gram,
            bucket_bytes=bucket_bytes,
            ns_fit=ns_fit,
        )
        _check_options(defaults)
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"Invalid nonfinite: {nonfinite!r} (choose 'error' or 'skip')")
        if not isinstance(telemetry, bool) or not isinstance(record_spectra, bool):
            raise ValueError("Invalid telemetry/record_spectra: must be True or False")
        self.nonfinite: NonFinite = nonfinite
        self.telemetry_enabled = telemetry
        self.record_spectra = record_spectra
        self.telemetry: dict[str, dict[str, Any]] = {}
        self.skipped: list[str] = []
        # Coefficients are resolved here and in add_param_group, never in step():
        # (spec key, rows, cols, K, dtype, fit) -> Resolution.
        self._resolutions: dict[tuple[Any, ...], Resolution] = {}
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------
    # groups
    # ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group; it stays one entry of ``param_groups``, as with any torch
        optimizer. A group without ``"algorithm"`` (``"auto"``) routes per parameter:
        ``ndim >= 2`` → ROOT, the rest → AdamW. Atomic: when it raises, nothing was added."""
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
        param_group = dict(param_group, params=items)

        def tensor_of(item: Any) -> Tensor:
            return cast(Tensor, item[1] if isinstance(item, tuple) else item)

        for item in items:
            t = tensor_of(item)
            if isinstance(t, Tensor) and t.is_complex():
                raise RuntimeError(
                    f"ROOT does not support complex parameters (shape {tuple(t.shape)})"
                )
        names = param_group.get("param_names")
        if names is not None and len(names) != len(items):
            raise ValueError(
                f"param_names lists {len(names)} names for {len(items)} parameters; they must match"
            )
        if param_group.get("algorithm") is None:
            param_group["algorithm"] = "auto"
        merged = {**self.defaults, **param_group}
        if isinstance(merged.get("adamw_betas"), list):
            param_group["adamw_betas"] = merged["adamw_betas"] = tuple(merged["adamw_betas"])
        _check_options(merged)
        if "ns_dtype" in param_group:
            param_group["ns_dtype"] = merged["ns_dtype"]
        if param_group["algorithm"] == "root":
            for item in items:
                t = tensor_of(item)
                if isinstance(t, Tensor) and t.ndim < 2:
                    name = item[0] if isinstance(item, tuple) else f"shape {tuple(t.shape)}"
                    raise ValueError(
                        f"ROOT group got a {t.ndim}-D parameter ({name}); "
                        "route it to algorithm='adamw'"
                    )
        _check_split(param_group, [tensor_of(i) for i in items], merged)
        if param_group["algorithm"] == "auto":
            _warn_lora(items, names)
        before = len(self.param_groups)
        super().add_param_group(param_group)  # torch's checks (duplicates, leaves, names)
        try:
            self._resolve_group(self.param_groups[-1])
        except BaseException:
            del self.param_groups[before:]
            raise

    # ----------------------------------------------------------------------------------
    # coefficients: resolved at construction (never in step)
    # ----------------------------------------------------------------------------------
    @staticmethod
    def _coeff_key(group: dict[str, Any], rows: int, cols: int) -> tuple[Any, ...]:
        spec = group["ns_coefficients"]
        key_spec = id(spec) if callable(spec) else repr(spec)
        fit = bool(group.get("ns_fit", False)) and spec == "adanewton"
        m, n = min(rows, cols), max(rows, cols)
        return (key_spec, m, n, group["ns_steps"], group["ns_dtype"], fit)

    def _resolve_one(self, group: dict[str, Any], rows: int, cols: int) -> Resolution:
        key = self._coeff_key(group, rows, cols)
        res = self._resolutions.get(key)
        if res is None:
            spec, steps, dtype = group["ns_coefficients"], group["ns_steps"], group["ns_dtype"]
            if key[-1]:
                # Opt-in fitting (ns_fit=True): the only place the runtime reaches the
                # offline tools, and only while the optimizer is being built.
                from rootopt.tools.fitcache import fitted_resolution

                res = fitted_resolution(rows, cols, steps, dtype=dtype)
            else:
                res = resolve_record(spec, rows, cols, steps, dtype=dtype)
            self._resolutions[key] = res
        return res

    def _resolve_group(self, group: dict[str, Any]) -> None:
        """Resolve (and certify) the coefficients of every matrix view of a ROOT group.

        Raises :class:`~rootopt.coeffs.CoefficientError` naming the parameter, its matrix
        shape and the reason; nothing is fitted or written unless ``ns_fit=True``."""
        if group["ortho_method"] != "newton_schulz":
            return
        names = group.get("param_names")
        for pi, p in enumerate(group["params"]):
            if p.ndim < 2 or p.numel() == 0 or algorithm_of(group, p) != "root":
                continue
            view = matrix_view(p.shape, group["nd_view"])
            try:
                for rows, cols in _block_shapes(group, pi, p):
                    self._resolve_one(group, rows, cols)
                if _split_of(group, pi) is not None:
                    continue
                self._resolve_one(group, view.rows, view.cols)
            except (CoefficientError, ValueError) as exc:
                name = names[pi] if names is not None else f"of shape {tuple(p.shape)}"
                raise CoefficientError(
                    f"parameter {name} ({view.rows}x{view.cols} matrix, K={group['ns_steps']}, "
                    f"{group['ns_dtype']}): {exc}"
                ) from None

    def coefficient_resolutions(self) -> list[Resolution]:
        """What was resolved for every distinct matrix shape (for reports): schedule,
        source (table / generalised / nearest / preset / fitted / user), certificate
        peak and the per-matrix selector, one record per ``(shape, K, dtype, spec)``."""
        return list(self._resolutions.values())

    # ----------------------------------------------------------------------------------
    # pickling, deepcopy, state_dict
    # ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param_groups) plus the options kept as
        attributes, so that ``copy.deepcopy``, ``pickle`` and ``torch.save(opt)`` give a
        working optimizer. Hooks are left out as torch does; the coefficient resolutions
        are left out and resolved again on load (they may hold a user callable)."""
        out = super().__getstate__()
        for key, value in self.__dict__.items():
            if key in out or key.startswith("_optimizer_") or key in _NOT_PICKLED:
                continue
            out[key] = value
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        d = self.__dict__
        d.setdefault("nonfinite", "error")
        d.setdefault("telemetry_enabled", False)
        d.setdefault("record_spectra", False)
        d.setdefault("telemetry", {})
        d.setdefault("skipped", [])
        if "_resolutions" not in d:
            self._resolutions = {}
            for group in self.param_groups:
                group.setdefault("algorithm", "auto")
                self._resolve_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with: the user's load pre-hooks honoured (the dict they return is
        the one loaded, including below), state kept at :func:`state_dtype` (torch casts
        floating state to the parameter's dtype, which would round a bf16 parameter's
        float32 momentum), coefficients resolved now (not in ``step()``), post-hooks run
        last, and state dicts of the older split layout (one user group saved as a ROOT
        group and an AdamW group) mapped onto the one-group layout."""
        final: list[dict[str, Any]] = []

        def last_pre_hook(_opt: Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
            sd = self._from_split_layout(sd)
            final.append(sd)
            return sd

        handle = self.register_load_state_dict_pre_hook(last_pre_hook)  # runs after the user's
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
            saved = sd["state"].get(pid)
            if not saved or p.dtype == state_dtype(p):
                continue
            for key, value in saved.items():
                if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                    self.state[p][key] = value.to(device=p.device, dtype=state_dtype(p)).clone()
        # The loaded groups may carry other coefficient options: resolve them now, not in step().
        for group in self.param_groups:
            group.setdefault("algorithm", "auto")
            self._resolve_group(group)
        for hook in post_hooks.values():
            hook(self)

    def _from_split_layout(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Map a state dict saved by rootopt <= 0.x, which split every group without an
        explicit ``algorithm`` into a ROOT group (``ndim >= 2``) and an AdamW group, onto
        this optimizer's groups; any other group-count mismatch is left to torch's error."""
        saved = sd["param_groups"]
        if len(saved) == len(self.param_groups):
            return sd
        parts: list[tuple[int, list[int]]] = []
        for gi, g in enumerate(self.param_groups):
            if g.get("algorithm", "auto") != "auto":
                parts.append((gi, list(range(len(g["params"])))))
                continue
            root = [i for i, p in enumerate(g["params"]) if p.ndim >= 2]
            rest = [i for i, p in enumerate(g["params"]) if p.ndim < 2]
            parts += [(gi, x) for x in ([x for x in (root, rest) if x] or [[]])]
        if len(parts) != len(saved) or any(
            len(x) != len(s["params"]) for (_, x), s in zip(parts, saved)
        ):
            raise ValueError(
                f"loaded state dict has {len(saved)} parameter groups and this optimizer "
                f"{len(self.param_groups)}, and it is not the older split layout of these "
                "groups (one ROOT and one AdamW group per user group); build the optimizer "
                "with the groups it was saved from"
            )
        groups: list[dict[str, Any]] = []
        for gi, g in enumerate(self.param_groups):
            mine = [(x, s) for (i, x), s in zip(parts, saved) if i == gi]
            ids: list[Any] = [None] * len(g["params"])
            names: list[Any] = [None] * len(g["params"])
            for x, s in mine:
                for k, pos in enumerate(x):
                    ids[pos] = s["params"][k]
                    if "param_names" in s:
                        names[pos] = s["param_names"][k]
            merged = dict(mine[0][1], params=ids, algorithm=g.get("algorithm", "auto"))
            if "param_names" in merged:
                merged["param_names"] = names
            groups.append(merged)
        return {**sd, "param_groups": groups}

    # ----------------------------------------------------------------------------------
    # step
    # ----------------------------------------------------------------------------------
    def _name(self, gi: int, group: dict[str, Any], pi: int) -> str:
        names = group.get("param_names")
        if names is not None:
            return str(names[pi])
        return f"group{gi}.param{pi}"

    def _schedule(self, group: dict[str, Any], rows: int, cols: int) -> Schedule:
        """The schedule the step passes to ``orthogonal_direction`` for a ``rows x cols``
        view: resolved when the group was added. A key missing here (options changed
        after construction) is resolved by the same pure lookup, which never fits or
        writes; with ``ns_fit`` it does not fit either (the table/generalised path)."""
        key = self._coeff_key(group, rows, cols)
        res = self._resolutions.get(key)
        if res is None:
            res = resolve_record(
                group["ns_coefficients"], rows, cols, group["ns_steps"], dtype=group["ns_dtype"]
            )
            self._resolutions[key] = res
        return res.schedule

    def _selector(self, group: dict[str, Any], rows: int, cols: int) -> GramSelector | None:
        """The per-matrix coefficient selector for a ``rows x cols`` view, or None.

        For ``ns_coefficients="adanewton"`` (not fitted) this is a
        :class:`~rootopt.coeffs.GramSelector`: pass it as ``select=`` to the Newton–Schulz
        call, which computes ``s = ||A₀||_F²`` (``A₀ = X₀X₀ᵀ`` of the Frobenius-normalised
        ``X₀``, shape ``(batch,)``, float32 accumulation) and uses ``select(s)``
        (``(K, batch, 3)``) instead of :meth:`_schedule`'s tuples."""
        self._schedule(group, rows, cols)
        res = self._resolutions.get(self._coeff_key(group, rows, cols))
        return None if res is None else res.selector

    def _collect(self) -> list[list[tuple[int, Tensor, str]]]:
        """Per group: (index, param, name) of the parameters that will be updated.

        Checks gradient kinds and finiteness with one host synchronisation."""
        entries: list[tuple[int, int, Tensor, str]] = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None or p.numel() == 0:
                    continue
                name = self._name(gi, group, pi)
                if g.is_sparse:
                    raise RuntimeError(f"ROOT does not support sparse gradients ({name})")
                if g.is_complex():
                    raise RuntimeError(f"ROOT does not support complex gradients ({name})")
                entries.append((gi, pi, p, name))
        self.skipped = []
        finite: list[bool] = [True] * len(entries)
        if entries:
            dev = entries[0][2].grad.device  # type: ignore[union-attr]
            # min and max of each gradient in one pass (NaN propagates, Inf shows): cheaper
            # than isfinite().all(), which materialises masks.
            flags = torch.stack([_finite(cast(Tensor, e[2].grad)).to(dev) for e in entries])
            if _compiling() and self.nonfinite == "error":
                # Compile-friendly form: no host sync, no graph break. The assertion sits
                # before every update in the graph, so a failing step changes nothing.
                torch._assert_async(
                    flags.all(),
                    "non-finite gradient (NaN/Inf) in a parameter; nothing was updated",
                )
            else:
                finite = [bool(f) for f in flags.tolist()]  # the one host sync of the step
        bad = [e[3] for e, ok in zip(entries, finite) if not ok]
        if bad and self.nonfinite == "error":
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN/Inf) in parameter {bad[0]}{more}; nothing was updated"
            )
        self.skipped = bad
        per_group: list[list[tuple[int, Tensor, str]]] = [[] for _ in self.param_groups]
        for (gi, pi, p, name), ok in zip(entries, finite):
            if ok:
                per_group[gi].append((pi, p, name))
        return per_group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (``closure`` re-evaluates the loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        per_group = self._collect()
        if self.telemetry_enabled:
            self.telemetry = {}
        for group, entries in zip(self.param_groups, per_group):
            if not entries:
                continue
            root = [e for e in entries if algorithm_of(group, e[1]) == "root"]
            adamw = [e for e in entries if algorithm_of(group, e[1]) == "adamw"]
            if adamw:
                self._adamw(group, adamw)
            split = [e for e in root if _split_of(group, e[0]) is not None]
            if split:
                self._root_split(group, split)
                root = [e for e in root if _split_of(group, e[0]) is None]
            if root and group["batched"]:
                self._root_batched(group, root)
            elif root:
                self._root_reference(group, root)
        return loss

    # ----------------------------------------------------------------------------------
    # AdamW part
    # ----------------------------------------------------------------------------------
    def _adamw(self, group: dict[str, Any], entries: list[tuple[int, Tensor, str]]) -> None:
        hyper = dict(
            lr=_lr(group),
            betas=group["adamw_betas"],
            eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )
        # float32 dense tensors at the same step count go through one _foreach call;
        # everything else (low-precision params, the reference path) one at a time.
        if _compiling():
            self._adamw_compiled(group, entries)
            return
        by_step: dict[tuple[int, torch.device], list[Tensor]] = {}
        for _, p, _name in entries:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
            _next_step(state)
            grad = cast(Tensor, p.grad)
            if group["batched"] and p.dtype == torch.float32 and grad.dtype == torch.float32:
                by_step.setdefault((state["step"], p.device), []).append(p)
            else:
                adamw_update_(
                    p, grad, state["exp_avg"], state["exp_avg_sq"], step=state["step"], **hyper
                )
        for (step, _), ps in by_step.items():
            adamw_update_foreach_(
                ps,
                [cast(Tensor, p.grad) for p in ps],
                [self.state[p]["exp_avg"] for p in ps],
                [self.state[p]["exp_avg_sq"] for p in ps],
                step=step,
                **hyper,
            )

    def _adamw_compiled(
        self, group: dict[str, Any], entries: list[tuple[int, Tensor, str]]
    ) -> None:
        """The AdamW update traced by ``torch.compile``: the step count is a 0-d tensor
        and the bias corrections are tensor expressions (no Python number in a guard),
        one parameter at a time (the compiler fuses the loop). Same formula as
        :func:`rootopt.optim.functional.adamw_update_`."""
        beta1, beta2 = group["adamw_betas"]
        lr, wd, eps = _lr(group), group["weight_decay"], group["adamw_eps"]
        for _, p, _name in entries:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
            step = cast(Tensor, _next_step(state))
            g = cast(Tensor, p.grad).to(state["exp_avg"].dtype)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            p32 = p if p.dtype in (torch.float32, torch.float64) else p.float()
            p32.mul_(1 - lr * wd)
            exp_avg.lerp_(g, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bc1 = 1 - torch.pow(beta1, step)
            bc2 = 1 - torch.pow(beta2, step)
            denom = (exp_avg_sq.sqrt() / bc2.sqrt()).add_(eps)
            p32.sub_(exp_avg / denom * (lr / bc1))
            if p32 is not p:
                p.copy_(p32)

    # ----------------------------------------------------------------------------------
    # ROOT part
    # ----------------------------------------------------------------------------------
    def _momentum(self, group: dict[str, Any], p: Tensor, out: Tensor | None = None) -> Tensor:
        """Create state if needed, update the momentum (and robust statistics) of ``p``;
        return the vector to orthogonalize (written into ``out`` when given)."""
        state = self._init_root_state(group, p)
        _next_step(state)
        buf = state["momentum_buffer"]
        g = cast(Tensor, p.grad).to(buf.dtype)
        mu = group["momentum"]
        buf.mul_(mu).add_(g)
        if group["robust_scaling"]:
            beta = 1.0 - 1.0 / group["robust_window"]
            state["robust_mean"].lerp_(g, 1 - beta)
            state["robust_sq"].mul_(beta).addcmul_(g, g, value=1 - beta)
        if out is None:
            return g.add(buf, alpha=mu) if group["nesterov"] else buf
        if group["nesterov"] and buf.dtype == out.dtype:
            return torch.add(g, buf, alpha=mu, out=out.view(p.shape))
        return out.view(p.shape).copy_(g.add(buf, alpha=mu) if group["nesterov"] else buf)

    def _init_root_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32) if _compiling() else 0
            state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p))
            if group["robust_scaling"]:
                state["robust_mean"] = torch.zeros_like(p, dtype=state_dtype(p))
                state["robust_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
        return state

    def _apply(self, group: dict[str, Any], p: Tensor, view: MatrixView, U: Tensor) -> Tensor:
        """Robust scaling (optional), decoupled decay, scaled step. Returns the applied
        orthogonal step (``lr * s * U``) shaped like ``p``."""
        state = self.state[p]
        if group["robust_scaling"]:
            beta = 1.0 - 1.0 / group["robust_window"]
            U = robust_scale(
                U,
                state["robust_mean"].reshape(U.shape),
                state["robust_sq"].reshape(U.shape),
                bias_correction=1.0 - beta ** state["step"],
                lam=group["robust_lambda"],
            )
        lr = _lr(group)
        step = U.reshape(p.shape).mul(lr * group_scale_factor(group, view.rows, view.cols))
        p32 = p if p.dtype in (torch.float32, torch.float64) else p.float()
        p32.mul_(1 - lr * group["weight_decay"])
        p32.sub_(step)
        if p32 is not p:
            p.copy_(p32)
        return step

    def _record(
        self,
        name: str,
        M: Tensor,
        B: Tensor,
        eps: Tensor | None,
        U: Tensor,
        step: Tensor,
        p: Tensor,
    ) -> None:
        if self.telemetry_enabled:
            self.telemetry[name] = matrix_telemetry(
                M, B, eps, U, step, p, spectra=self.record_spectra
            )

    @staticmethod
    def _gram(group: dict[str, Any]) -> bool | None:
        mode = group.get("ns_gram", "auto")
        return None if mode == "auto" else mode == "on"

    def _root_reference(
        self, group: dict[str, Any], entries: list[tuple[int, Tensor, str]]
    ) -> None:
        """One parameter, one matrix at a time: :func:`root_update_`, the ground truth."""
        dtype = _DTYPES[group["ns_dtype"]]
        for _, p, name in entries:
            state = self._init_root_state(group, p)
            _next_step(state)
            view = matrix_view(p.shape, group["nd_view"])
            robust = group["robust_scaling"]
            trace = root_update_(
                p,
                cast(Tensor, p.grad),
                state["momentum_buffer"],
                step=state["step"],
                lr=_lr(group),
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                coefficients=self._schedule(group, view.rows, view.cols),
                select=self._selector(group, view.rows, view.cols),
                outlier_quantile=group["outlier_quantile"],
                ortho_method=group["ortho_method"],
                ns_dtype=dtype,
                gram=self._gram(group),
                lr_scale=group["lr_scale"],
                transposed=bool(group.get("transposed", False)),
                nd_view=group["nd_view"],
                robust_mean=state["robust_mean"] if robust else None,
                robust_sq=state["robust_sq"] if robust else None,
                robust_window=group["robust_window"],
                robust_lambda=group["robust_lambda"],
            )
            if self.telemetry_enabled:
                self._record(name, trace.M, trace.B, trace.eps, trace.U, trace.step, p)

    def _root_split(self, group: dict[str, Any], entries: list[tuple[int, Tensor, str]]) -> None:
        """Fused projections with ``ns_split``: the momentum is kept for the whole weight,
        then each block (Q, K, V, or gate/up) is thresholded, orthogonalized and scaled
        as the matrix it would be unfused, so one block's spectrum does not set another's
        step (docs/integrations.md, "Fused projections")."""
        q = group["outlier_quantile"]
        dtype = _DTYPES[group["ns_dtype"]]
        lr = _lr(group)
        transposed = bool(group.get("transposed", False))
        for pi, p, _name in entries:
            v = self._momentum(group, p).reshape(p.shape)
            sizes = cast(tuple[int, ...], _split_of(group, pi))
            parts = []
            for block in torch.split(v, list(sizes), dim=1 if transposed else 0):
                M = (block.t() if transposed else block).float()  # (out_i, in)
                rows, cols = M.shape
                B, _ = clip_outliers(M, q)
                U = orthogonal_direction(
                    B,
                    self._schedule(group, rows, cols),
                    method=group["ortho_method"],
                    dtype=dtype,
                    gram=self._gram(group),
                    select=self._selector(group, rows, cols),
                )
                U = U * lr_scale_factor(rows, cols, group["lr_scale"])
                parts.append(U.t() if transposed else U)
            step = torch.cat(parts, dim=1 if transposed else 0).mul_(lr)
            p32 = p if p.dtype in (torch.float32, torch.float64) else p.float()
            p32.mul_(1 - lr * group["weight_decay"])
            p32.sub_(step)
            if p32 is not p:
                p.copy_(p32)

    def _root_batched(self, group: dict[str, Any], entries: list[tuple[int, Tensor, str]]) -> None:
        """Stack the matrices of one shape (across parameters and stacks) and clip +
        orthogonalize them with one selection and one batched iteration per bucket.

        Buckets hold at most ``bucket_bytes`` of float32 matrices (a larger parameter
        goes alone and is processed in chunks of that size), and a bucket's momentum is
        computed only when the bucket is processed, so temporaries stay bounded by the
        budget instead of growing with the model (docs/performance.md, "Memory")."""
        q = group["outlier_quantile"]
        dtype = _DTYPES[group["ns_dtype"]]
        budget = int(group.get("bucket_bytes", DEFAULT_BUCKET_BYTES))
        gram = self._gram(group)
        method = group["ortho_method"]
        lr = _lr(group)
        by_shape: dict[tuple[int, int, torch.device], list[tuple[Tensor, str, MatrixView]]] = {}
        for _, p, name in entries:
            view = matrix_view(p.shape, group["nd_view"])
            by_shape.setdefault((view.rows, view.cols, p.device), []).append((p, name, view))
        for (rows, cols, device), items in by_shape.items():
            sched = self._schedule(group, rows, cols)
            select = self._selector(group, rows, cols)
            matrix_bytes = rows * cols * 4
            per_chunk = max(1, budget // matrix_bytes) if budget > 0 else 1 << 62
            scale = lr * group_scale_factor(group, rows, cols)
            for bucket in _buckets(items, per_chunk):
                n = sum(view.batch for _, _, view in bucket)
                M_all = torch.empty((n, rows, cols), dtype=torch.float32, device=device)
                start = 0
                for p, _, view in bucket:
                    self._momentum(group, p, out=M_all[start : start + view.batch])
                    start += view.batch
                # Clip in place unless telemetry needs M; one chunk per budget.
                U_all = torch.empty_like(M_all) if n > per_chunk else None
                B_all, eps_all, U_parts = M_all, [], []
                if self.telemetry_enabled:
                    B_all = torch.empty_like(M_all)
                for c0 in range(0, n, per_chunk):
                    sl = slice(c0, min(n, c0 + per_chunk))
                    B, eps = clip_outliers_(M_all[sl], q, out=B_all[sl])
                    U = orthogonal_direction(
                        B, sched, method=method, dtype=dtype, gram=gram, select=select
                    )
                    if eps is not None:
                        eps_all.append(eps)
                    if U_all is not None:
                        U_all[sl] = U
                    else:
                        U_parts.append(U)
                U_done = U_all if U_all is not None else U_parts[0]
                self._apply_bucket(group, bucket, U_done, scale, lr)
                if self.telemetry_enabled:
                    eps_cat = torch.cat(eps_all) if eps_all else None
                    start = 0
                    for p, name, view in bucket:
                        sl = slice(start, start + view.batch)
                        start += view.batch
                        step = U_done[sl].reshape(p.shape) * scale
                        e = None if eps_cat is None else eps_cat[sl]
                        self._record(name, M_all[sl], B_all[sl], e, U_done[sl], step, p)

    def _apply_bucket(
        self,
        group: dict[str, Any],
        bucket: list[tuple[Tensor, str, MatrixView]],
        U_all: Tensor,
        scale: float,
        lr: float,
    ) -> None:
        """Decay and scaled step for every parameter of a bucket (``_foreach`` for dense
        float32 parameters without robust scaling; :meth:`_apply` otherwise)."""
        fast_p, fast_u = [], []
        start = 0
        for p, _, view in bucket:
            U = U_all[start : start + view.batch]
            start += view.batch
            if group["robust_scaling"] or p.dtype != torch.float32:
                self._apply(group, p, view, U)
            else:
                fast_p.append(p)
                fast_u.append(U.reshape(p.shape))
        if fast_p:
            torch._foreach_mul_(fast_p, 1 - lr * group["weight_decay"])
            if isinstance(scale, Tensor):  # a tensor lr in a compiled step
                torch._foreach_sub_(fast_p, torch._foreach_mul(fast_u, scale))
            else:
                torch._foreach_add_(fast_p, fast_u, alpha=-scale)


def _compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _next_step(state: dict[str, Any]) -> int | Tensor:
    """Count one step in ``state["step"]`` and return it. Eager steps keep a Python int
    (a tensor left by a compiled step is read back); a step traced by ``torch.compile``
    keeps a 0-d float32 tensor, as torch.optim does, so that the count is data, not a
    guard that would recompile the step every time (docs/integrations.md, compile)."""
    s: int | Tensor = state["step"]
    if _compiling():
        if not isinstance(s, Tensor):
            s = torch.tensor(float(s), dtype=torch.float32)
        s.add_(1)
    else:
        s = int(s) + 1
    state["step"] = s
    return s


def group_scale_factor(group: dict[str, Any], rows: int, cols: int) -> float:
    """``lr_scale_factor`` of a ``rows x cols`` view; a ``"transposed"`` group's weights
    are stored ``(in, out)``, so its fan-out is the view's second dimension."""
    if group.get("transposed", False):
        rows, cols = cols, rows
    return lr_scale_factor(rows, cols, group["lr_scale"])


def _split_of(group: dict[str, Any], pi: int) -> tuple[int, ...] | None:
    splits = group.get("ns_split")
    if not splits:
        return None
    sizes = splits[pi]
    return None if sizes is None else tuple(int(x) for x in sizes)


def _block_shapes(group: dict[str, Any], pi: int, p: Tensor) -> list[tuple[int, int]]:
    """``(rows, cols)`` of each block of a split fused weight (rows = the block's
    fan-out), or ``[]`` when the parameter is not split."""
    sizes = _split_of(group, pi)
    if sizes is None:
        return []
    fan_in = int(p.shape[0] if group.get("transposed", False) else p.shape[1])
    return [(n, fan_in) for n in sizes]


def _check_split(group: dict[str, Any], params: list[Tensor], merged: dict[str, Any]) -> None:
    """Validate ``ns_split``: one entry per parameter, ``None`` or output block sizes of a
    2-D weight that add up to its fan-out (dim 0, dim 1 for a transposed group)."""
    splits = group.get("ns_split")
    if splits is None:
        return
    if not isinstance(splits, (list, tuple)) or len(splits) != len(params):
        raise ValueError(
            f"Invalid ns_split: needs one entry (None or block sizes) per parameter, "
            f"got {splits!r} for {len(params)} parameters"
        )
    for sizes, p in zip(splits, params):
        if sizes is None:
            continue
        dim = 1 if group.get("transposed", False) else 0
        if (
            p.ndim != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
            or sum(sizes) != p.shape[dim]
        ):
            raise ValueError(
                f"Invalid ns_split: {sizes!r} for a parameter of shape {tuple(p.shape)} "
                f"(positive block sizes of a 2-D weight adding up to dim {dim})"
            )
        if merged["robust_scaling"]:
            raise ValueError("Invalid ns_split: not supported together with robust_scaling")


def fused_splits(groups: list[dict[str, Any]], report: Any) -> list[dict[str, Any]]:
    """Copies of ``groups`` (from :func:`rootopt.param_groups`) in which every fused
    projection the routing ``report`` found with known block sizes (``Route.split``:
    GPT-2 ``c_attn``, ``qkv_proj``, ``gate_up_proj``, ...) gets ``ns_split``, so that
    ROOT orthogonalizes its Q/K/V (or gate/up) blocks separately."""
    by_name = report.by_name()
    out = []
    for g in groups:
        g = dict(g)
        names = g.get("param_names")
        if names is not None and g.get("algorithm") == "root":
            splits = [tuple(by_name[n].split) if by_name[n].split else None for n in names]
            if any(x is not None for x in splits):
                g["ns_split"] = splits
        out.append(g)
    return out


def _is_lora_name(name: object) -> bool:
    return isinstance(name, str) and any(
        part.startswith(("lora_", "lora_embedding_")) for part in name.split(".")
    )


def _warn_lora(items: list[Any], names: Any) -> None:
    """Warn (once per call site, Python's default filter) when a group routed by shape
    holds LoRA factors, which ROOT would orthogonalize. Only names can tell: a bare
    tensor from ``model.parameters()`` carries nothing that marks it as a LoRA factor,
    so this sees ``named_parameters()`` input (or ``param_names``), not bare tensors."""
    found = [
        item[0]
        for item in items
        if isinstance(item, tuple) and _is_lora_name(item[0]) and item[1].ndim >= 2
    ]
    if names is not None:
        found += [n for n, item in zip(names, items) if _is_lora_name(n) and item.ndim >= 2]
    if found:
        warnings.warn(
            f"ROOT got LoRA factors in a group routed by shape ({found[0]}"
            f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}): they would be "
            "orthogonalized. Build the groups with rootopt.param_groups(model), which puts "
            "LoRA A/B on AdamW (docs/integrations.md).",
            UserWarning,
            stacklevel=5,  # the caller of ROOT(...)
        )


def _finite(g: Tensor) -> Tensor:
    """True when every entry of ``g`` is finite, as a 0-d bool tensor (no host sync)."""
    if g.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=g.device)
    lo, hi = torch.aminmax(g)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _buckets(
    items: list[tuple[Tensor, str, MatrixView]], per_bucket: int
) -> list[list[tuple[Tensor, str, MatrixView]]]:
    """Consecutive runs of ``items`` holding at most ``per_bucket`` matrices (a parameter
    with more matrices than that forms a bucket of its own)."""
    out: list[list[tuple[Tensor, str, MatrixView]]] = []
    cur: list[tuple[Tensor, str, MatrixView]] = []
    count = 0
    for item in items:
        b = item[2].batch
        if cur and count + b > per_bucket:
            out.append(cur)
            cur, count = [], 0
        cur.append(item)
        count += b
    if cur:
        out.append(cur)
    return out
