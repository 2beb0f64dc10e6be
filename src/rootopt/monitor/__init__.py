"""Monitoring: metric sinks (JSONL, TensorBoard, Prometheus), run reports and diagnostics."""

from __future__ import annotations

from rootopt.monitor.metrics import (
    PROMETHEUS_METRICS,
    Monitor,
    memory_bytes,
    plot_loss,
    read_jsonl,
    read_jsonl_checked,
    strict,
)

__all__ = [
    "PROMETHEUS_METRICS",
    "Monitor",
    "memory_bytes",
    "plot_loss",
    "read_jsonl",
    "read_jsonl_checked",
    "strict",
]
