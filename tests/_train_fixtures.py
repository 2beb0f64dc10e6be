"""Shared helpers for the training-system tests (tiny model, tiny prepared corpus)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _faultkit import run_session

SRC = Path(__file__).resolve().parents[1] / "src"

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "data.seq_len=32",
    "data.batch_size=8",
    "run.max_steps=40",
    "run.log_every=5",
    "run.eval_every=20",
    "run.eval_batches=2",
    "optimization.warmup_steps=5",
    "monitoring.progress_bar=false",
    "monitoring.tensorboard=false",
    "monitoring.plot=false",
    "monitoring.histogram_every=0",
    "checkpoint.every=10",
]
# TINY without periodic evaluation: the in-process fault and refusal tests
FAST = [*TINY, "run.eval_every=0"]


def quiet(msg: str) -> None:
    """A ``say`` for in-process training that prints nothing."""


def prepare_tiny(out: Path, tokenizer: str = "bytes") -> Path:
    """150 KB of the KJV in samples of 32 tokens (``tokenizer``: e.g. ``bpe:512``)."""
    from rootopt.data import prepare

    prepare(
        "kjv",
        out,
        seq_len=32,
        max_bytes=150_000,
        samples_per_shard=400,
        val_fraction=0.05,
        seed=0,
        tokenizer=tokenizer,
    )
    return out


class PrometheusScraper:
    """Scrapes the exporter a training run starts (``monitoring.prometheus.port=0``) after
    step ``at``: use ``with PrometheusScraper(at) as s:`` around ``train(...,
    hooks=Hooks(after_step=s.after_step))``; ``s.pages`` holds what was served."""

    def __init__(self, at: int) -> None:
        self.at, self.pages, self.ports = at, list[str](), list[int]()

    def after_step(self, step: int) -> bool:
        import urllib.request

        if step == self.at:
            url = f"http://127.0.0.1:{self.ports[0]}/metrics"
            self.pages.append(urllib.request.urlopen(url, timeout=10).read().decode())
        return False

    def __enter__(self) -> PrometheusScraper:
        import rootopt.monitor.metrics as metrics

        self._original = original = metrics.PrometheusExporter.__init__
        ports = self.ports

        def spy(exporter: metrics.PrometheusExporter, host: str, port: int) -> None:
            original(exporter, host, port)
            ports.append(exporter.port)

        metrics.PrometheusExporter.__init__ = spy  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        import rootopt.monitor.metrics as metrics

        metrics.PrometheusExporter.__init__ = self._original  # type: ignore[method-assign]


def final_params(run_dir: Path) -> dict[str, object]:
    from rootopt.train import checkpoint

    found, _ = checkpoint.newest_valid(run_dir / "checkpoints")
    assert found is not None
    return found.state


def torchrun_env() -> dict[str, str]:
    """This environment for a torchrun launch: our src first, one thread per process, no
    rendezvous variables inherited from an outer launcher."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def torchrun_cmd(n: int, run: Path, data: Path, over: list[str], *launcher: str) -> list[str]:
    # --standalone: a rendezvous on localhost with a free port chosen by torchrun
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *([] if any(a.startswith("--nnodes") for a in launcher) else ["--standalone"]),
        f"--nproc_per_node={n}",
        *launcher,
        "-m",
        "rootopt.train",
        "--data_path",
        str(data),
        "--log_dir",
        str(run),
        *over,
    ]


def torchrun(
    n: int,
    run: Path,
    data: Path,
    over: list[str],
    *launcher: str,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """One torchrun launch (``env``: added to :func:`torchrun_env`); on timeout its whole
    session is killed (no orphan workers)."""
    done = run_session(
        torchrun_cmd(n, run, data, over, *launcher),
        env={**torchrun_env(), **(env or {})},
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def logged_losses(run: Path) -> dict[int, float]:
    """step -> training loss, from the run's metrics.jsonl."""
    from rootopt.monitor import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}
