"""Tokenizers for text corpora: byte tokens, a Hugging Face ``tokenizer.json``, or a
byte-level BPE trained on the corpus (docs/data.md, "Your own data").

A spec string (``data.tokenizer``, ``rootopt data prepare --tokenizer``) names one:

``bytes``
    One token per UTF-8 byte, id = byte value, 256 ids, no end-of-document token: documents
    are joined by a blank line (``"\\n\\n"``). The default, and what every dataset prepared
    before tokenizers existed holds.
``PATH``
    A ``tokenizer.json`` (or a directory holding one) in the format of the Hugging Face
    ``tokenizers`` library, loaded with it, used as it is.
``bpe:N``
    A byte-level BPE of ``N`` ids (``N`` ≥ 257: the 256 byte symbols and ``<|endoftext|>``)
    trained on the corpus with ``tokenizers`` (the GPT-2 pre-tokenization; Radford et al.
    2019). Fewer ids result when the corpus has fewer merges to learn.

Token ids are stored in the narrowest unsigned type that holds the vocabulary
(:func:`token_dtype`). The tokenizer of a prepared directory is recorded in its manifest
(``manifest["tokenizer"]``) and, unless it is ``bytes``, stored beside the shards as
``tokenizer.json``; :func:`hf_files` gives what ``transformers.AutoTokenizer`` needs to load
it, for ``bytes`` too, written by ``transformers``' own ``PreTrainedTokenizerFast.save_pretrained``
(:func:`transformers_files`).

The special tokens of a tokenizer (:data:`ROLES`: ``bos_token``, ``eos_token``, ``unk_token``,
``pad_token``, ...; and ``additional_special_tokens``) are what a ``tokenizer_config.json`` or
``special_tokens_map.json`` beside a tokenizer file names, then what the ``tokenizer.json``
defines itself (:func:`file_special_tokens`); a prepared directory records them in its
manifest (``manifest["tokenizer"]["special_tokens"]``, for a tokenizer file) and the export
keeps every one (docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from rootopt.data.corpora import DOC_SEPARATOR, CorpusError, Piece, piece_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

BYTES: Literal["bytes"] = "bytes"
FILE_NAME = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"  # the end-of-document token of bpe:N (GPT-2's name for it)
MIN_BPE = 257  # 256 byte symbols + EOS_TOKEN
MAX_VOCAB = 1 << 20
MAX_FILE_BYTES = 1 << 30
# Names of an end-of-document token in common tokenizer files, first match wins, when no
# tokenizer_config.json beside the file names its eos_token.
EOS_NAMES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
# The special tokens transformers names (SPECIAL_TOKENS_ATTRIBUTES of its tokenizers, 4.x and
# 5.x alike), and the list of the other special tokens under the name both versions read.
ROLES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
EXTRA = "additional_special_tokens"
# The roles a causal LM's tokenizer classes give defaults (Qwen2Tokenizer: unk, eos and pad
# "<|endoftext|>"): written as null where the tokenizer has none, which every class reads
# as "none" (save_pretrained leaves them out).
NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")
# What a causal LM reads from a tokenizer's output. Without it transformers 4.x's
# PreTrainedTokenizerFast also returns token_type_ids, which generate() refuses
# ("model_kwargs are not used by the model"); 5.x's default is these two.
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")
MAP_FILE = "special_tokens_map.json"
CONFIG_FILE = "tokenizer_config.json"
Kind = Literal["bytes", "file", "bpe"]


class TokenizerError(CorpusError):
    """A tokenizer spec or file that cannot be used (a user error: one line, exit 2)."""


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The narrowest unsigned integer type that holds every id below ``vocab_size``."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed spec: ``kind``, the string as given, the file (``file``), ``N`` (``bpe``)."""

    kind: Kind
    spec: str
    path: Path | None = None
    vocab: int = 0


_BPE = re.compile(r"^bpe:(.*)$", re.IGNORECASE)


