"""``rootopt export RUN_DIR OUT_DIR``: a run's newest valid checkpoint as a Hugging Face
model directory that transformers loads offline, with logits equal to rootopt's; refusals
are one line, exit 2, nothing written; an interrupted export leaves no OUT_DIR."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _faultkit import env, kill_session, start_session, tree_state
from _train_fixtures import TINY, logged_losses, prepare_tiny
from rootopt.commands.export import main as export_main
from rootopt.config import load_config
from rootopt.train import train
from rootopt.train.main import main as train_main

transformers = pytest.importorskip("transformers")


def _quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny built-in Llama trained 30 steps on byte tokens (its data in a sibling dir)."""
    tmp = tmp_path_factory.mktemp("export")
    shards = prepare_tiny(tmp / "data")
    run = tmp / "run"
    over = [*TINY, "run.max_steps=30", "run.eval_every=0"]
    train(load_config(None, over), run, str(shards), say=_quiet)
    return run


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _rootopt_model(run: Path) -> torch.nn.Module:
    from rootopt.config import from_dict
    from rootopt.train import checkpoint
    from rootopt.train.models import LlamaLM

    found, _ = checkpoint.newest_valid(run / "checkpoints")
    assert found is not None
    cfg = from_dict(found.state["config"])
    model = LlamaLM(cfg.model, cfg.data.seq_len)
    model.load_state_dict(found.state["model"])
    return model.eval()


