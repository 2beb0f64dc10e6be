"""``rootopt export`` of each architecture family docs/models.md names (Llama, Mistral, Qwen2,
GPT-2, GPT-NeoX, Phi): reloaded with ``AutoTokenizer`` and ``AutoModelForCausalLM``, the
export encodes held-out text to the trained tokenizer's ids and reproduces rootopt's val
loss. A Qwen2 whose tokenizer transformers would replace is refused, and the docs' snippets
run: the evaluation, and step 5 on the oldest and the newest transformers the docs support
(slow: it installs the oldest into a throwaway directory)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _faultkit import env
from _train_fixtures import TINY, quiet
from rootopt.commands.export import main as export_main
from rootopt.config import load_config
from rootopt.train import train

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "max_position_embeddings": 64}
# model_type -> config.json: the shipped examples made small, the others at the same size
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        **json.loads((ROOT / "configs/hf/llama-small/config.json").read_text()),
        **SMALL,
    },
    "mistral": {"model_type": "mistral", **SMALL, **HEADS, "num_key_value_heads": 2},
    "qwen2": {"model_type": "qwen2", **SMALL, **HEADS, "num_key_value_heads": 2},
    "gpt2": {
        **json.loads((ROOT / "configs/hf/gpt2-small/config.json").read_text()),
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
    },
    "gpt_neox": {"model_type": "gpt_neox", **SMALL, **HEADS},
    "phi": {"model_type": "phi", **SMALL, **HEADS},
}
CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi": "PhiForCausalLM",
}
# what the tests train: 2 steps, validation (2 batches) and a checkpoint at step 2
STEPS = [*TINY, "run.max_steps=2", "run.eval_every=2", "run.eval_batches=2", "checkpoint.every=2"]


def _prepare(out: Path, tokenizer: str) -> Path:
    from rootopt.data import prepare

    prepare(
        "kjv",
        out,
        seq_len=32,
        max_bytes=60_000,
        samples_per_shard=400,
        val_fraction=0.05,
        seed=0,
        tokenizer=tokenizer,
    )
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two prepared corpora: ``bpe`` a byte-level BPE of 512 ids trained on it (GPT-2's
    pre-tokenization, ``bpe:512``); ``qwen2`` a BPE with the pre-tokenizer and normalizer
    transformers' Qwen2Tokenizer builds (its own regex), as a user's Qwen2 tokenizer has."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tmp = tmp_path_factory.mktemp("families")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # type: ignore[call-arg]
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))], trainer=trainer
    )
    (tmp / "qwen2-tokenizer").mkdir()
    tok.save(str(tmp / "qwen2-tokenizer" / "tokenizer.json"))
    return {
        "bpe": _prepare(tmp / "bpe", "bpe:512"),
        "qwen2": _prepare(tmp / "qwen2", str(tmp / "qwen2-tokenizer")),
    }


def _train(family: str, shards: Path, tmp: Path) -> Path:
    (tmp / "config").mkdir(parents=True)
    (tmp / "config" / "config.json").write_text(json.dumps(FAMILIES[family]))
    over = [*STEPS, "model.kind=hf", f"model.hf_config={tmp / 'config'}"]
    train(load_config(None, over), tmp / "run", str(shards), say=quiet)
    return tmp / "run"


def _val_batches(shards: Path) -> list[dict[str, torch.Tensor]]:
    """The batches rootopt's validation reads (rootopt.train.data.val_stream, 2 batches)."""
    from rootopt.data import ShardStream

    stream = ShardStream(shards, "val", batch_size=8, seq_len=32, loop=False)
    return [b for _, b in zip(range(2), stream)]


