"""Benchmarks behind ``rootopt bench``: tasks (one model per task, from ``rootopt.train.model``),
the parallel resumable runner, the suites and the report. Not imported by ``import rootopt``."""
