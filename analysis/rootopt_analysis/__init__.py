"""rootopt-analysis: the development and analysis side of rootopt, apart from its runtime.

What ``import rootopt`` and ``rootopt train`` need ships in the ``rootopt`` wheel; what only
measures, studies or fits lives here, in a package of its own that the rootopt wheel does
not carry (install it from a source checkout: ``pip install ./analysis``;
``scripts/dev.sh`` installs it for development):

* :mod:`rootopt_analysis.bench` — ``rootopt bench``: the optimizer benchmarks and the
  defaults study (docs/benchmarks.md), on the tasks of :mod:`rootopt.tasks`;
* :mod:`rootopt_analysis.coeffs` — ``rootopt coeffs fit|bench|families|build-table|record|
  heldout``: the AdaNewton fitter, its spectrum families and recorded spectra, the table
  builder, the user fit cache behind ``ROOT(..., ns_fit=True)`` (docs/adanewton.md);
* :mod:`rootopt_analysis.costmodel` — ``rootopt plan``: the distributed cost model, and
  :mod:`rootopt_analysis.counters`, the byte counters that check it (docs/distributed.md);
* :mod:`rootopt_analysis.opcount` — operations dispatched per optimizer step
  (docs/performance.md).

It imports ``rootopt``; ``rootopt`` imports it only where a user asks for it: the three
commands above (which say how to install it when it is missing) and ``ns_fit=True``.
"""
