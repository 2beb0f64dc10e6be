"""Newton–Schulz coefficients: published presets, stability checks, shape providers.

Leaf layer: imports nothing else from rootopt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rootopt.coeffs.adanewton import CoefficientError, Resolution
from rootopt.coeffs.presets import (
    CANS,
    CUBIC,
    MUON,
    NAMED_SETS,
    PAPER_TABLE,
    POLAR_EXPRESS,
    QUINTIC,
    YOU,
    Coeff,
    CoefficientSet,
    Schedule,
    official_schedule,
)
from rootopt.coeffs.stability import StabilityReport, apply_schedule, certify, check_stability

# A provider maps (rows, cols, steps) to one tuple per iteration.
CoefficientProvider = Callable[[int, int, int], Schedule]
CoefficientSpec = str | Coeff | Sequence[Coeff] | CoefficientProvider

_PROVIDERS: dict[str, CoefficientProvider] = {}
# Names whose schedules are handed out as published even when they fail the certificate
# (the official mode reproduces the paper's code, unstable 2048² entry included).
FAITHFUL: frozenset[str] = frozenset({"official"})


def register_provider(name: str, provider: CoefficientProvider) -> None:
    """Make ``name`` usable as ``ns_coefficients=name`` (overrides an existing name)."""
    _PROVIDERS[name] = provider


def _adanewton(rows: int, cols: int, steps: int) -> Schedule:
    from rootopt.coeffs.adanewton import adanewton_schedule

    return adanewton_schedule(rows, cols, steps)


# Other names of the same coefficients. "adanewton-static" was AdaNewton without its
# per-matrix selector; since the selector was removed (docs/adanewton.md) it is exactly
# "adanewton", kept so that recorded study arms and saved configs still resolve.
ALIASES: dict[str, str] = {"adanewton-static": "adanewton"}


def canonical(spec: object) -> object:
    """``spec`` with an alias name replaced by the name it stands for."""
    return ALIASES.get(spec, spec) if isinstance(spec, str) else spec


register_provider("official", official_schedule)
register_provider("adanewton", _adanewton)
for _alias, _name in ALIASES.items():
    register_provider(_alias, _PROVIDERS[_name])


def _shape_free(cset: CoefficientSet) -> CoefficientProvider:
    """A provider that ignores the shape: the same schedule for every matrix."""

    def provider(rows: int, cols: int, steps: int) -> Schedule:
        return cset.schedule(steps)

    return provider


for _set in NAMED_SETS.values():
    register_provider(_set.name, _shape_free(_set))


def available() -> list[str]:
    """Names accepted by :func:`resolve`."""
    return sorted(_PROVIDERS)


def _as_coeff(t: object) -> Coeff:
    if not isinstance(t, Sequence) or isinstance(t, str) or len(t) != 3:
        raise ValueError(f"ns_coefficients: each tuple must be (a, b, c), got {t!r}")
    try:
        a, b, c = (float(v) for v in t)
    except (TypeError, ValueError):
        raise ValueError(
            f"ns_coefficients: each tuple must be (a, b, c) numbers, got {t!r}"
        ) from None
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError(f"ns_coefficients: coefficients must be finite, got {t!r}")
    return (a, b, c)


def validate_spec(spec: object) -> None:
    """Raise ValueError if ``spec`` cannot name coefficients (cheap, shape-free check)."""
    if isinstance(spec, str):
        if spec not in _PROVIDERS:
            raise ValueError(f"ns_coefficients={spec!r} is unknown; choose one of {available()}")
    elif callable(spec):
        return
    elif isinstance(spec, Sequence) and len(spec) > 0:
        if all(isinstance(v, (int, float)) for v in spec):
            _as_coeff(spec)
        else:
            for t in spec:
                _as_coeff(t)
    else:
        raise ValueError(f"ns_coefficients={spec!r} is not a name, an (a, b, c) tuple or a list")


def _describe(spec: object) -> str:
    if isinstance(spec, str):
        return repr(spec)
    if callable(spec):
        return getattr(spec, "__name__", "<callable>")
    return repr(spec)


def resolve_record(
    spec: CoefficientSpec, rows: int, cols: int, steps: int, *, dtype: str = "float32"
) -> Resolution:
    """Resolve ``spec`` for a ``rows x cols`` matrix, ``steps`` iterations in ``dtype``.

    Returns a :class:`~rootopt.coeffs.adanewton.Resolution` (schedule, source, certificate
    peak). Every schedule except the faithful
    ``"official"`` mode must pass :func:`~rootopt.coeffs.stability.certify` for ``dtype``;
    otherwise :class:`~rootopt.coeffs.adanewton.CoefficientError` names the shape and the
    reason. Never fits and never writes a file.
    """
    from rootopt.coeffs.adanewton import CoefficientError, certify_user_schedule, lookup

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise CoefficientError(
            f"ns_steps={steps!r} for a {rows}x{cols} matrix: must be an integer >= 1"
        )
    m, n = min(rows, cols), max(rows, cols)
    key = (m, n, steps, dtype)
    if canonical(spec) == "adanewton":
        return lookup(rows, cols, steps, dtype=dtype)
    sched = resolve(spec, rows, cols, steps)
    what = _describe(spec)
    if isinstance(spec, str) and spec in FAITHFUL:
        from rootopt.coeffs.stability import certify

        rep = certify(sched, dtype=dtype)
        detail = "published" if rep.stable else f"published, NOT certified: {rep.reason}"
        res = Resolution(key, sched, spec, detail, rep.peak)
        if not rep.stable:
            from rootopt.coeffs.adanewton import log_once

            log_once(res)
        return res
    try:
        rep = certify_user_schedule(sched, rows, cols, dtype, what)
    except CoefficientError as exc:
        if not isinstance(spec, str):
            raise
        raise CoefficientError(
            f"{exc}{_fewer_steps_hint(spec, rows, cols, steps, dtype)}"
        ) from None
    source = spec if isinstance(spec, str) else "user"
    return Resolution(key, sched, source, "" if isinstance(spec, str) else what, rep.peak)


def _fewer_steps_hint(spec: str, rows: int, cols: int, steps: int, dtype: str) -> str:
    """What to choose instead of a named preset that fails the certificate at ``steps``:
    Polar Express, the default, is a schedule for five or more steps (its first, steepest
    tuples overshoot until the later ones settle them), while Muon's repeated tuple is
    certified for any number of steps."""
    from rootopt.coeffs.stability import certify

    more = next(
        (
            k
            for k in range(steps + 1, 9)
            if certify(resolve(spec, rows, cols, k), dtype=dtype).stable
        ),
        None,
    )
    hint = f"; {spec!r} is certified from ns_steps={more} on" if more else ""
    return hint + "; ns_coefficients='muon' is certified for any ns_steps"


def resolve(spec: CoefficientSpec, rows: int, cols: int, steps: int) -> Schedule:
    """One ``(a, b, c)`` per iteration for a ``rows x cols`` matrix.

    ``spec`` is a registered name, a single ``(a, b, c)`` (repeated), a list of tuples
    (exactly ``steps`` of them) or a provider callable ``(rows, cols, steps) -> schedule``.
    No certificate here (see :func:`resolve_record`).
    """
    if isinstance(spec, str):
        validate_spec(spec)
        sched = _PROVIDERS[spec](rows, cols, steps)
    elif callable(spec):
        sched = tuple(_as_coeff(t) for t in spec(rows, cols, steps))
    elif (
        isinstance(spec, Sequence)
        and len(spec) > 0
        and all(isinstance(v, (int, float)) for v in spec)
    ):
        sched = (_as_coeff(spec),) * steps
    else:
        validate_spec(spec)
        sched = tuple(_as_coeff(t) for t in spec)  # type: ignore[union-attr]
        if len(sched) != steps:
            raise ValueError(
                f"ns_coefficients lists {len(sched)} tuples but ns_steps={steps}; they must match"
            )
    if len(sched) != steps:
        raise ValueError(f"coefficient provider returned {len(sched)} tuples for {steps} steps")
    return tuple(sched)


__all__ = [
    "ALIASES",
    "CANS",
    "CUBIC",
    "MUON",
    "PAPER_TABLE",
    "POLAR_EXPRESS",
    "QUINTIC",
    "YOU",
    "Coeff",
    "CoefficientError",
    "CoefficientProvider",
    "CoefficientSet",
    "CoefficientSpec",
    "Resolution",
    "Schedule",
    "StabilityReport",
    "apply_schedule",
    "available",
    "canonical",
    "certify",
    "check_stability",
    "official_schedule",
    "register_provider",
    "resolve",
    "resolve_record",
    "validate_spec",
]
