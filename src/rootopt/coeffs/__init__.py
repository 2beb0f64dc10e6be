"""Newton–Schulz coefficients: published presets, stability checks, shape providers.

Leaf layer: imports nothing else from rootopt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
from rootopt.coeffs.stability import StabilityReport, apply_schedule, check_stability

# A provider maps (rows, cols, steps) to one tuple per iteration.
CoefficientProvider = Callable[[int, int, int], Schedule]
CoefficientSpec = str | Coeff | Sequence[Coeff] | CoefficientProvider

_PROVIDERS: dict[str, CoefficientProvider] = {}


def register_provider(name: str, provider: CoefficientProvider) -> None:
    """Make ``name`` usable as ``ns_coefficients=name`` (overrides an existing name)."""
    _PROVIDERS[name] = provider


def _adanewton(rows: int, cols: int, steps: int) -> Schedule:
    # Imported lazily: the AdaNewton lookup may read data files; keep import cheap.
    from rootopt.coeffs.adanewton import adanewton_schedule

    return adanewton_schedule(rows, cols, steps)


register_provider("official", official_schedule)
register_provider("adanewton", _adanewton)


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
    a, b, c = (float(v) for v in t)
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


def resolve(spec: CoefficientSpec, rows: int, cols: int, steps: int) -> Schedule:
    """One ``(a, b, c)`` per iteration for a ``rows x cols`` matrix.

    ``spec`` is a registered name, a single ``(a, b, c)`` (repeated), a list of tuples
    (exactly ``steps`` of them) or a provider callable ``(rows, cols, steps) -> schedule``.
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
    "CANS",
    "CUBIC",
    "MUON",
    "PAPER_TABLE",
    "POLAR_EXPRESS",
    "QUINTIC",
    "YOU",
    "Coeff",
    "CoefficientProvider",
    "CoefficientSet",
    "CoefficientSpec",
    "Schedule",
    "StabilityReport",
    "apply_schedule",
    "available",
    "check_stability",
    "official_schedule",
    "register_provider",
    "resolve",
    "validate_spec",
]