def parse_spec(spec: str) -> TokenizerSpec:
    """``bytes``, ``bpe:N`` or the path of a ``tokenizer.json`` (or of a directory holding
    one); one line of :class:`TokenizerError` for anything else. A file is only located here,
    not read: :func:`load` parses it."""
    text = spec.strip() if isinstance(spec, str) else ""
    if not text:
        raise TokenizerError("tokenizer: expected bytes, bpe:N or the path of a tokenizer.json")
    if text.lower() == BYTES:
        return TokenizerSpec(BYTES, BYTES)
    m = _BPE.match(text)
    if m:
        try:
            n = int(m.group(1))
        except ValueError:
            raise TokenizerError(
                f"tokenizer {text[:60]!r}: expected bpe:N with an integer vocabulary size N"
            ) from None
        if not MIN_BPE <= n <= MAX_VOCAB:
            raise TokenizerError(
                f"tokenizer {text[:60]!r}: N must be in [{MIN_BPE}, {MAX_VOCAB}] (256 byte "
                f"symbols and {EOS_TOKEN} at least); got {n}"
            )
        return TokenizerSpec("bpe", f"bpe:{n}", vocab=n)
    path = Path(text)
    if path.is_dir():
        path = path / FILE_NAME
    if not path.exists():
        raise TokenizerError(
            f"tokenizer {text[:120]!r}: no such file (expected bytes, bpe:N or the path of a "
            "tokenizer.json)"
        )
    if not path.is_file():
        raise TokenizerError(f"tokenizer {text[:120]!r} is not a regular file")
    return TokenizerSpec("file", text, path=path)


def spec_problem(spec: str) -> str | None:
    """The problem of a spec as one line, or None (config validation)."""
    try:
        parse_spec(spec)
    except TokenizerError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------- tokenizers