def _logged_val_loss(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return float([r["val_loss"] for r in rows if "val_loss" in r][-1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_exports_with_its_trained_tokenizer_and_val_loss(
    family: str, data: dict[str, Path], tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    shards = data["qwen2" if family == "qwen2" else "bpe"]
    run = _train(family, shards, tmp_path)
    out = tmp_path / "out"
    assert export_main([str(run), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(model).__name__ == CLASSES[family]
    trained = Tokenizer.from_file(str(shards / "tokenizer.json"))
    batches = _val_batches(shards)
    held_out = "".join(trained.decode(row.tolist()) for row in batches[0]["input"])
    want = trained.encode(held_out, add_special_tokens=False).ids
    assert len(want) > 100
    assert tok(held_out, add_special_tokens=False)["input_ids"] == want
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token is None and tok.unk_token is None
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input"]).logits
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), b["target"].reshape(-1)
            )
            total += float(loss) * b["input"].size(0)
            count += b["input"].size(0)
    assert abs(total / count - _logged_val_loss(run)) <= 1e-5


def test_a_qwen2_whose_tokenizer_transformers_replaces_is_refused(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers 5.x loads every ``qwen2`` directory with its own Qwen2Tokenizer, which
    builds Qwen2's pre-tokenizer and normalizer whatever tokenizer.json says: a Qwen2 trained
    on ``bpe:512`` (GPT-2's pre-tokenization) would come back with other ids (the export
    used to publish it). The export's held-out check refuses it: one line, exit 1, nothing
    published. Where AutoTokenizer keeps the file's tokenizer, the export succeeds."""
    from rootopt.data.shards import load_manifest
    from rootopt.data.tokenizer import hf_files

    probe = tmp_path / "probe"
    probe.mkdir()
    for name, blob in hf_files(data["bpe"], load_manifest(data["bpe"])).items():
        (probe / name).write_bytes(blob)
    (probe / "config.json").write_text(json.dumps(FAMILIES["qwen2"]))
    replaced = type(transformers.AutoTokenizer.from_pretrained(str(probe))).__name__
    run = _train("qwen2", data["bpe"], tmp_path / "t")
    out = tmp_path / "out"
    if replaced in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        assert export_main([str(run), str(out)]) == 0
        return
    assert replaced == "Qwen2Tokenizer"
    capsys.readouterr()
    assert export_main([str(run), str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "loads this qwen2 model's tokenizer as Qwen2Tokenizer" in err[0]
    assert "nothing was published" in err[0]
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


# --------------------------------------------------------------------------- the docs' snippets


def _snippet(marker: str) -> str:
    """The ``python`` block of docs/models.md that holds ``marker``, else the first one after
    it (a heading)."""
    text = (ROOT / "docs" / "models.md").read_text()
    blocks = list(re.finditer(r"```python\n(.*?)```", text, re.S))
    inside = [m for m in blocks if marker in m.group(1)]
    after = [m for m in blocks if m.start() > text.index(marker)]
    found = (inside or after)[0]
    return found.group(1)


@pytest.fixture(scope="module")
def llama_export(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory as docs/models.md's worked example leaves it: ``hf-llama``, an export of
    a transformers Llama trained on bpe:512, and ``README.md``, text it did not train on."""
    tmp = tmp_path_factory.mktemp("docs-export")
    run = _train("llama", data["bpe"], tmp / "train")
    assert export_main([str(run), str(tmp / "hf-llama")]) == 0
    (tmp / "README.md").write_text((ROOT / "README.md").read_text()[:3000])
    return tmp


def test_the_docs_evaluation_matches_transformers_own_loss(
    llama_export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/models.md's evaluation snippet, run as it is: its bits per byte and perplexity
    are the windows' negative log-likelihood (lm-eval's rolling windows: the end-of-text
    token first, then disjoint windows of the context length), here summed from
    transformers' own ``labels`` loss instead of the snippet's cross-entropy."""
    monkeypatch.chdir(llama_export)
    exec(compile(_snippet("Evaluate the export"), "docs/models.md", "exec"), {})
    got = re.search(
        r"(\d+) tokens: perplexity ([\d.]+), bits per byte ([\d.]+)", capsys.readouterr().out
    )
    assert got is not None
    tok = transformers.AutoTokenizer.from_pretrained("hf-llama")
    model = transformers.AutoModelForCausalLM.from_pretrained("hf-llama").eval()
    text = (llama_export / "README.md").read_text()
    ids = [tok.eos_token_id, *tok(text, add_special_tokens=False)["input_ids"]]
    nll, window = 0.0, 128
    with torch.no_grad():
        for start in range(1, len(ids), window):  # ids[start:stop], after the window before
            stop = min(start + window, len(ids))
            x = torch.tensor([ids[max(0, stop - 1 - window) : stop]])
            labels = x.clone()
            labels[0, : x.size(1) - (stop - start)] = -100  # context, not scored
            nll += float(model(input_ids=x, labels=labels).loss) * (stop - start)
    n = len(ids) - 1
    assert int(got.group(1)) == n
    assert float(got.group(3)) == pytest.approx(nll / math.log(2) / len(text.encode()), abs=1e-4)
    assert float(got.group(2)) == pytest.approx(math.exp(nll / n), rel=1e-3)


# transformers' oldest supported release, with the tokenizers and huggingface_hub it pins
OLDEST = ("transformers==4.57.1", "tokenizers>=0.22,<=0.23.0", "huggingface_hub>=0.34,<1.0")
IDS = (
    "from transformers import AutoTokenizer\n"
    "text = open('README.md', encoding='utf-8').read()\n"
    "print(AutoTokenizer.from_pretrained('hf-llama')(text, add_special_tokens=False)['input_ids'])\n"
)


@pytest.mark.slow
def test_step_5_runs_the_same_on_the_oldest_and_newest_transformers(
    llama_export: Path, tmp_path: Path
) -> None:
    """docs/models.md's step 5, as it is, on transformers 4.57.1 (installed here into a
    throwaway directory that shadows this environment's) and on this environment's (the
    newest tested): it generates, and the same text on both; both tokenizers encode the
    held-out text to the trained ids (4.x returned token_type_ids too, which generate()
    refuses)."""
    from tokenizers import Tokenizer

    old = tmp_path / "oldest"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(old), *OLDEST],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if pip.returncode != 0:
        pytest.skip(f"cannot install {OLDEST[0]}: {pip.stderr.strip().splitlines()[-1:]}")
    step5 = _snippet("# 5. Load it with transformers")
    outputs = {}
    for name, path in (("oldest", f"{old}:"), ("newest", "")):
        runs = []
        for code in (step5, IDS):
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import transformers; print(transformers.__version__)\n" + code,
                ],
                cwd=llama_export,
                env=env(PYTHONPATH=path + env()["PYTHONPATH"]),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
            runs.append(done.stdout.splitlines())
        outputs[name] = runs
    assert outputs["oldest"][0][0] == "4.57.1"
    assert outputs["newest"][0][0] == transformers.__version__
    assert outputs["oldest"][0][1:] == outputs["newest"][0][1:]
    trained = Tokenizer.from_file(str(llama_export / "hf-llama" / "tokenizer.json"))
    text = (llama_export / "README.md").read_text(encoding="utf-8")
    want = str(trained.encode(text, add_special_tokens=False).ids)
    assert outputs["oldest"][1][1] == outputs["newest"][1][1] == want
