"""Published Newton–Schulz coefficient sets, as data with provenance.

Every set is a sequence of quintic tuples ``(a, b, c)`` applied as
``X <- a X + (b A + c A A) X`` with ``A = X Xᵀ``; the scalar map on a singular value
``x`` is ``p(x) = a x + b x³ + c x⁵``. A set with ``repeat_last=True`` extends to any
number of steps by repeating its last tuple (a single-tuple set is the paper's form).
"""

from __future__ import annotations

from dataclasses import dataclass

Coeff = tuple[float, float, float]
Schedule = tuple[Coeff, ...]


@dataclass(frozen=True)
class CoefficientSet:
    """A named coefficient sequence and where it comes from."""

    name: str
    tuples: Schedule
    source: str
    repeat_last: bool = True

    def schedule(self, steps: int) -> Schedule:
        """The per-iteration tuples for ``steps`` iterations."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if steps <= len(self.tuples):
            return self.tuples[:steps]
        if not self.repeat_last:
            raise ValueError(
                f"coefficient set {self.name!r} defines {len(self.tuples)} steps, asked for {steps}"
            )
        return self.tuples + (self.tuples[-1],) * (steps - len(self.tuples))


MUON = CoefficientSet(
    "muon",
    ((3.4445, -4.7750, 2.0315),),
    "Keller Jordan, Muon (2024): tuple chosen for a steep slope at 0; does not converge to UVᵀ",
)

CUBIC = CoefficientSet(
    "cubic", ((1.5, -0.5, 0.0),), "classic cubic Newton–Schulz (Kovarik 1970; Björck & Bowie 1971)"
)

QUINTIC = CoefficientSet(
    "quintic", ((15 / 8, -10 / 8, 3 / 8),), "classic quintic Newton–Schulz (Padé-type, order 3)"
)

YOU = CoefficientSet(
    "you",
    (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "Jiacheng You, 5-step per-iteration schedule (2024)",
)

# Polar Express (Amsel, Persson, Musco, Gower; arXiv 2505.16932), l = 1e-3, with the
# paper's /1.01 safety factor folded in; any further step repeats the final tuple.
POLAR_EXPRESS = CoefficientSet(
    "polar_express",
    (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "Polar Express, arXiv 2505.16932 (greedy minimax per step on [1e-3, 1], /1.01 safety)",
)

CANS = CoefficientSet(
    "cans",
    (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "CANS, arXiv 2506.10935 (Chebyshev-optimised 5-step schedule)",
)

# The ROOT paper's shape table (arXiv 2511.20626, official example code), keyed by
# (min dim, max dim). Any other shape falls back to Muon's tuple in the official code.
# NOTE: the 2048x2048 entry is unstable (local max 1.2246 at x≈0.559 above its upper
# fixed point 1.2236); it is kept here only so that ``"official"`` mode is faithful.
PAPER_TABLE: dict[tuple[int, int], Coeff] = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}

NAMED_SETS: dict[str, CoefficientSet] = {
    s.name: s for s in (MUON, CUBIC, QUINTIC, YOU, POLAR_EXPRESS, CANS)
}


def official_schedule(rows: int, cols: int, steps: int) -> Schedule:
    """The official code's choice: the paper table by (min, max) dim, else Muon's tuple."""
    key = (min(rows, cols), max(rows, cols))
    coeff = PAPER_TABLE.get(key, MUON.tuples[0])
    return (coeff,) * steps
