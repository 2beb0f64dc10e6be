"""Benchmark tasks: real, offline data and one model per task (from :mod:`rootopt.train.model`).

* ``stdlib``: byte-level Llama LM on CPython's standard-library source.
* ``kjv``: the same LM on the King James Bible text.
* ``bbc``: BBC News topic classification (5 classes) from TF-IDF features, MLP classifier.
* ``digits``: scikit-learn's 8×8 digits with a small CNN (conv kernels go through ROOT flattened).

Data splits are fixed (independent of the run's seed); the seed changes the initialisation and
the batch order only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rootopt.config import ModelConfig
from rootopt.train.model import DigitsCNN, LlamaLM, MLPClassifier, loss_fn

SPLIT_SEED = 1234


@dataclass(frozen=True)
class Split:
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor


@dataclass(frozen=True)
class Task:
    """A benchmark task. ``steps``/``quick_steps``: optimizer steps of one run (full / --quick)."""

    name: str
    kind: str  # "lm" | "classify"
    description: str
    steps: int
    quick_steps: int
    batch_size: int
    eval_every: int
    load: Callable[[], Split]
    model: Callable[[], nn.Module]
    seq_len: int = 0

    def batch(self, data: Split, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        if self.kind == "lm":
            text = data.train_x
            starts = torch.randint(
                0, len(text) - self.seq_len - 1, (self.batch_size,), generator=gen
            )
            win = torch.stack([text[i : i + self.seq_len + 1] for i in starts.tolist()])
            return win[:, :-1], win[:, 1:]
        idx = torch.randint(0, len(data.train_y), (self.batch_size,), generator=gen)
        return data.train_x[idx], data.train_y[idx]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Split) -> tuple[float, float | None]:
        """``(validation loss, accuracy or None)`` on the whole fixed validation set."""
        model.eval()
        try:
            logits = model(data.val_x)
            loss = float(loss_fn(logits, data.val_y))
            acc = None
            if self.kind == "classify":
                acc = float((logits.argmax(-1) == data.val_y).float().mean())
            return loss, acc
        finally:
            model.train()


# --------------------------------------------------------------------------- data

LM_BYTES = 1_500_000
LM_SEQ = 64
LM_VAL_WINDOWS = 48


def _lm_split(corpus: str) -> Split:
    from rootopt.data.corpora import text_bytes

    raw = torch.frombuffer(bytearray(text_bytes(corpus, max_bytes=LM_BYTES)), dtype=torch.uint8)
    data = raw.long()
    cut = int(0.95 * len(data))
    train, val = data[:cut], data[cut:]
    # Fixed, evenly spaced validation windows over the held-out tail.
    starts = np.linspace(0, len(val) - LM_SEQ - 2, LM_VAL_WINDOWS).astype(int)
    win = torch.stack([val[i : i + LM_SEQ + 1] for i in starts])
    return Split(train, torch.empty(0), win[:, :-1].contiguous(), win[:, 1:].contiguous())


def _stratified(x: np.ndarray, y: np.ndarray, val_fraction: float = 0.2) -> tuple[np.ndarray, ...]:
    from sklearn.model_selection import train_test_split

    out: tuple[np.ndarray, ...] = tuple(
        train_test_split(x, y, test_size=val_fraction, random_state=SPLIT_SEED, stratify=y)
    )
    return out  # x_train, x_val, y_train, y_val


def _bbc_split() -> Split:
    from sklearn.feature_extraction.text import TfidfVectorizer

    from rootopt.data.corpora import _bbc_docs

    docs = list(_bbc_docs())
    names = sorted({c for c, _ in docs})
    labels = np.array([names.index(c) for c, _ in docs])
    texts = [t.decode("utf-8", errors="replace") for _, t in docs]
    xt, xv, yt, yv = _stratified(np.array(texts, dtype=object), labels)
    vec = TfidfVectorizer(max_features=BBC_FEATURES, sublinear_tf=True, stop_words="english")
    ftr = vec.fit_transform(list(xt)).toarray().astype(np.float32)  # fit on train only
    fva = vec.transform(list(xv)).toarray().astype(np.float32)
    return Split(
        torch.from_numpy(ftr), torch.from_numpy(yt), torch.from_numpy(fva), torch.from_numpy(yv)
    )


BBC_FEATURES = 2000
BBC_CLASSES = 5


def _digits_split() -> Split:
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = (ds.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xt, xv, yt, yv = _stratified(x, ds.target.astype(np.int64))
    return Split(
        torch.from_numpy(xt), torch.from_numpy(yt), torch.from_numpy(xv), torch.from_numpy(yv)
    )


def lm_model_config() -> ModelConfig:
    return ModelConfig(kind="llama", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)


def _lm(corpus: str, desc: str) -> Task:
    return Task(
        name=corpus,
        kind="lm",
        description=desc,
        steps=150,
        quick_steps=4,
        batch_size=16,
        eval_every=15,
        load=lambda: _lm_split(corpus),
        model=lambda: LlamaLM(lm_model_config(), LM_SEQ),
        seq_len=LM_SEQ,
    )


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _lm("stdlib", "byte-level Llama LM (d=64, 2 layers, GQA) on CPython stdlib source"),
        _lm("kjv", "byte-level Llama LM (d=64, 2 layers, GQA) on the King James Bible"),
        Task(
            name="bbc",
            kind="classify",
            description="BBC News topics (5 classes), TF-IDF (2000 terms) → MLP",
            steps=200,
            quick_steps=4,
            batch_size=32,
            eval_every=20,
            load=_bbc_split,
            model=lambda: MLPClassifier(BBC_FEATURES, 128, BBC_CLASSES),
        ),
        Task(
            name="digits",
            kind="classify",
            description="scikit-learn 8×8 digits, small CNN (conv kernels through ROOT flattened)",
            steps=200,
            quick_steps=4,
            batch_size=64,
            eval_every=20,
            load=_digits_split,
            model=lambda: DigitsCNN(10),
        ),
    )
}


@cache
def load_task_data(name: str) -> Split:
    """A task's split, loaded once per process."""
    return TASKS[name].load()


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]


def describe() -> list[dict[str, Any]]:
    return [
        {"name": t.name, "kind": t.kind, "description": t.description, "steps": t.steps}
        for t in TASKS.values()
    ]
