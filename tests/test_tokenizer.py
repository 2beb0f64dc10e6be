"""Tokenizers: specs, byte ids, BPE training, tokenizer files, manifests, transformers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from rootopt.data import ShardStream, data_identity, load_manifest, prepare
from rootopt.data import tokenizer as T
from rootopt.data.corpora import Piece

TEXT = "héllo wörld\n\n€ ok  \t x\r\n<|endoftext|> done. ünïcödé 🙂"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "d"
    prepare("kjv", out, seq_len=32, max_bytes=200_000, samples_per_shard=300, tokenizer="bpe:600")
    return out


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bpe:100", r"N must be in \[257, 1048576\].*got 100"),
        ("bpe:256", r"N must be in \[257, 1048576\].*got 256"),
        ("bpe:2000000", r"N must be in \[257, 1048576\].*got 2000000"),
        ("bpe:many", "expected bpe:N with an integer"),
        ("", "expected bytes, bpe:N or the path"),
        ("no/such/tokenizer.json", "no such file"),
        ("/dev/null", "is not a regular file"),
    ],
)
def test_bad_specs_are_one_line(spec: str, message: str) -> None:
    with pytest.raises(T.TokenizerError, match=message) as info:
        T.parse_spec(spec)
    assert "\n" not in str(info.value)


def test_specs(tmp_path: Path) -> None:
    assert T.parse_spec("bytes") == T.TokenizerSpec("bytes", "bytes")
    assert T.parse_spec(" BPE:512 ") == T.TokenizerSpec("bpe", "bpe:512", vocab=512)
    (tmp_path / "tokenizer.json").write_text("{}")
    by_dir = T.parse_spec(str(tmp_path))
    assert by_dir.kind == "file" and by_dir.path == tmp_path / "tokenizer.json"


def test_token_dtype_is_the_narrowest() -> None:
    assert [T.token_dtype(v).name for v in (2, 256, 257, 65536, 65537, 1 << 20)] == [
        "uint8",
        "uint8",
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]


# --------------------------------------------------------------------------- byte tokens


def test_bytes_are_their_own_ids() -> None:
    tok = T.load("bytes")
    assert tok.vocab_size == 256 and tok.eos_id is None and tok.dtype == np.uint8
    assert tok.encode_batch([TEXT, ""]) == [list(TEXT.encode()), []]
    packed = tok.pack([Piece(b"ab"), Piece(b"c\xff", b"\n\n"), Piece(b"d", b"\n")])
    assert packed.tobytes() == b"abc\xff\n\nd\n"  # raw bytes kept, blank line between documents


def test_byte_symbols_are_gpt2s() -> None:
    """Our byte → symbol table is the one transformers and tokenizers use."""
    from tokenizers import pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ref = bytes_to_unicode()
    assert T._byte_symbols() == [ref[b] for b in range(256)]
    assert set(T._byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())


# --------------------------------------------------------------------------- BPE


def test_bpe_trains_deterministically_and_encodes() -> None:
    texts = [Path(__file__).read_text(), Path(T.__file__).read_text()] * 3
    a, b = T.train_bpe(iter(texts), 400), T.train_bpe(iter(texts), 400)
    assert a.to_json() == b.to_json() and a.sha256 == b.sha256
    assert a.vocab_size == 400 and a.eos_id == 0 and a.dtype == np.uint16
    ids = a.encode_batch(["def test(x):\n    return x"])[0]
    assert len(ids) < len("def test(x):\n    return x") and max(ids) < 400
    assert a.tok.decode(ids) == "def test(x):\n    return x"
    packed = a.pack([Piece(b"def f", b"\n\n"), Piece(b"x = 1")])
    first = a.encode_batch(["def f"])[0]
    assert packed.tolist() == [*first, 0, *a.encode_batch(["x = 1"])[0]]  # EOS after a document
    assert packed.dtype == np.uint16


def test_bpe_vocabulary_is_capped_by_the_corpus() -> None:
    tok = T.train_bpe(iter(["ab ab ab"]), 5000)
    assert 257 <= tok.vocab_size < 5000
    assert tok.record()["vocab_size"] == tok.vocab_size


def test_bpe_dataset_records_its_tokenizer(bpe_dir: Path) -> None:
    m = load_manifest(bpe_dir)
    tok = m["tokenizer"]
    raw = (bpe_dir / "tokenizer.json").read_bytes()
    assert tok == {
        "kind": "bpe",
        "spec": "bpe:600",
        "vocab_size": 600,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "file": "tokenizer.json",
        "eos_id": 0,
    }
    assert m["token_dtype"] == "uint16" and T.vocab_size_of(m) == 600 == m["vocab_size"]
    assert f"{tok['sha256']}  tokenizer.json" in (bpe_dir / "SHA256SUMS").read_text()
    batch = next(iter(ShardStream(bpe_dir, batch_size=4, shuffle=False)))
    assert batch["input"].shape == (4, 32) and int(batch["input"].max()) < 600
    assert int(batch["input"].max()) > 255  # merged tokens, read back as uint16
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(bpe_dir / "tokenizer.json")).decode(batch["input"][0].tolist())
    assert text.count(" ") > 5 and text.isascii()  # real KJV text


# --------------------------------------------------------------------------- tokenizer files


def test_a_tokenizer_file_is_used_as_it_is(bpe_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "tok" / "tokenizer.json"
    src.parent.mkdir()
    src.write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    m = prepare(
        "kjv",
        tmp_path / "d",
        seq_len=32,
        max_bytes=200_000,
        samples_per_shard=300,
        tokenizer=str(src),
    )
    tok = m["tokenizer"]
    assert tok["kind"] == "file" and tok["spec"] == str(src) and tok["eos_id"] == 0
    assert tok["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (tmp_path / "d" / "tokenizer.json").read_bytes() == src.read_bytes()
    same = load_manifest(bpe_dir)
    # the same tokenizer and corpus: the same token ids, in the same shards
    assert [e["content"] for e in m["splits"]["train"]] == [
        e["content"] for e in same["splits"]["train"]
    ]
    assert data_identity(m) != data_identity(same)  # the spec differs (file vs bpe:600)


def test_eos_from_a_tokenizer_config_beside_the_file(bpe_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ġthe"}}))
    tok = T.load(str(d))
    assert tok.eos_id is not None and tok.eos_id == tok.tok.token_to_id("Ġthe")


def test_special_tokens_of_a_tokenizer_file_are_recorded(bpe_dir: Path, tmp_path: Path) -> None:
    """The roles a special_tokens_map.json beside the file names (each in the vocabulary:
    an unknown one is dropped), then what the file defines: its padding token, an
    end-of-document token by name, the other added tokens marked special."""
    from tokenizers import Tokenizer

    d = tmp_path / "model"
    d.mkdir()
    tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    tok.add_special_tokens(["<pad>", "<|im_start|>"])
    tok.enable_padding(pad_id=tok.token_to_id("<pad>"), pad_token="<pad>")
    tok.save(str(d / "tokenizer.json"))
    (d / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "Ġthe", "unk_token": "<not-in-the-vocabulary>"})
    )
    loaded = T.load(str(d))
    want = {
        "bos_token": "Ġthe",
        "pad_token": "<pad>",
        "eos_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>"],
    }
    assert loaded.special == want and loaded.record()["special_tokens"] == want
    assert loaded.eos_id == 0
    assert "special_tokens" not in load_manifest(bpe_dir)["tokenizer"]  # bpe:N: eos alone


def test_a_file_without_an_end_token_separates_documents_by_a_blank_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(T.bytes_tokenizer_json())
    tok = T.load(str(path))
    assert tok.eos_id is None and tok.vocab_size == 256 and tok.dtype == np.uint8
    assert tok.pack([Piece(b"a", b"\n\n"), Piece("é".encode())]).tobytes() == "a\n\né".encode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "is not a tokenizers JSON file"),
        (b'{"version": "1.0"}', "is not a tokenizers JSON file"),
        (b"\xff\xfe", "is not UTF-8 text"),
    ],
)
def test_a_file_that_does_not_parse_is_one_line(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(T.TokenizerError, match=message) as info:
        T.load(str(path))
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


# --------------------------------------------------------------------------- manifests


def test_old_manifests_are_byte_tokens() -> None:
    old = {"task": "lm", "tokenizer": "bytes", "vocab_size": 256, "splits": {}}
    assert T.vocab_size_of(old) == 256 and T.dtype_of(old) == np.uint8
    assert T.record_of(old)["kind"] == "bytes" and T.identity_part(old) == ""
    assert T.vocab_size_of({"task": "lm", "splits": {}}) == 256


def test_identity_names_a_tokenizer_other_than_bytes(bpe_dir: Path) -> None:
    from rootopt.data import identity_tokenizer

    m = load_manifest(bpe_dir)
    ident = data_identity(m)
    rec = identity_tokenizer(ident)
    assert rec["kind"] == "bpe" and rec["vocab_size"] == 600
    assert rec["sha256"] == m["tokenizer"]["sha256"]
    bare = {**m, "tokenizer": T.ByteTokenizer().record()}
    assert data_identity(bare) == ident.split("+tokenizer:")[0]
    assert identity_tokenizer(data_identity(bare))["kind"] == "bytes"


# --------------------------------------------------------------------------- transformers


def _save(files: dict[str, bytes], d: Path) -> Path:
    d.mkdir()
    for name, blob in files.items():
        (d / name).write_bytes(blob)
    return d


def test_hf_files_for_bytes_give_the_byte_ids_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    m = prepare("kjv", tmp_path / "d", seq_len=16, max_bytes=20_000, samples_per_shard=100)
    files = T.hf_files(tmp_path / "d", m)
    assert sorted(files) == ["tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(str(_save(files, tmp_path / "hf")))
    assert hf(TEXT).input_ids == list(TEXT.encode("utf-8"))
    assert hf.decode(list(TEXT.encode("utf-8"))) == TEXT
    assert len(hf) == 256
    batch = next(iter(ShardStream(tmp_path / "d", batch_size=1, shuffle=False)))
    ids = batch["input"][0].tolist()
    assert hf(hf.decode(ids)).input_ids == ids  # the shards' ids, through transformers


def test_hf_files_for_bpe_match_the_shards(bpe_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    m = load_manifest(bpe_dir)
    files = T.hf_files(bpe_dir, m)
    assert sorted(files) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(str(_save(files, tmp_path / "hf")))
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 0 and len(hf) == 600
    ours = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    text = "In the beginning God created the heaven and the earth."
    assert hf(text).input_ids == ours.encode(text).ids
    assert hf.decode(hf(text).input_ids) == text


def test_hf_files_refuse_a_modified_tokenizer(bpe_dir: Path, tmp_path: Path) -> None:
    from rootopt.data import ShardError

    d = tmp_path / "d"
    d.mkdir()
    for f in bpe_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes().replace(b"G", b"g"))
    with pytest.raises(ShardError, match="does not match the sha256 in the manifest"):
        T.hf_files(d, load_manifest(d))
