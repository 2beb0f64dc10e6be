"""Which matrices a group's parameters hold, and their coefficients: resolved (and certified)
when a group is added, looked up in ``step()`` (never fitted or read from a file there)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rootopt.coeffs import CoefficientError
from rootopt.coeffs.cache import CoefficientCache, Fitter
from rootopt.optim._options import check_iteration_speed, group_ns_dtype
from rootopt.optim.functional import CoefficientsFor, Matrix, RootOptions, matrices, matrix_view


def group_matrices(group: dict[str, Any], pi: int, p: Tensor) -> list[Matrix]:
    """The matrices of parameter ``pi`` of a ROOT group: its view, or its fused blocks."""
    splits = group.get("ns_split")
    o = RootOptions(lr=0.0, lr_scale=group["lr_scale"], transposed=bool(group.get("transposed")))
    return matrices(matrix_view(p.shape, group["nd_view"]), o, splits[pi] if splits else None)


def coefficients_for(
    cache: CoefficientCache, group: dict[str, Any], device: torch.device
) -> CoefficientsFor:
    """``(rows, cols) -> schedule`` for a group's parameters on ``device``."""
    spec, steps, fit = group["ns_coefficients"], group["ns_steps"], group.get("ns_fit", False)
    dtype = group_ns_dtype(group, device)
    return lambda r, c: cache.schedule(spec, r, c, steps, dtype, fitted=fit)


def resolve_group(cache: CoefficientCache, group: dict[str, Any], is_root: Any) -> None:
    """Resolve the coefficients of every matrix of the group's ROOT parameters
    (``is_root(p)``), naming the parameter when one fails; nothing is fitted or written
    unless ``ns_fit=True``."""
    if group["ortho_method"] != "newton_schulz":
        return
    fitter: Fitter | None = None
    if group.get("ns_fit", False):
        # Opt-in fitting: the one place the runtime reaches the offline tools (the separate
        # rootopt-analysis package), and only while the optimizer is being built.
        try:
            from rootopt_analysis.coeffs.fitcache import fitted_resolution
        except ModuleNotFoundError as exc:
            if exc.name != "rootopt_analysis":
                raise
            raise CoefficientError(
                "ns_fit=True fits coefficients with the rootopt-analysis package, which the "
                "rootopt wheel does not carry; install it from a rootopt source checkout with: "
                "pip install ./analysis (or leave ns_fit off: the shipped table and its "
                "certified generalisation)"
            ) from None

        def fitter(r: int, c: int, k: int, dt: str) -> Any:
            return fitted_resolution(r, c, k, dtype=dt)

    for pi, p in enumerate(group["params"]):
        if p.numel() == 0 or not is_root(p):
            continue
        dtype = group_ns_dtype(group, p.device)
        check_iteration_speed(dtype, p.device)
        try:
            for m in group_matrices(group, pi, p):
                cache.get(
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
