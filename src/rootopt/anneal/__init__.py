"""Quantized block updates solved as a QUBO with D-Wave's Ocean SDK (optional extra ``[anneal]``).

For a small parameter block (tens to a few hundred entries) a step picks
``δ ∈ {−s, 0, +s}ⁿ`` minimising the local quadratic model ``gᵀδ + ½ δᵀHδ`` with ``H`` a
low-rank + diagonal curvature estimate from per-sample gradients, encoded as a binary
quadratic model (:mod:`rootopt.anneal.qubo`) and handed to any ``dimod`` sampler. The default
sampler is **classical simulated annealing** (``dwave-samplers``), run on this machine; a
quantum annealer or hybrid solver is used only when the user passes one. See ``docs/outlook.md``.

Nothing here is imported by ``import rootopt``.
"""
