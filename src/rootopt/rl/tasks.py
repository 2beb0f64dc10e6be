"""The task distribution of controller episodes: small variants of the benchmark tasks.

Each :class:`EpisodeTask` reuses a benchmark task's data and model family
(:mod:`rootopt.tasks`) at a size that keeps an episode to a few seconds on one CPU core.
The training distribution and the held-out set differ in corpus (``kjv`` is never trained on)
and in model size (widths never trained on), so an evaluation measures transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class EpisodeTask:
    name: str
    data: str  # bench task name whose data is used ("toy" = synthetic regression)
    model: Callable[[], nn.Module]
    batch_size: int
    seq_len: int = 0


class ToyRegression(nn.Module):
    """``y = x Aᵀ`` with a 2-layer linear model; a fast, deterministic test task."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim, bias=False)
        self.l2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.l2(self.l1(x))
        return out


def _llama(d_model: int, layers: int, seq: int) -> nn.Module:
    from rootopt.config import ModelConfig
    from rootopt.train.models import LlamaLM

    heads = max(2, d_model // 16)
    return LlamaLM(
        ModelConfig(kind="llama", d_model=d_model, n_layers=layers, n_heads=heads, n_kv_heads=2),
        seq,
    )


def _digits(width: int) -> nn.Module:
    from rootopt.train.models import DigitsCNN

    return DigitsCNN(10, width=width)


def _bbc(hidden: int) -> nn.Module:
    from rootopt.tasks import BBC_CLASSES, BBC_FEATURES
    from rootopt.train.models import MLPClassifier

    return MLPClassifier(BBC_FEATURES, hidden, BBC_CLASSES)


LM_SEQ = 32

TASKS: dict[str, EpisodeTask] = {
    t.name: t
    for t in (
        EpisodeTask("toy", "toy", lambda: ToyRegression(16), 32),
        # training distribution
        EpisodeTask("stdlib-d32", "stdlib", lambda: _llama(32, 1, LM_SEQ), 16, LM_SEQ),
        EpisodeTask("digits-w8", "digits", lambda: _digits(8), 64),
        EpisodeTask("bbc-h32", "bbc", lambda: _bbc(32), 32),
        # held out: corpus never seen, and widths never seen
        EpisodeTask("kjv-d32", "kjv", lambda: _llama(32, 1, LM_SEQ), 16, LM_SEQ),
        EpisodeTask("stdlib-d64", "stdlib", lambda: _llama(64, 2, LM_SEQ), 16, LM_SEQ),
        EpisodeTask("digits-w24", "digits", lambda: _digits(24), 64),
    )
}


def episode_task(name: str) -> EpisodeTask:
    if name not in TASKS:
        raise ValueError(f"unknown controller task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]


def _toy_data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1234)
    a = torch.randn(16, 16, generator=g) / 4.0
    x = torch.randn(256, 16, generator=g)
    return x, x @ a.T


class Sampler:
    """Batches and validation of an episode task (the benchmark splits, fixed per task)."""

    def __init__(self, t: EpisodeTask) -> None:
        self.t = t
        if t.data == "toy":
            x, y = _toy_data()
            self.train_x, self.train_y, self.val_x, self.val_y = x, y, x, y
            return
        from rootopt.tasks import load_task_data

        s = load_task_data(t.data)
        self.train_x, self.train_y = s.train_x, s.train_y
        if t.seq_len:  # shorter LM windows than the benchmark's
            self.val_x, self.val_y = s.val_x[:, : t.seq_len], s.val_y[:, : t.seq_len]
        else:
            self.val_x, self.val_y = s.val_x, s.val_y

    def batch(self, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        t = self.t
        if t.seq_len:
            text = self.train_x
            starts = torch.randint(0, len(text) - t.seq_len - 1, (t.batch_size,), generator=gen)
            win = torch.stack([text[i : i + t.seq_len + 1] for i in starts.tolist()])
            return win[:, :-1], win[:, 1:]
        idx = torch.randint(0, len(self.train_x), (t.batch_size,), generator=gen)
        return self.train_x[idx], self.train_y[idx]

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        if self.t.data == "toy":
            return torch.nn.functional.mse_loss(out, y)
        from rootopt.train.models import loss_fn

        return loss_fn(out, y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float | None]:
        model.eval()
        try:
            out = model(self.val_x)
            acc = None
            if self.t.data in ("digits", "bbc"):
                acc = float((out.argmax(-1) == self.val_y).float().mean())
            return float(self.loss(out, self.val_y)), acc
        finally:
            model.train()
