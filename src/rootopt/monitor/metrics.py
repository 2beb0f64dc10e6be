"""Metric sinks: JSONL (always readable by ``rootopt report``), TensorBoard, Prometheus.

Record names (JSONL keys / TensorBoard tags) and Prometheus metric names are fixed here and
used by ``deploy/grafana-dashboard.json``; :data:`PROMETHEUS_METRICS` is the contract the
tests check against the dashboard.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from rootopt._atomic import atomic_write, open_append, own_dir

# Prometheus metric name -> help. Labelled ones take {"param": tensor name} or {"kind": ...}.
PROMETHEUS_METRICS: dict[str, str] = {
    "rootopt_step": "optimizer steps completed",
    "rootopt_steps_per_second": "optimizer steps per second (last logging window)",
    "rootopt_tokens_per_second": "training tokens (or samples) per second (last logging window)",
    "rootopt_mfu": "model FLOPs utilisation: training FLOPs/s of the model over the devices' peak (last logging window); on a CPU an estimate against a peak measured at start (env.json)",
    "rootopt_loss": "training loss (mean over the last logging window)",
    "rootopt_val_loss": "validation loss (last evaluation)",
    "rootopt_val_bits_per_byte": "validation bits per UTF-8 byte of the text (last evaluation; absent when the data does not count its bytes)",
    "rootopt_learning_rate": "current learning rate of the first parameter group",
    "rootopt_grad_norm": "global gradient norm before clipping (histogram)",
    "rootopt_update_param_ratio": "||Δθ|| / ||θ|| per tensor at the last logged step",
    "rootopt_root_clip_fraction": "fraction of entries ROOT's soft threshold clipped, per matrix",
    "rootopt_root_eps": "ROOT's outlier threshold ε, per matrix",
    "rootopt_nonfinite_steps_total": "steps skipped because gradients were NaN/Inf",
    "rootopt_loss_scale": "current fp16 loss scale (1 when unused)",
    "rootopt_memory_bytes": "memory in use (kind=rss | cuda_allocated | cuda_max_allocated)",
}
_LABELLED = {
    "rootopt_update_param_ratio": "param",
    "rootopt_root_clip_fraction": "param",
    "rootopt_root_eps": "param",
    "rootopt_memory_bytes": "kind",
}
GRAD_NORM_BUCKETS = (*tuple(10.0**e for e in range(-4, 4)), float("inf"))


def strict(value: Any) -> Any:
    """``value`` with every NaN/Inf float replaced by None: strict JSON (RFC 8259) has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def memory_bytes() -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with open("/proc/self/statm") as fh:
            out["rss"] = float(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource

        out["rss"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if torch.cuda.is_available():
        out["cuda_allocated"] = float(torch.cuda.memory_allocated())
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated())
    return out


class PrometheusExporter:
    """An HTTP endpoint with its own registry (several runs per process stay independent)."""

    def __init__(self, host: str, port: int) -> None:
        import prometheus_client as pc

        self.registry = pc.CollectorRegistry()
        self.gauges: dict[str, Any] = {}
        for name, doc in PROMETHEUS_METRICS.items():
            if name == "rootopt_grad_norm":
                self.grad_norm = pc.Histogram(
                    name, doc, registry=self.registry, buckets=GRAD_NORM_BUCKETS
                )
            elif name == "rootopt_nonfinite_steps_total":
                self.nonfinite = pc.Counter(
                    name.removesuffix("_total"), doc, registry=self.registry
                )
            else:
                labels = [_LABELLED[name]] if name in _LABELLED else []
                self.gauges[name] = pc.Gauge(name, doc, labels, registry=self.registry)
        self.server, self.thread = pc.start_http_server(port, addr=host, registry=self.registry)
        self.port: int = self.server.server_port

    def observe(self, record: dict[str, Any], labelled: dict[str, dict[str, float]]) -> None:
        for key, name in (
            ("step", "rootopt_step"),
            ("steps_per_s", "rootopt_steps_per_second"),
            ("tokens_per_s", "rootopt_tokens_per_second"),
            ("mfu", "rootopt_mfu"),
            ("loss", "rootopt_loss"),
            ("val_loss", "rootopt_val_loss"),
            ("val_bits_per_byte", "rootopt_val_bits_per_byte"),
            ("lr", "rootopt_learning_rate"),
            ("loss_scale", "rootopt_loss_scale"),
        ):
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.gauges[name].set(value)
        for name, by_label in labelled.items():
            for label, value in by_label.items():
                if math.isfinite(value):
                    self.gauges[name].labels(label).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Monitor:
    """Fan-out of one metric record to the enabled sinks. Only rank 0 writes."""

    def __init__(
        self,
        run_dir: Path,
        *,
        jsonl: bool,
        tensorboard: bool,
        prometheus: tuple[str, int] | None,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        # lines in metrics.jsonl (written to summary.json, so `rootopt report` can tell a
        # complete log from one cut at a line boundary) and the steps with a val record
        self.records = 0
        self.val_steps: set[int] = set()
        # appended, never through a symbolic link (rootopt._atomic.LinkError)
        self._jsonl = open_append(run_dir / "metrics.jsonl") if enabled and jsonl else None
        self._events = open_append(run_dir / "events.jsonl") if enabled else None
        self.tb: Any = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # event files get new names (time, host, pid); the directory must be the run's
            self.tb = SummaryWriter(str(own_dir(run_dir / "tensorboard")))
        self.prom = PrometheusExporter(*prometheus) if enabled and prometheus else None

    def log(
        self, record: dict[str, Any], labelled: dict[str, dict[str, float]] | None = None
    ) -> None:
        """One record (``step`` + scalars); ``labelled`` holds per-tensor series for TB/Prometheus."""
        if not self.enabled:
            return
        labelled = labelled or {}
        step = int(record["step"])
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(strict(record), allow_nan=False) + "\n")
            self._jsonl.flush()
            self.records += 1
            if "val_loss" in record:
                self.val_steps.add(step)
        if self.tb is not None:
            for key, value in record.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self.tb.add_scalar(
                        f"train/{key}" if not key.startswith("val") else f"val/{key}", value, step
                    )
                elif isinstance(value, dict):  # e.g. lr_groups: one scalar per group
                    for label, v in value.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool):
                            self.tb.add_scalar(f"{key}/{label}", v, step)
            for name, by_label in labelled.items():
                for label, value in by_label.items():
                    self.tb.add_scalar(f"{name.removeprefix('rootopt_')}/{label}", value, step)
        if self.prom is not None:
            self.prom.observe(record, labelled)

    def grad_norm(self, value: float) -> None:
        if self.prom is not None and math.isfinite(value):
            self.prom.grad_norm.observe(value)

    def nonfinite_step(self) -> None:
        if self.prom is not None:
            self.prom.nonfinite.inc()

    def histograms(self, step: int, model: torch.nn.Module) -> None:
        """Parameter and gradient histograms. A sharded parameter (an FSDP2 ``DTensor``)
        is summarised by this rank's shard, under ``param_shard/`` and ``grad_shard/``:
        the whole tensor would need a collective on every rank (this runs on rank 0 only)
        and a full copy here."""
        if self.tb is None:
            return
        for name, p in model.named_parameters():
            value, grad, kind = p.detach(), p.grad, ""
            if hasattr(value, "to_local"):  # DTensor
                value = value.to_local()
                grad = grad.to_local() if grad is not None else None  # type: ignore[attr-defined]
                kind = "_shard"
            if value.numel() == 0:
                continue
            self.tb.add_histogram(f"param{kind}/{name}", value.float().cpu(), step)
            if grad is not None and bool(torch.isfinite(grad).all()):
                self.tb.add_histogram(f"grad{kind}/{name}", grad.detach().float().cpu(), step)

    def event(self, kind: str, **fields: Any) -> None:
        """Notable events (resume, skipped step, checkpoint, OOM, timeout) for the report."""
        if self._events is not None:
            self._events.write(
                json.dumps(strict({"event": kind, **fields}), allow_nan=False) + "\n"
            )
            self._events.flush()

    def supersede_after(self, step: int) -> int:
        """Move records of steps after ``step`` to ``metrics.superseded.jsonl``.

        A resumed run continues from its checkpoint at ``step``; the records a killed process
        wrote after it describe steps that are run again, so they leave ``metrics.jsonl``
        (one record per step, no duplicates) but are kept, not deleted. Returns how many moved.
        """
        if self._jsonl is None:
            return 0
        path = self.run_dir / "metrics.jsonl"
        self._jsonl.close()
        keep: list[bytes] = []
        moved: list[bytes] = []
        for raw in path.read_bytes().splitlines(keepends=True):
            try:  # a line that is not UTF-8 JSON was cut (a crash, a full disk) or damaged
                row = json.loads(raw.decode("utf-8"))
                later = int(row["step"]) > step
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
                row, later = None, bool(raw.strip())
            (moved if later else keep).append(raw if raw.endswith(b"\n") else raw + b"\n")
            if not later and isinstance(row, dict) and "val_loss" in row:
                self.val_steps.add(int(row["step"]))
        self.records = len(keep)
        if moved:
            with open_append(self.run_dir / "metrics.superseded.jsonl", binary=True) as fh:
                fh.writelines(moved)
                fh.flush()
                os.fsync(fh.fileno())
            atomic_write(path, b"".join(keep))
        self._jsonl = open_append(path)
        return len(moved)

    def close(self) -> None:
        """Close every sink, even when one fails (e.g. a full disk refuses the last
        flush); then raise the first failure."""
        first: BaseException | None = None
        closers = [fh.close for fh in (self._jsonl, self._events) if fh is not None]
        closers += [x.close for x in (self.tb, self.prom) if x is not None]
        self._jsonl = self._events = self.tb = self.prom = None
        for close in closers:
            try:
                close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return read_jsonl_checked(path)[0]


def read_jsonl_checked(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Records of a JSONL file and the 1-based numbers of lines that are not JSON objects."""
    if not path.is_file():
        return [], []
    rows, bad = [], []
    text = path.read_bytes().decode("utf-8", errors="replace")
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append(i)  # e.g. a line cut by a crash or a full disk
    return rows, bad


def plot_loss(run_dir: Path, out: Path | None = None) -> Path | None:
    """``loss_curve.png`` from metrics.jsonl (train loss and, if present, validation loss)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [
        (r["step"], r["loss"]) for r in rows if "loss" in r and isinstance(r["loss"], (int, float))
    ]
    val = [
        (r["step"], r["val_loss"])
        for r in rows
        if "val_loss" in r and isinstance(r["val_loss"], (int, float))
    ]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.2, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = out or run_dir / "loss_curve.png"
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(out, buf.getvalue())  # a new file renamed into place: never through a link
    return out
