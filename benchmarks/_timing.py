"""Helpers shared by the device benchmarks: the median of repeated runs after a warm-up,
with CUDA events on a GPU (so that asynchronous launches are counted) and the wall clock
elsewhere; an argparse type for lists of shapes."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def median_ms(fn: Callable[[], T], device: torch.device, reps: int) -> tuple[float, T]:
    """``(median milliseconds over reps, the warm-up's result)``."""
    out = fn()
    times: list[float] = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def shape_list(dims: int) -> Callable[[str], list[tuple[int, ...]]]:
    """argparse type: ``"AxB,CxD"`` → ``[(A, B), (C, D)]`` with ``dims`` positive sizes each;
    anything else is one usage error naming the bad item."""

    def parse(text: str) -> list[tuple[int, ...]]:
        out = []
        for item in text.split(","):
            parts = item.strip().split("x")
            try:
                shape = tuple(int(p) for p in parts)
            except ValueError:
                shape = ()
            if len(shape) != dims or min(shape) < 1:
                want = "x".join("N" * dims)
                raise argparse.ArgumentTypeError(
                    f"{item!r} is not a shape {want} of positive sizes"
                )
            out.append(shape)
        return out

    return parse


__all__ = ["median_ms", "shape_list"]
