"""Benchmarks behind ``rootopt bench``: the parallel resumable runner, the suites, the
defaults study and their reports, on the tasks of :mod:`rootopt.tasks` (one model per task,
from ``rootopt.train.models``)."""