def test_trained_builtin_llama_exports_with_equal_logits_and_generates(
    trained: Path, tmp_path: Path
) -> None:
    """After training: LlamaForCausalLM (tied head, the run's eps, RoPE base, GQA heads,
    ffn width), the byte tokenizer (ids = byte values), logits equal rootopt's within
    1e-5 on real text, generation works; the export no longer needs the data directory."""
    data = trained.parent / "data"
    moved = trained.parent / "data-moved"
    data.rename(moved)  # the tokenizer travels with the run (tokenizer/)
    try:
        assert export_main([str(trained), str(tmp_path / "out")]) == 0
    finally:
        moved.rename(data)
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert name in names, names
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        32,
        2,
        2,
        1,
    )
    assert c.intermediate_size == 96 and c.rms_norm_eps == 1e-5 and c.vocab_size == 256
    assert c.rope_parameters["rope_theta"] == 10000.0 and c.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    text = "And God said, Let there be light: and there was light. ü"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    x = torch.tensor([ids[:32]])
    with torch.no_grad():
        ours = _rootopt_model(trained)(x)
        theirs = model(input_ids=x).logits
    assert ours.shape == theirs.shape == (1, 32, 256)
    assert float((ours - theirs).abs().max()) <= 1e-5
    gen = model.generate(x[:, :8], max_new_tokens=6, do_sample=False)
    assert gen.shape == (1, 14) and torch.equal(gen[:, :8], x[:, :8])
    # greedy generation is the argmax of rootopt's own model, token by token
    seq = x[:, :8]
    with torch.no_grad():
        for _ in range(6):
            nxt = _rootopt_model(trained)(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(seq, gen)


def test_init_from_an_export_of_the_builtin_llama(trained: Path, tmp_path: Path) -> None:
    """model.kind=llama from an export of itself: the first logged loss equals the
    trained run's model on that batch (the inverse map is exact)."""
    from rootopt.train.models import LlamaLM
    from rootopt.train.models.transformers_lm import load_init

    assert export_main([str(trained), str(tmp_path / "out")]) == 0
    cfg = load_config(None, [*TINY, f"model.init_from={tmp_path / 'out'}"])
    fresh = LlamaLM(cfg.model, 32)
    load_init(fresh, cfg.model)
    want = _rootopt_model(trained).state_dict()
    got = fresh.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    over = [*TINY, "run.max_steps=3", "run.log_every=1", "run.eval_every=0"]
    shards = trained.parent / "data"
    train(
        load_config(None, [*over, f"model.init_from={tmp_path / 'out'}"]),
        tmp_path / "ft",
        str(shards),
        say=_quiet,
    )
    train(load_config(None, over), tmp_path / "scratch", str(shards), say=_quiet)
    assert logged_losses(tmp_path / "ft")[1] < logged_losses(tmp_path / "scratch")[1] - 1.0


def test_refusals_are_one_line_exit_2_and_write_nothing(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = tmp_path / "mine"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    assert export_main([str(trained), str(full)]) == 2
    assert "exists and is not empty" in _one_line(capsys)
    (tmp_path / "a-file").write_text("x")
    assert export_main([str(trained), str(tmp_path / "a-file")]) == 2
    assert "is not a directory" in _one_line(capsys)
    assert export_main([str(tmp_path / "nowhere"), str(tmp_path / "o1")]) == 2
    assert "is not a directory" in _one_line(capsys)
    assert export_main([str(full), str(tmp_path / "o2")]) == 2
    assert "not a rootopt run directory" in _one_line(capsys)
    # a run whose only checkpoint is corrupt
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    for p in (broken / "checkpoints").glob("ckpt-*.pt"):
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        p.write_bytes(bytes(raw))
    assert export_main([str(broken), str(tmp_path / "o3")]) == 2
    assert "holds no valid checkpoint to export" in _one_line(capsys)
    after = _tree(tmp_path)
    for k in ("a-file", *(k for k in after if k.startswith("broken"))):
        after.pop(k, None)
    assert after == before  # nothing written, no partial directories
    # an empty OUT_DIR is used
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main([str(trained), str(empty)]) == 0
    assert (empty / "model.safetensors").is_file()


def test_a_run_without_its_tokenizer_copy_exports_from_its_data(
    trained: Path, tmp_path: Path
) -> None:
    """A run started before tokenizer/ existed: the tokenizer comes from the data its
    checkpoint names."""
    old = tmp_path / "old-run"
    shutil.copytree(trained, old)
    shutil.rmtree(old / "tokenizer")
    assert export_main([str(old), str(tmp_path / "out")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok("abc")["input_ids"] == [97, 98, 99]


def test_a_failure_mid_export_leaves_nothing(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rootopt.train.tools.export as ex

    def fail(*args: object) -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(ex, "_compare", fail)
    with pytest.raises(KeyboardInterrupt):
        ex.export(trained, tmp_path / "out", say=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_mismatch_publishes_nothing(
    trained: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The check before the rename has teeth: without the RoPE row order the reloaded
    model differs, and the export stops with exit 1 and no OUT_DIR."""
    import rootopt.train.models.transformers_lm as hf

    monkeypatch.setattr(hf, "_rope_order", lambda d: torch.arange(d))
    assert export_main([str(trained), str(tmp_path / "out")]) == 1
    assert "differs from rootopt's model" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sigkill_mid_export_leaves_no_out_dir(trained: Path, tmp_path: Path) -> None:
    """A kill at any point leaves OUT_DIR absent (at most a hidden partial sibling); the
    same command then exports."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rootopt.cli", "export", str(trained), str(out)]
    proc = start_session(cmd, env=env())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(tmp_path.glob(".out.partial-*")):
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_session(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "exported ckpt-00000030.pt (step 30)" in done.stdout
    assert transformers.AutoModelForCausalLM.from_pretrained(str(out)) is not None


def test_the_embedded_default_run_exports_and_generates(tmp_path: Path) -> None:
    """`rootopt train` with the embedded default (a few steps), then `rootopt export`: a
    LlamaForCausalLM with its byte tokenizer that transformers loads and generates with."""
    run, out = tmp_path / "run", tmp_path / "hf"
    base = [sys.executable, "-m", "rootopt.cli"]
    over = [
        "run.max_steps=3",
        "run.eval_every=0",
        "monitoring.progress_bar=false",
        "monitoring.plot=false",
    ]
    done = subprocess.run(
        [*base, "train", "--log_dir", str(run), *over],
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run(
        [*base, "export", str(run), str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LlamaForCausalLM" in done.stdout and "vocabulary 256" in done.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 128
    prompt = tok("def main(", return_tensors="pt")
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape == (1, prompt["input_ids"].shape[1] + 8)
    assert isinstance(tok.decode(gen[0]), str)


# --------------------------------------------------------------------------- what is written

SPECIALS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
}
EXTRA = "<|im_start|>"


@pytest.fixture(scope="module")
def special_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny built-in Llama trained 4 steps on text tokenized by a user's tokenizer file
    whose tokenizer_config.json (beside it, as in a Hugging Face model directory) names a
    bos, eos, unk and pad token and one more special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rootopt.data import prepare

    tmp = tmp_path_factory.mktemp("export-special")
    mine = tmp / "my-tokenizer"
    mine.mkdir()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # type: ignore[call-arg]
        vocab_size=400,
        special_tokens=[*SPECIALS.values(), EXTRA],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    docs = Path(__file__).resolve().parents[1] / "docs"
    tok.train_from_iterator([p.read_text() for p in sorted(docs.glob("*.md"))], trainer=trainer)
    tok.save(str(mine / "tokenizer.json"))
    config = {**SPECIALS, "eos_token": {"content": "</s>", "special": True}}
    (mine / "tokenizer_config.json").write_text(
        json.dumps({**config, "additional_special_tokens": [EXTRA]})
    )
    data = tmp / "data"
    prepare(
        "kjv",
        data,
        seq_len=32,
        max_bytes=60_000,
        samples_per_shard=400,
        val_fraction=0.05,
        seed=0,
        tokenizer=str(mine),
    )
    over = [*TINY, "run.max_steps=4", "run.eval_every=0", "checkpoint.every=4"]
    train(load_config(None, over), tmp / "run", str(data), say=_quiet)
    return tmp / "run"


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


def test_the_tokenizer_keeps_every_special_token_and_returns_what_a_causal_lm_reads(
    special_run: Path, tmp_path: Path
) -> None:
    """bos, eos, unk, pad and the additional special token of the user's tokenizer come
    back from AutoTokenizer (only eos did), the ids are in config.json, the tokenizer
    returns input_ids and attention_mask (model_input_names: transformers 4.x returned
    token_type_ids too, which generate() refuses), tokenizer.json is the trained file."""
    out = tmp_path / "out"
    assert export_main([str(special_run), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert {r: getattr(tok, r) for r in SPECIALS} == SPECIALS
    assert EXTRA in tok.all_special_tokens
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["model_input_names"] == ["input_ids", "attention_mask"]
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert sorted(tok("a b").keys()) == ["attention_mask", "input_ids"]
    model = json.loads((out / "config.json").read_text())
    ids = {r: tok.convert_tokens_to_ids(t) for r, t in SPECIALS.items()}
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (
        ids["bos_token"],
        ids["eos_token"],
        ids["pad_token"],
    )
    trained = special_run.parent / "data" / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == trained.read_bytes()


def test_every_exported_file_follows_the_umask(trained: Path, tmp_path: Path) -> None:
    """0644 under umask 022, 0640 under 027, model.safetensors too (safetensors creates it
    0600: a server running as another user could not read the weights)."""
    for mask, want in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(mask)
        try:
            out = tmp_path / f"out-{mask:o}"
            assert export_main([str(trained), str(out)]) == 0
        finally:
            os.umask(old)
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert "model.safetensors" in modes
        assert modes == dict.fromkeys(modes, want)


def test_a_different_or_broken_tokenizer_in_the_run_is_refused(
    special_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's tokenizer/tokenizer.json must be the file whose sha256 the checkpoint
    records: another tokenizer (it used to be exported with the model) and a malformed
    file (a 42-line JSONDecodeError) are one line naming it, exit 2, nothing written; so is
    a malformed special_tokens_map.json."""
    from rootopt.data.tokenizer import bytes_tokenizer_json

    cases = [
        ("tokenizer.json", bytes_tokenizer_json().encode(), "is not the tokenizer"),
        ("tokenizer.json", b"{not json", "is not the tokenizer"),
        ("special_tokens_map.json", b"{not json", "is not a JSON file"),
    ]
    for i, (name, blob, says) in enumerate(cases):
        run = _copy(special_run, tmp_path / f"run{i}")
        (run / "tokenizer" / name).write_bytes(blob)
        before = tree_state(tmp_path)
        assert export_main([str(run), str(tmp_path / f"out{i}")]) == 2, name
        line = _one_line(capsys)
        assert says in line and str(run / "tokenizer" / name) in line, line
        assert tree_state(tmp_path) == before


def test_a_link_in_the_runs_tokenizer_dir_is_refused_by_export_and_training(
    special_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link at tokenizer/tokenizer_config.json used to copy the user's file it points to
    into the export; a link at tokenizer/tokenizer.json to an identical file was kept by a
    training rerun. Both are refused with one line naming the link (export and training,
    status 2); the user's file and the run directory stay as they were."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.json").write_text('{"mine": true}')
    (user / "tokenizer.json").write_bytes(
        (special_run / "tokenizer" / "tokenizer.json").read_bytes()
    )
    run = _copy(special_run, tmp_path / "run")
    (run / "tokenizer" / "tokenizer_config.json").unlink(missing_ok=True)  # a run of before
    (run / "tokenizer" / "tokenizer_config.json").symlink_to(user / "notes.json")
    mine = tree_state(user)
    before = tree_state(run)
    assert export_main([str(run), str(tmp_path / "out")]) == 2
    line = _one_line(capsys)
    assert "symbolic link" in line and str(run / "tokenizer" / "tokenizer_config.json") in line
    assert not (tmp_path / "out").exists()
    (run / "tokenizer" / "tokenizer_config.json").unlink()
    (run / "tokenizer" / "tokenizer.json").unlink()
    (run / "tokenizer" / "tokenizer.json").symlink_to(user / "tokenizer.json")
    before = tree_state(run)
    data = special_run.parent / "data"
    over = [*TINY, "run.max_steps=6", "run.eval_every=0", "checkpoint.every=4"]
    assert train_main(["--data_path", str(data), "--log_dir", str(run), *over]) == 2
    line = _one_line(capsys)
    assert "symbolic link" in line and str(run / "tokenizer" / "tokenizer.json") in line
    assert tree_state(run) == before and tree_state(user) == mine


def test_an_out_dir_that_cannot_be_created_is_one_line_naming_it(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT_DIR under a file, in /proc, or a link to an empty directory: one line naming
    the path, exit 2, nothing written (they were "I/O error: File exists" with no path, or
    a refusal only after the whole export)."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    before = tree_state(tmp_path)
    cases = [
        (tmp_path / "a-file" / "sub" / "out", f"{str(tmp_path / 'a-file')!r} is not a directory"),
        (tmp_path / "link", "symbolic link"),
    ]
    if Path("/proc/self").is_dir():
        cases.append(
            (Path("/proc/rootopt-export-test"), "cannot create '/proc/rootopt-export-test'")
        )
    for out, says in cases:
        assert export_main([str(trained), str(out)]) == 2, out
        line = _one_line(capsys)
        assert says in line and str(out) in line, line
    assert tree_state(tmp_path) == before


def _file_size_limit(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_failed_write_names_the_file_and_publishes_nothing(trained: Path, tmp_path: Path) -> None:
    """The weights' write failing in safetensors' own writer (here: a file-size limit below
    their size, EFBIG; a full disk fails the same way with ENOSPC, "Error while
    serializing: I/O error: No space left on device (os error 28)") is one line naming the
    file, exit 1, no OUT_DIR and no partial sibling; it was a 22-line SafetensorError."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "rootopt.cli", "export", str(trained), str(out)],
        env=env(PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: _file_size_limit(64 * 1024),
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(err) == 1, done.stderr[-3000:]
    assert err[0] == (
        f"rootopt export: I/O error: {os.strerror(errno.EFBIG)} ({out / 'model.safetensors'}); "
        "nothing was published"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []
