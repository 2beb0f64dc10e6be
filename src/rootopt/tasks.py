"""Benchmark tasks: real, offline data and one model per task (from :mod:`rootopt.train.models`).

* ``stdlib``: byte-level Llama LM on CPython's standard-library source.
* ``kjv``: the same LM on the King James Bible text.
* ``bbc``: BBC News topic classification (5 classes) from TF-IDF features, MLP classifier.
* ``digits``: scikit-learn's 8×8 digits with a small CNN (conv kernels go through ROOT flattened).

* ``stdlib-large``: the embedded training default's LM (d=128, 4 layers) on the ``stdlib`` data.

Data splits are fixed (independent of the run's seed); the seed changes the initialisation and
the batch order only. Every task has three disjoint splits: train, a validation split (used to
choose hyperparameters) and a test split (used only to report), see docs/benchmarks.md.
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
from rootopt.train.models import DigitsCNN, LlamaLM, MLPClassifier, loss_fn

SPLIT_SEED = 1234


@dataclass(frozen=True)
class Split:
    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    test_x: Tensor
    test_y: Tensor

    def eval_set(self, split: str) -> tuple[Tensor, Tensor]:
        if split == "val":
            return self.val_x, self.val_y
        if split == "test":
            return self.test_x, self.test_y
        raise ValueError(f"unknown split {split!r} (val | test)")


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
    data: str = ""  # the data set's name when tasks share one (default: the task's name)

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
    def evaluate(
        self, model: nn.Module, data: Split, split: str = "val"
    ) -> tuple[float, float | None]:
        """``(loss, accuracy or None)`` on the whole fixed ``split`` (``val`` or ``test``)."""
        x, y = data.eval_set(split)
        model.eval()
        try:
            logits = model(x)
            loss = float(loss_fn(logits, y))
            acc = None
            if self.kind == "classify":
                acc = float((logits.argmax(-1) == y).float().mean())
            return loss, acc
        finally:
            model.train()


# --------------------------------------------------------------------------- data

LM_BYTES = 1_500_000
LM_SEQ = 64
# Each held-out split: 256 evenly spaced windows of 64 predicted bytes (16,384 targets).
LM_EVAL_WINDOWS = 256
LM_VAL_FRACTION = LM_TEST_FRACTION = 0.05


def _windows(block: Tensor) -> tuple[Tensor, Tensor]:
    starts = np.linspace(0, len(block) - LM_SEQ - 2, LM_EVAL_WINDOWS).astype(int)
    win = torch.stack([block[i : i + LM_SEQ + 1] for i in starts])
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def _lm_split(corpus: str) -> Split:
    from rootopt.data.corpora import text_bytes

    raw = torch.frombuffer(bytearray(text_bytes(corpus, max_bytes=LM_BYTES)), dtype=torch.uint8)
    data = raw.long()
    # Contiguous blocks: train, then validation, then test (the test block is the tail).
    n = len(data)
    cut_val = int((1 - LM_VAL_FRACTION - LM_TEST_FRACTION) * n)
    cut_test = int((1 - LM_TEST_FRACTION) * n)
    train = data[:cut_val]
    val_x, val_y = _windows(data[cut_val:cut_test])
    test_x, test_y = _windows(data[cut_test:])
    return Split(train, torch.empty(0), val_x, val_y, test_x, test_y)


def _stratified(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
    """Stratified 60 / 20 / 20 train / validation / test split (fixed seed)."""
    from sklearn.model_selection import train_test_split

    xt, xh, yt, yh = train_test_split(x, y, test_size=0.4, random_state=SPLIT_SEED, stratify=y)
    xv, xs, yv, ys = train_test_split(xh, yh, test_size=0.5, random_state=SPLIT_SEED, stratify=yh)
    return xt, xv, xs, yt, yv, ys


def _bbc_split() -> Split:
    from sklearn.feature_extraction.text import TfidfVectorizer

    from rootopt.data.corpora import _bbc_docs

    docs = list(_bbc_docs())
    names = sorted({c for c, _ in docs})
    labels = np.array([names.index(c) for c, _ in docs])
    texts = [t.decode("utf-8", errors="replace") for _, t in docs]
    xt, xv, xs, yt, yv, ys = _stratified(np.array(texts, dtype=object), labels)
    vec = TfidfVectorizer(max_features=BBC_FEATURES, sublinear_tf=True, stop_words="english")
    ftr = vec.fit_transform(list(xt)).toarray().astype(np.float32)  # fit on train only
    fva = vec.transform(list(xv)).toarray().astype(np.float32)
    fte = vec.transform(list(xs)).toarray().astype(np.float32)
    return Split(*(torch.from_numpy(a) for a in (ftr, yt, fva, yv, fte, ys)))


BBC_FEATURES = 2000
BBC_CLASSES = 5


def _digits_split() -> Split:
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = (ds.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xt, xv, xs, yt, yv, ys = _stratified(x, ds.target.astype(np.int64))
    return Split(*(torch.from_numpy(a) for a in (xt, yt, xv, yv, xs, ys)))


def lm_model_config(large: bool = False) -> ModelConfig:
    """The benchmark LM: d=64, 2 layers; ``large``: the training default's d=128, 4 layers."""
    if large:
        return ModelConfig(kind="llama", d_model=128, n_layers=4, n_heads=4, n_kv_heads=2)
    return ModelConfig(kind="llama", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)


def _lm(corpus: str, desc: str, *, large: bool = False, steps: int = 150) -> Task:
    return Task(
        name=f"{corpus}-large" if large else corpus,
        kind="lm",
        description=desc,
        steps=steps,
        quick_steps=4,
        batch_size=16,
        eval_every=max(1, steps // 10),
        load=lambda: _lm_split(corpus),
        model=lambda: LlamaLM(lm_model_config(large), LM_SEQ),
        seq_len=LM_SEQ,
        data=corpus,
    )


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _lm("stdlib", "byte-level Llama LM (d=64, 2 layers, GQA) on CPython stdlib source"),
        _lm("kjv", "byte-level Llama LM (d=64, 2 layers, GQA) on the King James Bible"),
        _lm(
            "stdlib",
            "byte-level Llama LM (d=128, 4 layers, GQA: the training default's model) on "
            "CPython stdlib source",
            large=True,
            steps=200,
        ),
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
def _load_data(data: str) -> Split:
    return next(t for t in TASKS.values() if (t.data or t.name) == data).load()


def load_task_data(name: str) -> Split:
    """A task's split, loaded once per process (tasks on the same data share it)."""
    t = TASKS[name]
    return _load_data(t.data or t.name)


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]


def describe() -> list[dict[str, Any]]:
    return [
        {"name": t.name, "kind": t.kind, "description": t.description, "steps": t.steps}
        for t in TASKS.values()
    ]
