"""Preparing data: streaming equals the in-memory reference, own text (files, directories,
.jsonl), bounded memory, bad input, kills, and `rootopt train` preparing into its run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from _faultkit import env, tree_state
from _train_fixtures import FAST
from _train_fixtures import quiet as _quiet
from rootopt.commands.data import main as data_main
from rootopt.config import load_config
from rootopt.data import (
    STAGING,
    Settings,
    ShardError,
    ShardStream,
    corpora,
    data_identity,
    load_manifest,
    plan,
    prepare,
    preparing,
    text_bytes,
    validate_data,
)
from rootopt.data import tokenizer as T
from rootopt.train import train
from rootopt.train.main import main as train_main

# The identity of `prepare("kjv", seq_len=32, max_bytes=150_000, samples_per_shard=400)`
# computed by the code before tokenizers existed: checkpoints trained on it must resume.
KJV_TINY = "content:f2d3e6519c332c22e0a96aec9756460909af8097076d25c98a69372d80bdafb0"


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """``tree_state`` that does not open a FIFO (which would block)."""
    out: dict[str, tuple[Any, ...]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        blob = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, blob)
    return out


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and len(err[0]) < 600
    return err[0]


# --------------------------------------------------------------------------- byte tokens


def test_kjv_identity_is_the_one_before_tokenizers(tmp_path: Path) -> None:
    m = prepare("kjv", tmp_path / "d", seq_len=32, max_bytes=150_000, samples_per_shard=400)
    assert data_identity(m) == KJV_TINY
    assert m["tokenizer"]["kind"] == "bytes" and m["token_dtype"] == "uint8"


@pytest.mark.parametrize(
    "settings",
    [
        Settings("stdlib"),  # the embedded default's data
        Settings("kjv", seq_len=16, max_bytes=50_001, samples_per_shard=77, val_fraction=0.2),
        Settings("bbc", seq_len=64, max_bytes=300_000, samples_per_shard=500, val_fraction=0),
    ],
    ids=["default", "kjv", "bbc"],
)
def test_streaming_gives_the_reference_shards(tmp_path: Path, settings: Settings) -> None:
    """Byte tokens prepared streaming (bounded memory) are the shards the in-memory
    reference cuts: names, sample counts, contents, file bytes."""
    from rootopt.data.shards import write_shard

    s = settings
    ref = plan(
        s.corpus,
        seq_len=s.seq_len,
        max_bytes=s.max_bytes,
        samples_per_shard=s.samples_per_shard,
        val_fraction=s.val_fraction,
        seed=s.seed,
    )
    got = preparing.prepare(s, tmp_path / "d")
    assert data_identity(got) == ref.identity
    want = [
        (e["name"], e["samples"], e["content"]) for v in ref.manifest["splits"].values() for e in v
    ]
    have = [(e["name"], e["samples"], e["content"]) for v in got["splits"].values() for e in v]
    assert len(have) == len(want) >= 2 and have == want
    name = want[0][0]
    write_shard(tmp_path / name, "train", 0, ref.shards[name])
    assert (tmp_path / name).read_bytes() == (tmp_path / "d" / name).read_bytes()
    for key in ("task", "corpus", "seq_len", "text_bytes", "max_bytes", "vocab_size", "seed"):
        assert got[key] == ref.manifest[key], key


def test_the_default_config_prepares_the_reference_data() -> None:
    from rootopt.train.preflight import settings_of

    assert settings_of(load_config(None)) == Settings("stdlib")


def test_a_default_run_keeps_its_run_directory() -> None:
    """The default command still finds the run directory an earlier version named (value
    computed by the code before tokenizers, the identity key and checkpoint.every=100): the
    new data keys at their defaults and the changed checkpoint interval do not move it. The
    change of the default Newton–Schulz coefficients and CPU iteration dtype (CHANGELOG.md)
    does: a run trained with the earlier ones (float32 iterations on the CPU) is found again
    when the config names them, never resumed with others."""
    from rootopt.optim._options import ns_dtype_name
    from rootopt.train.run.directory import identity_key, legacy_identity_key

    then = ["optimization.ns_coefficients=muon", "optimization.ns_dtype=float32"]
    assert legacy_identity_key(load_config(None, then), None) == "70ef8a9a"
    assert legacy_identity_key(load_config(None, then[:1]), None) != "70ef8a9a"
    # "auto" names that run where it resolves to float32 (a CPU without bf16 units), and
    # another where it resolves to bfloat16
    auto = legacy_identity_key(load_config(None, [then[0], "optimization.ns_dtype=auto"]), None)
    assert (auto == "70ef8a9a") == (ns_dtype_name("auto", torch.device("cpu")) == "float32")
    assert legacy_identity_key(load_config(None), None) != "70ef8a9a"
    assert legacy_identity_key(load_config(None, ["data.tokenizer=bpe:300"]), None) != "70ef8a9a"
    assert identity_key(load_config(None), None) != identity_key(
        load_config(None, ["data.tokenizer=bpe:300"]), None
    )


# --------------------------------------------------------------------------- own text


def test_jsonl_documents(tmp_path: Path) -> None:
    docs = ["first document", "", "the third, ünïcode 🙂", "a line of text\n" * 6000]
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    got = b"".join(
        p.data + p.sep for p in corpora.pieces(str(path), max_bytes=0, text_field="body")
    )
    assert got == b"".join(d.encode() + b"\n\n" for d in docs)
    tok = T.train_bpe(iter(docs * 3), 300)
    (tmp_path / "tok.json").write_text(tok.to_json())
    m = prepare(
        str(path),
        tmp_path / "d",
        seq_len=8,
        max_bytes=0,
        samples_per_shard=50,
        tokenizer=str(tmp_path / "tok.json"),
        text_field="body",
    )
    assert m["corpus"] == "c.jsonl" and m["text_field"] == "body"
    assert m["tokens"] == sum(len(tok.encode_batch([d])[0]) + 1 for d in docs)  # + EOS each


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ok"}\n{"body": "no text"}\n', r"c\.jsonl', line 2: no 'text' field"),
        ('{"text": "ok"}\n\n{"text": 3}\n', r"line 3: the 'text' field is int, not a string"),
        ('{"text": "ok"}\n{"text": \n', r"line 2: not a JSON object"),
        ('["text"]\n', r"line 1: no 'text' field"),
    ],
)
def test_a_bad_jsonl_line_is_one_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(line)
    for tok in ("bytes", "bpe:300"):
        out = tmp_path / f"out-{tok[:3]}"
        args = ["prepare", "--corpus", str(corpus), "--out", str(out), "--tokenizer", tok]
        assert data_main(args) == 2
        line = _one_line(capsys)
        assert re.search(message, line), line
        assert not out.exists()


def test_a_directory_is_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b" / "deep").mkdir(parents=True)
    (root / "a.txt").write_text("alpha")
    (root / "b" / "deep" / "z.md").write_text("zulu")
    (root / "b" / "c.jsonl").write_text('{"text": "charlie"}\n{"text": "delta"}\n')
    (root / "b" / "image.png").write_bytes(b"\x89PNG not text")
    (root / "b" / "notes.TXT").write_text("echo")
    # sorted by path: a.txt, b/c.jsonl, b/deep/z.md, b/notes.TXT
    assert text_bytes(str(root), max_bytes=0) == b"alpha\n\ncharlie\n\ndelta\n\nzulu\n\necho\n\n"
    assert text_bytes(str(root), max_bytes=8) == b"alpha\n\nc"
    assert text_bytes(str(root), max_bytes=6) == b"alpha\n"  # cut inside a separator


def test_own_text_end_to_end_with_bpe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The documented path: a directory of text → rootopt data prepare --tokenizer bpe:N."""
    root = tmp_path / "notes"
    root.mkdir()
    for i, path in enumerate(sorted(Path(corpora.__file__).parent.glob("*.py"))):
        (root / f"{i:02d}.txt").write_bytes(path.read_bytes())
    out = tmp_path / "data"
    args = ["prepare", "--corpus", str(root), "--out", str(out), "--tokenizer", "bpe:400"]
    assert data_main([*args, "--seq_len", "64", "--samples_per_shard", "50"]) == 0
    said = capsys.readouterr().out
    assert "bpe:400 (400 ids" in said and "train samples" in said
    assert data_main(["verify", str(out)]) == 0
    m = load_manifest(out)
    assert m["tokenizer"]["vocab_size"] == 400 and m["token_dtype"] == "uint16"
    assert sorted(p.name for p in out.iterdir())[:3] == [
        "SHA256SUMS",
        "manifest.json",
        "tokenizer.json",
    ]
    batch = next(iter(ShardStream(out, batch_size=2)))
    assert batch["input"].shape == (2, 64) and int(batch["input"].max()) < 400