class Tokenizer:
    """What preparing data needs of a tokenizer (see the module docstring for the kinds).

    ``encode_batch`` tokenizes texts; :meth:`pack` turns the pieces of a corpus
    (:class:`rootopt.data.corpora.Piece`) into one token stream in the storage dtype,
    with the end-of-document token (or, without one, the text ``"\\n\\n"``) after each
    document."""

    kind: Kind
    spec: str
    vocab_size: int
    eos_id: int | None
    sha256: str | None
    # role -> token (ROLES) and EXTRA -> [tokens]: recorded for a tokenizer file only (a
    # bpe:N has its end-of-document token alone, byte tokens none)
    special: dict[str, Any]

    @property
    def dtype(self) -> np.dtype[Any]:
        return token_dtype(self.vocab_size)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def pack(self, pieces: list[Piece]) -> np.ndarray:
        raise NotImplementedError

    def to_json(self) -> str | None:
        """The ``tokenizer.json`` stored beside the shards (None for ``bytes``)."""
        return None

    def text_bytes(self, pieces: list[Piece]) -> int:
        """The UTF-8 bytes of the text :meth:`pack` encodes for ``pieces`` (a separator
        written as text counts, an end-of-document id does not)."""
        raise NotImplementedError

    def byte_lengths(self) -> np.ndarray | None:
        """The UTF-8 bytes each id stands for, indexed by id (int64); None when the ids do
        not each stand for fixed bytes of the text (see :func:`token_byte_lengths`). The
        end-of-document id counts 0: :meth:`pack` puts it between documents, where the text
        has no bytes."""
        return None

    def record(self) -> dict[str, Any]:
        """``manifest["tokenizer"]``."""
        return {
            "kind": self.kind,
            "spec": self.spec,
            "vocab_size": self.vocab_size,
            "sha256": self.sha256,
            "file": FILE_NAME if self.to_json() is not None else None,
            "eos_id": self.eos_id,
            **({"special_tokens": self.special} if self.kind == "file" and self.special else {}),
        }


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids (numpy; the raw bytes of a corpus file are kept as they are)."""

    def __init__(self) -> None:
        self.kind, self.spec, self.vocab_size = BYTES, BYTES, 256
        self.eos_id, self.sha256, self.special = None, None, {}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).tolist() for t in texts]

    def pack(self, pieces: list[Piece]) -> np.ndarray:
        return np.frombuffer(b"".join(p.data + p.sep for p in pieces), dtype=np.uint8)

    def text_bytes(self, pieces: list[Piece]) -> int:
        return sum(len(p.data) + len(p.sep) for p in pieces)

    def byte_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)


class FileTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (a ``tokenizer.json`` or a BPE trained here). Batches are
    encoded with ``encode_batch_fast``, which runs on all cores (the library's thread pool)
    and skips the character offsets nobody here reads. Special tokens of the tokenizer's
    post-processor (a BOS template, say) are not added: documents are separated by
    ``eos_id`` alone."""

    def __init__(self, tok: HFTokenizer, *, kind: Kind, spec: str, eos_id: int | None) -> None:
        self.tok, self.kind, self.spec, self.eos_id = tok, kind, spec, eos_id
        self.special: dict[str, Any] = {}
        self._json = tok.to_str()
        self.sha256 = hashlib.sha256(self._json.encode("utf-8")).hexdigest()
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        if self.vocab_size < 1:
            raise TokenizerError(f"tokenizer {spec[:120]!r} has an empty vocabulary")
        if self.vocab_size > MAX_VOCAB:
            raise TokenizerError(
                f"tokenizer {spec[:120]!r} has {self.vocab_size} ids; at most {MAX_VOCAB} "
                "are supported"
            )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encs]

    def _texts(self, pieces: list[Piece]) -> list[str]:
        """What :meth:`pack` encodes: each piece's text, and without an end-of-document id
        the separator as text after a document's last piece."""
        sep = "" if self.eos_id is not None else DOC_SEPARATOR.decode()
        return [piece_text(p) + (sep if p.sep else "") for p in pieces]

    def text_bytes(self, pieces: list[Piece]) -> int:
        return sum(len(t.encode("utf-8")) for t in self._texts(pieces))

    def byte_lengths(self) -> np.ndarray | None:
        out = token_byte_lengths(self.tok, self.vocab_size)
        if out is not None and self.eos_id is not None:
            out[self.eos_id] = 0
        return out

    def pack(self, pieces: list[Piece]) -> np.ndarray:
        eos, dtype = self.eos_id, self.dtype
        texts = self._texts(pieces)
        ids = self.encode_batch(texts)
        if len(ids) != len(pieces):
            raise TokenizerError(f"tokenizer returned {len(ids)} encodings for {len(pieces)}")
        parts: list[np.ndarray] = []
        tail = np.array([eos if eos is not None else 0], dtype=dtype)
        for p, row in zip(pieces, ids):
            parts.append(np.array(row, dtype=dtype))
            if eos is not None and p.sep:
                parts.append(tail)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def to_json(self) -> str:
        return self._json


def token_byte_lengths(tok: HFTokenizer, vocab_size: int) -> np.ndarray | None:
    """The UTF-8 bytes each id of a byte-level BPE stands for (int64, ``vocab_size``
    entries): a token of its model is a string over GPT-2's 256 byte symbols
    (:func:`_byte_symbols`), one symbol per byte; a special added token stands for no text
    (0), another added token for its content. None for any other tokenizer (no ByteLevel
    decoder, or a token outside the byte alphabet): a SentencePiece ``▁``, a WordPiece
    ``##`` or a normalizer make a token's bytes depend on its context. A tokenizer that
    passes here can still encode a text into ids whose lengths do not add up to the text's
    bytes (a ByteLevel pre-tokenizer that adds a prefix space, a literal special token in
    the text); :func:`rootopt.data.preparing.stage` checks every batch."""
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, dict)]
    if "ByteLevel" not in kinds:
        return None
    alphabet = set(_byte_symbols())
    out = np.zeros(vocab_size, dtype=np.int64)
    for token, i in tok.get_vocab(with_added_tokens=False).items():
        if not set(token) <= alphabet:
            return None
        if 0 <= i < vocab_size:
            out[i] = len(token)
    for i, added in tok.get_added_tokens_decoder().items():
        if 0 <= i < vocab_size:
            out[i] = 0 if added.special else len(added.content.encode("utf-8"))
    return out


