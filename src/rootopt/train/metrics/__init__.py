"""What a run measures about itself (docs/monitoring.md): the metric records and their
logging window (:mod:`~rootopt.train.metrics.records`), the divergence counters
(:mod:`~rootopt.train.metrics.health`) and model FLOPs utilisation
(:mod:`~rootopt.train.metrics.mfu`).

Imports only :mod:`rootopt.train.models` of the training system.
"""