# --------------------------------------------------------------------------- bad input


def _fifo(d: Path) -> list[str]:
    os.mkfifo(d / "fifo")
    return ["--corpus", str(d / "fifo")]


def _empty(d: Path) -> list[str]:
    (d / "empty.txt").write_text("")
    return ["--corpus", str(d / "empty.txt")]


def _no_text(d: Path) -> list[str]:
    (d / "sub").mkdir()
    (d / "sub" / "photo.jpg").write_bytes(b"\xff\xd8")
    return ["--corpus", str(d / "sub")]


def _bad_file(d: Path) -> list[str]:
    (d / "t.json").write_text('{"model": {"type": "BPE"}}')
    return ["--corpus", "kjv", "--tokenizer", str(d / "t.json")]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_fifo, "is not a regular file or a directory"),
        (lambda d: ["--corpus", "/dev/null"], "'/dev/null' is not a regular file or a directory"),
        (_empty, "is empty (no text)"),
        (_no_text, "holds no text files"),
        (lambda d: ["--corpus", "kjv", "--tokenizer", "bpe:100"], "N must be in [257, 1048576]"),
        (lambda d: ["--corpus", "kjv", "--tokenizer", "bpe:99999999"], "got 99999999"),
        (_bad_file, "is not a tokenizers JSON file"),
        (lambda d: ["--corpus", "kjv", "--tokenizer", str(d / "no.json")], "no such file"),
        (lambda d: ["--corpus", "kjv", "--text-field", ""], "text_field: expected the name"),
        (lambda d: ["--corpus", "nope"], "unknown corpus 'nope'"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, message: str
) -> None:
    args = make(tmp_path)
    out = tmp_path / "out"
    before = _tree(tmp_path)
    assert data_main(["prepare", "--out", str(out), "--max_bytes", "20000", *args]) == 2
    line = _one_line(capsys)
    assert message in line, line
    assert not out.exists() and _tree(tmp_path) == before