def from_json(text: str, where: str) -> HFTokenizer:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json``'s text; one line of
    :class:`TokenizerError` naming ``where`` when it is not one."""
    from tokenizers import Tokenizer as HFTok

    try:  # the library's own message for what is not JSON, or JSON of another kind, is serde's
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(
            f"tokenizer {where[:120]!r} is not a tokenizers JSON file: not valid JSON (line "
            f"{exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise TokenizerError(
            f"tokenizer {where[:120]!r} is not a tokenizers JSON file: valid JSON, but "
            'without the "model" object a tokenizer.json holds'
        )
    try:
        return HFTok.from_str(text)
    except Exception as exc:  # the library raises a bare Exception with serde's message
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise TokenizerError(
            f"tokenizer {where[:120]!r} is not a tokenizers JSON file ({first})"
        ) from None


def token_name(value: Any) -> str | None:
    """A special token as a tokenizer config names it: a string, or an ``AddedToken`` as
    transformers serializes it (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _json_beside(path: Path) -> dict[str, Any]:
    """A JSON object file of a Hugging Face model directory; {} when it is missing or not
    one (it is the user's, read only for the names of special tokens)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def file_special_tokens(text: str, tok: HFTokenizer, beside: Path | None) -> dict[str, Any]:
    """The special tokens of a ``tokenizer.json`` (``text``, parsed as ``tok``), each one
    in its vocabulary: the roles and ``additional_special_tokens`` that a
    ``tokenizer_config.json`` or ``special_tokens_map.json`` in the directory ``beside``
    names (first match wins), then what the file defines itself: its model's unknown token,
    its padding token, an end-of-document token by name (:data:`EOS_NAMES`), and every other
    added token marked special."""
    found: dict[str, Any] = {}
    extra: list[str] = []

    def known(name: str | None) -> bool:
        return name is not None and tok.token_to_id(name) is not None

    for data in [_json_beside(beside / n) for n in (CONFIG_FILE, MAP_FILE)] if beside else []:
        for role in ROLES:
            name = token_name(data.get(role))
            if role not in found and known(name):
                found[role] = name
        listed = data.get(EXTRA, data.get("extra_special_tokens"))
        for value in listed if isinstance(listed, list) else []:
            name = token_name(value)
            if known(name) and name not in extra:
                extra.append(str(name))
    raw = json.loads(text)
    own = {
        "unk_token": token_name((raw.get("model") or {}).get("unk_token")),
        "pad_token": token_name((raw.get("padding") or {}).get("pad_token")),
        "eos_token": next((n for n in EOS_NAMES if known(n)), None),
    }
    for role, name in own.items():
        if role not in found and known(name):
            found[role] = name
    named = set(found.values())
    for added in raw.get("added_tokens") or []:
        name = token_name(added)
        if added.get("special") and known(name) and name not in named and name not in extra:
            extra.append(str(name))
    if extra:
        found[EXTRA] = extra
    return found


def load_file(spec: TokenizerSpec) -> FileTokenizer:
    """A ``tokenizer.json`` (one line of :class:`TokenizerError` if it does not parse)."""
    assert spec.path is not None
    path = spec.path
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise TokenizerError(f"tokenizer {spec.spec[:120]!r} is {size} bytes; not a tokenizer")
        raw = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(
            f"tokenizer {spec.spec[:120]!r} cannot be read ({exc.strerror or exc})"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"tokenizer {spec.spec[:120]!r} is not UTF-8 text") from None
    tok = from_json(text, spec.spec)
    special = file_special_tokens(text, tok, path.parent)
    eos = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
    out = FileTokenizer(tok, kind="file", spec=spec.spec, eos_id=eos)
    # the file is stored as it is (its sha256 is the user's file's), not re-serialized
    out._json, out.sha256, out.special = text, hashlib.sha256(raw).hexdigest(), special
    return out


def train_bpe(texts: Iterable[str], vocab: int) -> FileTokenizer:
    """A byte-level BPE of at most ``vocab`` ids trained on ``texts`` (streamed: the
    trainer keeps word counts, not the text). Deterministic: the same texts give the same
    ``tokenizer.json`` in every process."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # type: ignore[call-arg]
        vocab_size=vocab,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos = tok.token_to_id(EOS_TOKEN)
    return FileTokenizer(tok, kind="bpe", spec=f"bpe:{vocab}", eos_id=eos)


def load(spec: TokenizerSpec | str, texts: Callable[[], Iterable[str]] | None = None) -> Tokenizer:
    """The tokenizer a spec names; ``bpe:N`` trains on ``texts()`` (required for it)."""
    s = parse_spec(spec) if isinstance(spec, str) else spec
    if s.kind == BYTES:
        return ByteTokenizer()
    if s.kind == "file":
        return load_file(s)
    if texts is None:
        raise TokenizerError(f"tokenizer {s.spec}: training a BPE needs the corpus text")
    return train_bpe(texts(), s.vocab)


# --------------------------------------------------------------------------- manifests


def record_of(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest["tokenizer"]``; a manifest from before tokenizers (``"tokenizer":
    "bytes"`` or none) is byte tokens."""
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict):
        return tok
    return ByteTokenizer().record()


def vocab_size_of(manifest: dict[str, Any]) -> int:
    """The number of token ids of a prepared text dataset (the model's minimum vocabulary)."""
    tok = manifest.get("tokenizer")
    if isinstance(tok, dict) and isinstance(tok.get("vocab_size"), int):
        return int(tok["vocab_size"])
    vocab = manifest.get("vocab_size")
    return int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else 256


def dtype_of(manifest: dict[str, Any]) -> np.dtype[Any]:
    """The storage dtype of a prepared text dataset's ``tokens.bin`` (uint8 before tokenizers)."""
    return np.dtype(str(manifest.get("token_dtype", "uint8")))


def label(record: dict[str, Any]) -> str:
    """A tokenizer record in words, for messages: ``bytes (256 ids)``, ``bpe:512 (512 ids,
    sha256 1a2b3c4d5e6f)``."""
    kind = record.get("kind", BYTES)
    if kind == BYTES:
        return "bytes (256 ids)"
    name = record.get("spec") if kind == "bpe" else f"the tokenizer file {record.get('spec')!r}"
    sha = str(record.get("sha256") or "")[:12]
    return f"{name} ({record.get('vocab_size')} ids, sha256 {sha})"


def matches(record: dict[str, Any], spec: str) -> bool:
    """Whether data prepared with the tokenizer ``record`` was prepared with ``spec`` (a
    tokenizer file: the same bytes as the one prepared with)."""
    try:
        s = parse_spec(spec)
    except TokenizerError:
        return False
    kind = record.get("kind", BYTES)
    if s.kind != kind:
        return False
    if s.kind == "bpe":
        return bool(record.get("spec") == s.spec)
    if s.kind == "file":
        assert s.path is not None
        try:
            return hashlib.sha256(s.path.read_bytes()).hexdigest() == record.get("sha256")
        except OSError:
            return False
    return True


def same_record(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two tokenizer records name the same tokenizer (kind, vocabulary and file bytes)."""
    return all(a.get(k) == b.get(k) for k in ("kind", "vocab_size", "sha256"))


def identity_part(manifest: dict[str, Any]) -> str:
    """What the tokenizer adds to a dataset's identity: nothing for byte tokens (datasets
    from before tokenizers keep their identity), else kind, vocabulary and sha256."""
    tok = record_of(manifest)
    if tok.get("kind", BYTES) == BYTES:
        return ""
    return json.dumps(
        {k: tok.get(k) for k in ("kind", "spec", "vocab_size", "sha256")}, sort_keys=True
    )


def _byte_symbols() -> list[str]:
    """GPT-2's byte → printable character table (Radford et al. 2019, ``bytes_to_unicode``
    of the released encoder), the alphabet of the ``tokenizers`` ByteLevel pre-tokenizer:
    printable Latin-1 bytes map to themselves, the rest to U+0100 onwards in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def bytes_tokenizer_json() -> str:
    """A ``tokenizer.json`` whose ids are the UTF-8 byte values: a byte-level BPE without
    merges over the 256 byte symbols, id ``b`` for byte ``b``."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the tokenizers library's byte alphabet is not GPT-2's")
    tok = HFTok(models.BPE(vocab={s: b for b, s in enumerate(symbols)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return str(tok.to_str())


def special_tokens(record: dict[str, Any], tokenizer_json: str) -> dict[str, Any]:
    """The special tokens of the tokenizer a manifest ``record`` describes (``tokenizer_json``
    its file): those recorded for a tokenizer file, else its end-of-document token."""
    recorded = record.get("special_tokens")
    if isinstance(recorded, dict):
        return dict(recorded)
    eos = record.get("eos_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        name = from_json(tokenizer_json, "tokenizer.json").id_to_token(eos)
        if name is not None:
            return {"eos_token": name}
    return {}


def dataset_tokenizer(data_dir: Path, manifest: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(tokenizer.json text, special tokens)`` of a prepared directory: for ``bytes`` one
    whose ids are the byte values; else the stored file, checked against the sha256 in the
    manifest (:class:`rootopt.data.ShardError` when it differs or cannot be read)."""
    from rootopt.data.shards import ShardError

    tok = record_of(manifest)
    if tok.get("kind", BYTES) == BYTES:
        return bytes_tokenizer_json(), {}
    path = Path(data_dir) / str(tok.get("file") or FILE_NAME)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ShardError(
            f"{str(path)!r}: the dataset's tokenizer cannot be read ({exc.strerror or exc})"
        ) from None
    if hashlib.sha256(raw).hexdigest() != tok.get("sha256"):
        raise ShardError(
            f"{str(path)!r} does not match the sha256 in the manifest: the tokenizer was "
            "modified; prepare the data again"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardError(f"{str(path)!r} is not UTF-8 text") from None
    return text, special_tokens(tok, text)


def run_files(data_dir: Path, manifest: dict[str, Any]) -> dict[str, bytes]:
    """What a run keeps of its data's tokenizer (``tokenizer/`` of the run directory, which
    ``rootopt export`` reads): the ``tokenizer.json`` byte for byte and, when it has special
    tokens, ``special_tokens_map.json`` naming them. Written at every start of a run, so it
    needs the ``tokenizers`` library only, not ``transformers``."""
    text, special = dataset_tokenizer(data_dir, manifest)
    files = {FILE_NAME: text.encode("utf-8")}
    if special:
        files[MAP_FILE] = _json_bytes(special)
    return files


def transformers_files(tokenizer_json: str, special: dict[str, Any]) -> dict[str, bytes]:
    """The files ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads a tokenizer from,
    offline, in transformers 4.57 to 5.x alike: what ``PreTrainedTokenizerFast.save_pretrained``
    writes for it (the special tokens ``special``, ``model_input_names`` :data:`MODEL_INPUT_NAMES`,
    no clean-up of spaces: ``decode(encode(text)) == text``), with ``tokenizer.json`` the
    given file byte for byte and ``special_tokens_map.json`` when it has special tokens.

    Two keys of 5.x's ``tokenizer_config.json`` that 4.x cannot read are written as 4.x
    writes them, which 5.x reads the same: ``tokenizer_class`` ``PreTrainedTokenizerFast``
    (5.x writes ``TokenizersBackend``, a class 4.x does not have; 5.x loads the former as
    the latter) and the list of other special tokens under ``additional_special_tokens``
    (5.x writes a list ``extra_special_tokens``, which 4.x reads as a mapping and fails on;
    5.x renames the former to the latter when it loads). A role of :data:`NAMED` the
    tokenizer does not have is written as null."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    tok = from_json(tokenizer_json, FILE_NAME)
    vocab = tok.get_vocab(with_added_tokens=True)
    names = [special.get(r) for r in ROLES] + list(special.get(EXTRA) or [])
    unknown = [n for n in names if n is not None and n not in vocab]
    if unknown:  # save_pretrained would add it as a new id the model does not have
        raise TokenizerError(f"special token {unknown[0]!r} is not in the tokenizer's vocabulary")
    kwargs = {r: special[r] for r in ROLES if special.get(r) is not None}
    if special.get(EXTRA):
        kwargs[EXTRA] = list(special[EXTRA])
    hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        model_input_names=list(MODEL_INPUT_NAMES),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        files = {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}
    config = json.loads(files[CONFIG_FILE])
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for role in NAMED:  # "none": a class with defaults of its own (Qwen2's) must not add one
        config.setdefault(role, None)
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list) and extra:
        config[EXTRA] = extra
    elif isinstance(extra, dict) and extra:  # named extra tokens: a mapping in both versions
        config["extra_special_tokens"] = extra
    files[CONFIG_FILE] = _json_bytes(dict(sorted(config.items())))
    files[FILE_NAME] = tokenizer_json.encode("utf-8")
    if special:
        files[MAP_FILE] = _json_bytes(special)
    else:
        files.pop(MAP_FILE, None)
    return files


def hf_files(data_dir: Path, manifest: dict[str, Any]) -> dict[str, bytes]:
    """The files ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads this dataset's
    tokenizer from, offline (:func:`transformers_files`; for ``bytes`` a ``tokenizer.json``
    whose ids are the byte values). The stored ``tokenizer.json`` is checked against its
    sha256 in the manifest."""
    return transformers_files(*dataset_tokenizer(data_dir, manifest))


def counts_bytes(manifest: dict[str, Any], split: str) -> bool:
    """Every shard of ``split`` records the UTF-8 bytes of its text (``text_bytes``):
    ``rootopt data prepare`` checked that the tokenizer's ids add up to the text's bytes.
    Byte tokens always do (one id, one byte), also in manifests from before the count."""
    if record_of(manifest).get("kind", BYTES) == BYTES:
        return True
    entries = manifest.get("splits", {}).get(split) or []
    return bool(entries) and all(
        isinstance(e.get("text_bytes"), int) and not isinstance(e.get("text_bytes"), bool)
        for e in entries
    )


def byte_lengths_of(data_dir: Path, manifest: dict[str, Any], split: str) -> np.ndarray | None:
    """The UTF-8 bytes each id of a prepared text dataset stands for
    (:meth:`Tokenizer.byte_lengths`), for bits per byte on ``split``; None when its shards
    do not record their bytes (:func:`counts_bytes`: another tokenizer, or prepared before
    the count)."""
    if manifest.get("task") != "lm" or not counts_bytes(manifest, split):
        return None
    tok = record_of(manifest)
    if tok.get("kind", BYTES) == BYTES:
        return ByteTokenizer().byte_lengths()
    text, _ = dataset_tokenizer(data_dir, manifest)  # read and checked against its sha256
    where = str(Path(data_dir) / FILE_NAME)
    eos = tok.get("eos_id")
    loaded = FileTokenizer(
        from_json(text, where),
        kind="file",
        spec=where,
        eos_id=eos if isinstance(eos, int) and not isinstance(eos, bool) else None,
    )
    return loaded.byte_lengths()


def _json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=1) + "\n").encode("utf-8")
