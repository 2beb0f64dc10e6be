"""``val_bits_per_byte`` is bits per UTF-8 byte of the text (lm-evaluation-harness's
``bits_per_byte``) for every tokenizer, not bits per token: the manifest counts each shard's
bytes, the evaluation counts the bytes of the tokens it scores, and every sink and
``rootopt report`` show the same number (docs/monitoring.md, "Metrics")."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _train_fixtures import TINY, PrometheusScraper, prepare_tiny, quiet
from rootopt.config import load_config
from rootopt.data import ShardStream, load_manifest, prepare
from rootopt.data.corpora import Piece
from rootopt.data.tokenizer import byte_lengths_of, load, train_bpe
from rootopt.monitor import read_jsonl
from rootopt.monitor.report import check_run
from rootopt.train import Hooks, train

BPE = "bpe:512"


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 KB of the KJV (ASCII text) tokenized by a BPE of 512 ids trained on it."""
    return prepare_tiny(tmp_path_factory.mktemp("bpb") / "d", BPE)


def _decoder(data: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(data / "tokenizer.json"))


def _text_bytes(tok: Any, ids: np.ndarray) -> int:
    """The bytes of the text ``ids`` encode, by the library's own decoder (the corpus is
    ASCII, so no token holds part of a character and no byte is replaced)."""
    text = tok.decode([int(i) for i in ids], skip_special_tokens=True)
    assert text.isascii(), text
    return len(text.encode("utf-8"))


def test_prepare_counts_the_bytes_of_each_shard(bpe_data: Path) -> None:
    """Each shard's ``text_bytes`` is the bytes of the text its samples' tokens encode."""
    manifest = load_manifest(bpe_data)
    tok = _decoder(bpe_data)
    dtype = np.dtype(manifest["token_dtype"])
    for split in ("train", "val"):
        for entry in manifest["splits"][split]:
            with tarfile.open(bpe_data / entry["name"]) as tar:
                blocks = [
                    np.frombuffer(tar.extractfile(m).read(), dtype)  # type: ignore[union-attr]
                    for m in tar.getmembers()
                    if m.name.endswith(".tokens.bin")
                ]
            assert len(blocks) == entry["samples"]
            assert entry["text_bytes"] == sum(_text_bytes(tok, b) for b in blocks)


def test_bpe_run_logs_bits_per_byte_of_the_text_it_scores(bpe_data: Path, tmp_path: Path) -> None:
    """The logged value equals a hand computation: the validation loss (nats per token)
    times the tokens it scored, over ln 2 times the UTF-8 bytes those tokens decode to. It
    is about half of ``val_loss / ln 2`` (bits per token, what was logged before) at this
    BPE's 2.2 bytes per token; TensorBoard, Prometheus and ``rootopt report`` show the
    same number."""
    over = [
        *TINY,
        "model.vocab_size=512",
        "run.max_steps=10",
        "run.eval_every=5",
        "monitoring.tensorboard=true",
        "monitoring.prometheus.enabled=true",
        "monitoring.prometheus.port=0",
    ]
    cfg = load_config(None, over)
    with PrometheusScraper(at=8) as prom:  # after the step-5 evaluation
        train(
            cfg, tmp_path / "run", str(bpe_data), say=quiet, hooks=Hooks(after_step=prom.after_step)
        )
    scraped = prom.pages
    val = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [5, 10]

    # by hand: the targets of the batches the evaluation read, decoded by the library
    tok = _decoder(bpe_data)
    stream = ShardStream(bpe_data, "val", batch_size=8, seq_len=32, loop=False)
    tokens = nbytes = 0
    for i, batch in enumerate(stream):
        if i == cfg.run.eval_batches:
            break
        for row in batch["target"].numpy():
            tokens += row.size
            nbytes += _text_bytes(tok, row)
    assert tokens == 2 * 8 * 32 and 2.0 < nbytes / tokens < 2.6
    for r in val:
        by_hand = r["val_loss"] * tokens / (math.log(2) * nbytes)
        assert r["val_bits_per_byte"] == pytest.approx(by_hand, rel=1e-12)
        assert r["val_bits_per_byte"] < 0.5 * r["val_loss"] / math.log(2)

    first, last = val[0]["val_bits_per_byte"], val[-1]["val_bits_per_byte"]
    assert f"rootopt_val_bits_per_byte {first!r}" in scraped[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    tb = {e.step: e.value for e in acc.Scalars("val/val_bits_per_byte")}
    assert tb == {5: pytest.approx(first, rel=1e-6), 10: pytest.approx(last, rel=1e-6)}
    crit = next(c for c in check_run(tmp_path / "run").criteria if c.name.startswith("valid"))
    assert f"bits per byte {first:.4f} → {last:.4f}" in crit.evidence


def test_byte_lengths_add_up_to_the_utf8_bytes_of_any_text() -> None:
    """A byte-level BPE's ids stand for fixed bytes, multi-byte characters included (a
    token may hold part of one); the end-of-document id for none."""
    docs = ["Grüße aus Köln — 日本語のテキスト, naïve café. ", "plain ascii words " * 20]
    tok = train_bpe(docs * 20, 320)
    lengths = tok.byte_lengths()
    assert lengths is not None and lengths[tok.eos_id] == 0
    pieces = [Piece(d.encode(), b"\n\n") for d in docs]
    ids = tok.pack(pieces)
    assert (ids == tok.eos_id).sum() == 2
    want = sum(len(d.encode("utf-8")) for d in docs)
    assert int(lengths[ids].sum()) == tok.text_bytes(pieces) == want
    assert load("bytes").byte_lengths().tolist() == [1] * 256  # type: ignore[union-attr]


def test_a_tokenizer_whose_ids_are_not_fixed_bytes_records_no_count(tmp_path: Path) -> None:
    """A WordPiece tokenizer drops the spaces between words: its ids do not add up to the
    text's bytes, so the manifest counts none and a run on it logs no bits per byte (never
    an estimate); a run on byte tokens prepared before the count still logs it (one id,
    one byte)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))  # type: ignore[call-arg]
    wp.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"])  # type: ignore[call-arg]
    wp.train([str(corpus)], trainer)
    wp.save(str(tmp_path / "wp.json"))
    m = prepare(corpus, tmp_path / "d", seq_len=16, tokenizer=str(tmp_path / "wp.json"))
    assert not any("text_bytes" in e for s in m["splits"].values() for e in s)
    assert byte_lengths_of(tmp_path / "d", m, "val") is None

    old = prepare(corpus, tmp_path / "b", seq_len=16)
    for s in old["splits"].values():
        for e in s:
            del e["text_bytes"]
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(old))
    got = byte_lengths_of(tmp_path / "b", load_manifest(tmp_path / "b"), "val")
    assert got is not None and got.tolist() == [1] * 256


def test_a_literal_special_token_in_the_text_turns_the_count_off(tmp_path: Path) -> None:
    """The text spells ``<|endoftext|>``, which the BPE encodes as its end-of-document id
    (0 bytes): that batch's ids fall 13 bytes short of its text, and the dataset records
    no byte count rather than a wrong one. Without it the same corpus is counted."""
    words = "in the beginning was the word and the word was with god "
    for name, extra in (("plain", ""), ("literal", "see <|endoftext|> here ")):
        corpus = tmp_path / f"{name}.txt"
        corpus.write_text((words * 30 + extra + words * 30 + "\n") * 20)
        m = prepare(str(corpus), tmp_path / name, seq_len=16, tokenizer="bpe:300")
        counted = [("text_bytes" in e) for s in m["splits"].values() for e in s]
        assert counted and all(counted) == (name == "plain") and any(counted) == all(counted)