def test_a_directory_that_is_not_ours_is_refused_before_reading(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / STAGING).mkdir(parents=True)
    (out / STAGING / "mine.txt").write_text("user file")  # no marker: not our staging
    with pytest.raises(ShardError, match="not empty"):
        prepare("kjv", out, max_bytes=20_000)
    assert (out / STAGING / "mine.txt").read_text() == "user file"


# --------------------------------------------------------------------------- bounded memory


def test_split_pieces_cut_where_tokenization_is_unchanged() -> None:
    rng = random.Random(0)
    words = ["alpha", "béta", "  indent", "\n", "x=1", "🙂", "\t", "\n\n", "end."]
    buf = "".join(rng.choice(words) for _ in range(120_000)).encode()
    out, rest = corpora.split_pieces(buf, final=True)
    assert rest == b"" and b"".join(out) == buf and len(out) > 5
    assert all(len(p) <= corpora.MAX_PIECE_BYTES for p in out)
    # each later piece starts with a space before a non-space character
    assert all(p[:1] == b" " and not p[1:2].isspace() for p in out[1:])
    one_line = "é" * 700_000  # 1.4 MB without a space: cut at a character boundary
    out, _ = corpora.split_pieces(one_line.encode(), final=True)
    assert len(out) == 2 and "".join(p.decode() for p in out) == one_line


def test_pieces_tokenize_like_the_whole_text() -> None:
    """Cutting a long document into pieces does not change a bpe:N tokenization."""
    text = "".join(p.read_text() for p in sorted(Path(corpora.__file__).parent.glob("*.py")))
    text = text * 3
    tok = T.train_bpe(iter([text]), 800)
    out, _ = corpora.split_pieces(text.encode(), final=True)
    assert len(out) >= 3
    whole = tok.encode_batch([text])[0]
    assert [i for row in tok.encode_batch([p.decode() for p in out]) for i in row] == whole


def test_preparing_holds_one_batch_and_one_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Structural: the corpus is read while tokens are written (not read whole first), a
    tokenizer call gets one batch, and the shard writer reads at most one shard of samples
    before writing it."""
    events: list[tuple[str, int]] = []
    real_pieces, real_write = corpora.pieces, preparing.shards.write_shard
    real_pack, real_pread = T.ByteTokenizer.pack, os.pread
    reads = [0]

    def pieces(*a: Any, **k: Any) -> Any:
        for p in real_pieces(*a, **k):
            events.append(("piece", len(p.data) + len(p.sep)))
            yield p

    def pack(self: Any, batch: Any) -> Any:
        events.append(("batch", sum(len(p.data) + len(p.sep) for p in batch)))
        return real_pack(self, batch)

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads[0] += 1
        return real_pread(fd, n, offset)

    def write_shard(path: Path, split: str, index: int, samples: list[Any]) -> str:
        events.append(("shard", reads[0]))
        assert reads[0] == len(samples) <= 40  # read since the last shard: this shard only
        reads[0] = 0
        return real_write(path, split, index, samples)

    monkeypatch.setattr(corpora, "pieces", pieces)
    monkeypatch.setattr(T.ByteTokenizer, "pack", pack)
    monkeypatch.setattr(preparing.os, "pread", pread)
    monkeypatch.setattr(preparing.shards, "write_shard", write_shard)
    monkeypatch.setattr(preparing, "BATCH_BYTES", 20_000)
    prepare("stdlib", tmp_path / "d", seq_len=64, max_bytes=200_000, samples_per_shard=40)
    kinds = [k for k, _ in events]
    assert kinds.index("batch") < len(kinds) - 1 - kinds[::-1].index("piece")  # interleaved
    batches = [n for k, n in events if k == "batch"]
    assert len(batches) >= 4 and max(batches) < 20_000 + corpora.MAX_PIECE_BYTES
    assert all(n <= corpora.MAX_PIECE_BYTES + 2 for k, n in events if k == "piece")
    assert kinds.count("shard") == sum(
        len(v) for v in load_manifest(tmp_path / "d")["splits"].values()
    )


# --------------------------------------------------------------------------- kills

# A prepare that SIGKILLs itself before its k-th write step (k < 0: never; it prints how
# many steps it took): token batches, shards, moves, atomic writes, discards.
VICTIM = r"""
import json, os, signal, sys
spec = json.loads(sys.argv[1])
from rootopt.data import preparing
from rootopt.commands.data import main
count = [0]
def counted(fn):
    def wrapper(*a, **k):
        count[0] += 1
        if count[0] == spec["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return wrapper
preparing._guard = counted(preparing._guard)
preparing.atomic_write = counted(preparing.atomic_write)
preparing.discard = counted(preparing.discard)
preparing.shutil.move = counted(preparing.shutil.move)
status = main(spec["argv"])
print(json.dumps({"steps": count[0]}))
sys.exit(status)
"""


def _victim(argv: list[str], kill_at: int) -> subprocess.CompletedProcess[str]:
    spec = json.dumps({"argv": argv, "kill_at": kill_at})
    return subprocess.run(
        [sys.executable, "-c", VICTIM, spec],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _no_torn_set(out: Path) -> None:
    """What a kill leaves is refused as incomplete, or is a complete, valid dataset."""
    try:
        load_manifest(out)
    except ShardError as exc:
        assert (
            "interrupted" in str(exc)
            or "holds no manifest.json" in str(exc)
            or ("does not exist" in str(exc))
        ), exc
        return
    validate_data(out, checksum=True)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_sigkill_at_random_points_then_rerun_gives_the_same_data(
    tmp_path: Path, tokenizer: str
) -> None:
    base = ["prepare", "--corpus", "kjv", "--seq_len", "32", "--max_bytes", "120000"]
    base += ["--samples_per_shard", "200", "--tokenizer", tokenizer]
    whole = tmp_path / "whole"
    done = _victim([*base, "--out", str(whole)], -1)
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    assert steps > 15  # batches, shards, moves, writes
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    out = tmp_path / "out"
    # the same directory killed at several points in turn (the old data of the previous
    # round is what a later round replaces), then a clean run
    points = [*sorted(rng.sample(range(1, steps + 1), 4)), steps]
    for k in points:
        r = _victim([*base, "--out", str(out)], k)
        assert r.returncode == -signal.SIGKILL, (seed, k, r.stderr)
        _no_torn_set(out)
    # a kill at a random moment in time, too
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            VICTIM,
            json.dumps({"argv": [*base, "--out", str(out)], "kill_at": -1}),
        ],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(rng.uniform(0.5, 3.0))
    proc.kill()
    proc.wait(timeout=60)
    _no_torn_set(out)
    r = _victim([*base, "--out", str(out)], -1)
    assert r.returncode == 0, (seed, r.stderr)
    assert _files(out) == _files(whole), seed
    assert not (out / STAGING).exists()


# --------------------------------------------------------------------------- rootopt train


TOK_RUN = [*FAST, "data.corpus=kjv", "data.max_bytes=120000", "run.max_steps=10"]


def test_train_prepares_a_bpe_corpus_and_refuses_another_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    over = [*TOK_RUN, "data.tokenizer=bpe:300", "model.vocab_size=300"]
    assert train_main(["--log_dir", str(run), *over]) == 0
    m = load_manifest(run / "data")
    assert m["tokenizer"]["spec"] == "bpe:300" and m["token_dtype"] == "uint16"
    assert (run / "data" / "tokenizer.json").is_file() and not (run / STAGING).exists()
    before = tree_state(run)
    capsys.readouterr()
    # the same run, asked to resume on byte tokens: one line naming both, nothing touched
    args = ["--log_dir", str(run), *TOK_RUN, "model.vocab_size=300", "run.max_steps=20"]
    assert train_main(args) == 2
    line = _one_line(capsys)
    assert "the tokenizer differs" in line and "'bpe:300'" in line and "'bytes'" in line, line
    assert {k: v for k, v in tree_state(run).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }
    # on data prepared elsewhere (--data_path): named by the data's identity
    other = tmp_path / "bytes"
    prepare("kjv", other, seq_len=32, max_bytes=120_000)
    args = ["--log_dir", str(run), "--data_path", str(other), *over, "run.max_steps=20"]
    assert train_main(args) == 2
    line = _one_line(capsys)
    assert "the tokenizer differs" in line and "bpe:300 (300 ids" in line, line
    assert "bytes (256 ids)" in line, line


def test_a_run_killed_while_preparing_is_taken_up_again(tmp_path: Path) -> None:
    """A launch killed while it staged its data leaves ``.rootopt-staging`` in a run
    directory without run.json: the next launch takes the directory and removes it."""
    run = tmp_path / "run"
    staged = preparing.stage(Settings("kjv", max_bytes=50_000), run / STAGING)
    assert preparing.is_staging(staged.dir)
    (run / ".lock").write_text("")
    s = train(load_config(None, [*TOK_RUN, "run.max_steps=3"]), run, None, say=_quiet)
    assert s.steps == 3 and not (run / STAGING).exists()
    # a directory of that name that is not ours keeps the run directory foreign
    other = tmp_path / "other"
    (other / STAGING).mkdir(parents=True)
    (other / STAGING / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="not a rootopt run directory"):
        train(load_config(None, [*TOK_RUN, "run.max_steps=3"]), other, None, say=_quiet)
    assert (other / STAGING / "keep.txt").read_text() == "mine"


def test_a_launch_refused_after_preparing_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    # the data's 300 ids do not fit the model's 256 (named: by default the model takes
    # the tokenizer's vocabulary): refused after the data was staged
    args = ["--log_dir", str(run), *TOK_RUN, "data.tokenizer=bpe:300", "model.vocab_size=256"]
    assert train_main(args) == 2
    assert "model.vocab_size: 256 is smaller than the data's vocabulary" in _one_line(capsys)
    assert not run.exists()


def test_the_results_page_is_generated_from_its_json() -> None:
    """docs/results/prepare.md is bench_prepare.py's rendering of the committed JSON, and
    the JSON's summary is what its rows say."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "bench_prepare", root / "benchmarks" / "bench_prepare.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = json.loads((root / "docs" / "results" / "prepare.json").read_text())
    assert (root / "docs" / "results" / "prepare.md").read_text() == bench.render(data)
    sizes = data["settings"]["sizes_mb"]
    assert bench.summarize(data["memory"], data["throughput"], sizes) == data["summary"]
    assert sorted({r["corpus_mb"] for r in data["memory"]}) == sorted(sizes) == [20, 200]
    assert len(data["throughput"]) == data["settings"]["rounds"] >= 3
