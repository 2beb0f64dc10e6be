"""``model.kind=hf``: transformers causal LMs in the training system, the built-in Llama's
map onto ``LlamaForCausalLM``, ``model.init_from``, the vocabulary rule and the mfu metric.

The training runs use tiny copies of the two example configs (``configs/hf/llama-small``,
``configs/hf/gpt2-small``: the same keys, smaller sizes), written by the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from _train_fixtures import TINY, logged_losses, prepare_tiny, torchrun
from rootopt.config import ModelConfig, load_config
from rootopt.train import Hooks, train
from rootopt.train.main import main as train_main

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
STEPS = 24  # "a few dozen steps" (issue 29)
# constant lr after warmup, one record per step (as tests/test_dist_train.py)
CFG = [
    *TINY,
    f"run.max_steps={STEPS}",
    "run.log_every=1",
    "run.eval_every=0",
    "checkpoint.every=4",
    "optimization.schedule=constant",
    # float32 iterations: the world sizes are compared to float32 rounding (with bfloat16
    # iterations, the default on a CPU with bf16 units, they agree to bfloat16 rounding:
    # tests/test_parity.py)
    "optimization.ns_dtype=float32",
]


def _quiet(msg: str) -> None:
    pass


def _tiny_config(tmp: Path, example: str, **change: Any) -> Path:
    """A copy of an example config.json with smaller sizes (the same keys otherwise)."""
    spec = json.loads((ROOT / "configs" / "hf" / example / "config.json").read_text())
    spec.update(change)
    out = tmp / f"{example}-tiny"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec))
    return out


LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("hf-shards") / "d")


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus with a byte-level BPE of 512 ids trained on it (bpe:512)."""
    return prepare_tiny(tmp_path_factory.mktemp("hf-bpe") / "d", "bpe:512")


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("hf-configs")
    return {
        "llama": _tiny_config(tmp, "llama-small", **LLAMA),
        "gpt2": _tiny_config(tmp, "gpt2-small", **GPT2),
    }


# --------------------------------------------------------------------------- the built-in Llama


def _random_llama(cfg: ModelConfig, seq: int) -> Any:
    from rootopt.train.models import LlamaLM

    torch.manual_seed(1)
    model = LlamaLM(cfg, seq)
    with torch.no_grad():  # norms away from 1, so a wrong eps or a swapped norm shows;
        for name, p in model.named_parameters():  # sharp attention, so the RoPE order shows
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(("wq.weight", "wk.weight")):
                p.mul_(10)
    return model.eval()


def _as_transformers(model: Any, cfg: ModelConfig, seq: int, *, permute: bool = True) -> Any:
    from rootopt.train.models import transformers_lm as hf

    spec = hf.llama_hf_spec(cfg, cfg.vocab_size, seq, {"bos": None, "eos": None, "pad": None})
    theirs = transformers.AutoModelForCausalLM.from_config(
        hf.hf_config_object(spec), dtype=torch.float32
    )
    if permute:
        state = hf.llama_to_hf(model.state_dict(), cfg)
    else:  # the same names without the RoPE row order: must not match
        real = hf._rope_order
        hf._rope_order = lambda d: torch.arange(d)  # type: ignore[assignment]
        try:
            state = hf.llama_to_hf(model.state_dict(), cfg)
        finally:
            hf._rope_order = real  # type: ignore[assignment]
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return theirs.eval()


@pytest.mark.parametrize(
    "shape",
    [
        dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=True),
        dict(
            d_model=48,
            n_layers=3,
            n_heads=6,
            n_kv_heads=3,
            tie_embeddings=False,
            rope_theta=500.0,
            norm_eps=1e-3,
            ffn_hidden=80,
            vocab_size=300,
        ),
    ],
)
def test_builtin_llama_maps_onto_llama_for_causal_lm(shape: dict[str, Any]) -> None:
    """Random weights, GQA, a tied and an untied head, non-default eps, RoPE base and ffn
    width: transformers' logits equal rootopt's within 1e-5 (float32); without the q/k row
    permutation they do not, and the inverse map gives back every tensor exactly."""
    from rootopt.train.models import transformers_lm as hf

    cfg = ModelConfig(**{"vocab_size": 256, **shape})
    seq = 24
    ours = _random_llama(cfg, seq)
    tokens = torch.randint(0, cfg.vocab_size, (3, seq), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(tokens)
        got = _as_transformers(ours, cfg, seq)(input_ids=tokens, use_cache=False).logits
        wrong = _as_transformers(ours, cfg, seq, permute=False)(input_ids=tokens).logits
    assert want.shape == got.shape == (3, seq, cfg.vocab_size)
    assert float((want - got).abs().max()) <= 1e-5
    assert float((want - wrong).abs().max()) > 1e-2
    back = hf.hf_to_llama(hf.llama_to_hf(ours.state_dict(), cfg), cfg)
    mine = ours.state_dict()
    assert sorted(back) == sorted(mine)
    assert all(torch.equal(back[k], mine[k]) for k in mine)


# --------------------------------------------------------------------------- structure


def test_decoder_blocks_and_routing_come_from_the_model(configs: dict[str, Path]) -> None:
    """FSDP2 units are the model's own decoder layers (from ``_no_split_modules``, else its
    repeated ModuleList); routing sends matrices (GPT-2's transposed Conv1D too) to ROOT
    and embeddings, norms, biases and the head to AdamW."""
    from rootopt.optim import param_groups
    from rootopt.train.models import blocks_of, build_model
    from rootopt.train.models.transformers_lm import decoder_blocks

    meta = {"task": "lm", "vocab_size": 256}
    seen = {}
    for kind in ("llama", "gpt2"):
        m = build_model(ModelConfig(kind="hf", hf_config=str(configs[kind])), meta, 32)
        blocks = blocks_of(m)
        assert len(blocks) == 2 and len({type(b) for b in blocks}) == 1
        seen[kind] = type(blocks[0]).__name__
        _, report = param_groups(m, lr=1e-3)
        route = {r.name: r.algorithm for r in report.routes}
        assert len(route) == len([p for p in m.parameters()])
        seen[kind + "-routes"] = route
    assert (seen["llama"], seen["gpt2"]) == ("LlamaDecoderLayer", "GPT2Block")
    g = seen["gpt2-routes"]
    for leaf in (
        "attn.c_attn.weight",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
    ):
        assert g[f"hf.transformer.h.0.{leaf}"] == "root", leaf
    for name in (
        "hf.transformer.wte.weight",
        "hf.transformer.wpe.weight",
        "hf.transformer.ln_f.weight",
        "hf.transformer.h.1.attn.c_attn.bias",
    ):
        assert g[name] == "adamw", name
    assert "hf.lm_head.weight" not in g  # tied to wte: one tensor, routed once
    ll = seen["llama-routes"]
    assert ll["hf.model.layers.1.mlp.down_proj.weight"] == "root"
    assert ll["hf.model.embed_tokens.weight"] == ll["hf.model.norm.weight"] == "adamw"

    class NoDeclaration(torch.nn.Module):  # no _no_split_modules: the repeated ModuleList
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(2, 2)) for _ in range(3)
            )

    found = decoder_blocks(NoDeclaration())
    assert len(found) == 3 and all(isinstance(b, torch.nn.Sequential) for b in found)


def test_activation_checkpointing_is_the_models_own_switch(configs: dict[str, Path]) -> None:
    from rootopt.train.models import build_model

    meta = {"task": "lm", "vocab_size": 256}
    for on in (False, True):
        m = build_model(
            ModelConfig(kind="hf", hf_config=str(configs["gpt2"]), activation_checkpointing=on),
            meta,
            32,
        )
        assert m.hf.is_gradient_checkpointing is on  # type: ignore[union-attr]


def test_untied_llama_head_is_routed_to_adamw(tmp_path: Path) -> None:
    from rootopt.optim import param_groups
    from rootopt.train.models import build_model

    path = _tiny_config(tmp_path, "llama-small", **LLAMA, tie_word_embeddings=False)
    m = build_model(
        ModelConfig(kind="hf", hf_config=str(path)), {"task": "lm", "vocab_size": 256}, 32
    )
    route = {r.name: r.algorithm for r in param_groups(m, lr=1e-3)[1].routes}
    assert route["hf.lm_head.weight"] == "adamw"


# --------------------------------------------------------------------------- the mfu metric


def test_flops_per_token_counts_matmul_weights_and_attention(configs: dict[str, Path]) -> None:
    """6·N + 12·L·d·T, N = Linear/Conv1D weights once each (the tied head as the head)."""
    from rootopt.train.metrics.mfu import flops_per_token, matmul_params
    from rootopt.train.models import LlamaLM, build_model

    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1)
    per_layer = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 32 * 96  # q k v o, gate up down
    n = 2 * per_layer + 256 * 32  # + the (tied) head
    assert matmul_params(LlamaLM(cfg, 64)) == n
    assert flops_per_token(LlamaLM(cfg, 64), 64) == 6 * n + 12 * 2 * 32 * 64
    gpt2 = build_model(
        ModelConfig(kind="hf", hf_config=str(configs["gpt2"])),
        {"task": "lm", "vocab_size": 256},
        32,
    )
    block = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32  # c_attn, c_proj, c_fc, mlp.c_proj
    assert flops_per_token(gpt2, 16) == 6 * (2 * block + 256 * 32) + 12 * 2 * 32 * 16


def test_gpu_peak_table_and_unknown_devices() -> None:
    from rootopt.train.metrics.mfu import Peak, gpu_peak, mfu

    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16").flops == pytest.approx(989.4e12)
    assert gpu_peak("NVIDIA H100 PCIe", "bf16").flops == pytest.approx(756e12)
    assert gpu_peak("NVIDIA H200", "fp16").flops == pytest.approx(989.4e12)
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == pytest.approx(19.5e12)
    assert gpu_peak("NVIDIA A10", "bf16").flops == pytest.approx(125e12)
    assert gpu_peak("NVIDIA A10G", "bf16").flops == 0  # not the A10: no guess
    assert gpu_peak("Tesla T4", "bf16").flops == 0  # no bf16 on Turing
    assert gpu_peak("Tesla V100-PCIE-16GB", "fp16").flops == pytest.approx(112e12)
    peak = Peak(100e12, "run.peak_tflops", "bf16", "cuda")
    assert mfu(6e9, 1000.0, 2, peak) == pytest.approx(6e9 * 1000 / 200e12)
    assert mfu(6e9, None, 1, peak) is None
    assert mfu(6e9, 1000.0, 1, Peak(0.0, "unknown", "bf16", "cuda")) is None


def _report_dir(tmp: Path, mfus: list[float | None], device: str) -> Path:
    run = tmp / f"r-{device}-{mfus[0]}"
    run.mkdir()
    rows = [{"step": i + 1, "loss": 3.0 - 0.1 * i, "mfu": v} for i, v in enumerate(mfus)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    peak = {"tflops": 989.4, "source": "table: H100", "dtype": "bf16", "device": device}
    (run / "env.json").write_text(json.dumps({"peak": peak}))
    return run


def test_report_utilisation_criterion_from_mfu(tmp_path: Path) -> None:
    """MFU is a lower bound of GPU utilisation: >= 85 % on a GPU passes; below, or on a
    CPU, the criterion cannot be decided (SKIP) and says why, with the median MFU."""
    from rootopt.monitor.report import check_run

    def crit(run: Path) -> Any:
        got = [c for c in check_run(run).criteria if c.name.startswith("GPU utilisation")]
        assert len(got) == 1
        return got[0]

    high = crit(_report_dir(tmp_path, [0.9, 0.88, None, 0.86], "cuda"))
    assert high.status == "PASS" and "median MFU 88.0% of 3 records" in high.evidence
    low = crit(_report_dir(tmp_path, [0.41, 0.4, 0.42], "cuda"))
    assert low.status == "SKIP" and "41.0%" in low.evidence and "from below" in low.evidence
    cpu = crit(_report_dir(tmp_path, [0.95, 0.95], "cpu"))
    assert cpu.status == "SKIP" and "no GPU" in cpu.evidence and "95.0%" in cpu.evidence


# --------------------------------------------------------------------------- training


def _hf(path: Path) -> list[str]:
    return ["model.kind=hf", f"model.hf_config={path}"]


def test_hf_llama_trains_logs_mfu_and_records_its_config(
    shards: Path, configs: dict[str, Path], tmp_path: Path
) -> None:
    """The default user path of kind hf: loss falls, every record has tokens_per_s and mfu,
    env.json the peak it divides by, and the checkpoint the transformers config."""
    from rootopt.monitor import read_jsonl

    s = train(
        load_config(None, [*CFG, *_hf(configs["llama"]), "run.max_steps=20"]),
        tmp_path / "r",
        str(shards),
        say=_quiet,
    )
    assert s.status == "completed" and s.final_loss < s.initial_loss - 0.5
    rows = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 20
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    env = json.loads((tmp_path / "r" / "env.json").read_text())
    assert env["peak"]["source"] == "measured" and env["peak"]["tflops"] > 0
    assert env["flops_per_token"] > 0
    r = rows[-1]
    assert r["mfu"] == pytest.approx(
        env["flops_per_token"] * r["tokens_per_s"] / (env["peak"]["tflops"] * 1e12)
    )
    ck = torch.load(tmp_path / "r" / "checkpoints" / "ckpt-00000020.pt", weights_only=True)
    assert ck["hf_config"]["model_type"] == "llama" and ck["hf_config"]["vocab_size"] == 256
    assert ck["config"]["model"]["vocab_size"] == 256  # resolved from the tokenizer


def test_gpt2_trains(bpe_shards: Path, configs: dict[str, Path], tmp_path: Path) -> None:
    shards = bpe_shards
    s = train(
        load_config(None, [*CFG, *_hf(configs["gpt2"])]), tmp_path / "g", str(shards), say=_quiet
    )
    assert s.status == "completed" and s.steps == STEPS
    assert s.final_loss < s.initial_loss - 0.5


def test_interrupted_hf_run_resumes_bit_identically(
    bpe_shards: Path, configs: dict[str, Path], tmp_path: Path
) -> None:
    shards = bpe_shards
    over = [*CFG, *_hf(configs["llama"]), "model.activation_checkpointing=true"]
    train(load_config(None, over), tmp_path / "whole", str(shards), say=_quiet)
    part = train(
        load_config(None, over),
        tmp_path / "split",
        str(shards),
        say=_quiet,
        hooks=Hooks(after_step=lambda s: s == 5),
    )
    assert part.status == "interrupted" and part.steps == 5
    rest = train(load_config(None, over), tmp_path / "split", str(shards), say=_quiet)
    assert rest.resumed_from == "ckpt-00000005.pt" and rest.steps == STEPS
    a = torch.load(tmp_path / "whole" / "checkpoints" / f"ckpt-{STEPS:08d}.pt", weights_only=True)[
        "model"
    ]
    b = torch.load(tmp_path / "split" / "checkpoints" / f"ckpt-{STEPS:08d}.pt", weights_only=True)[
        "model"
    ]
    assert sorted(a) == sorted(b) and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert logged_losses(tmp_path / "whole") == logged_losses(tmp_path / "split")


def test_a_changed_hf_config_refuses_the_resume(
    shards: Path, configs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _tiny_config(tmp_path, "llama-small", **LLAMA)
    args = [
        "--data_path",
        str(shards),
        "--log_dir",
        str(tmp_path / "r"),
        *CFG,
        "run.max_steps=4",
        *_hf(path),
    ]
    assert train_main(args) == 0
    capsys.readouterr()
    spec = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**spec, "intermediate_size": 96}))
    before = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert train_main([*args[:-2], "run.max_steps=8", *_hf(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "intermediate_size: 64 → 96" in err[0], err
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == before


def test_old_checkpoint_of_the_byte_default_still_resumes(shards: Path, tmp_path: Path) -> None:
    """A checkpoint written before model.kind=hf existed (no hf_config / init_from keys,
    vocab_size 256 written out) resumes under today's default (vocab_size 0 = the
    tokenizer's): the resolved vocabulary is what both record."""
    from rootopt import checkpoint

    over = [*CFG, "run.max_steps=4"]
    train(load_config(None, over), tmp_path / "r", str(shards), say=_quiet)
    ck_dir = tmp_path / "r" / "checkpoints"
    path = ck_dir / "ckpt-00000004.pt"
    meta = checkpoint.sidecar(path)
    assert meta is not None
    payload = torch.load(path, weights_only=True)
    model = payload["config"]["model"]
    assert model["vocab_size"] == 256
    del model["hf_config"], model["init_from"]
    model["kind"] = "llama"
    path.unlink()
    path.with_suffix(".json").unlink()
    checkpoint.save(ck_dir, 4, payload, run_id=meta["run_id"], serial=meta["serial"])
    s = train(load_config(None, [*CFG, "run.max_steps=6"]), tmp_path / "r", str(shards), say=_quiet)
    assert s.resumed_from == "ckpt-00000004.pt" and s.steps == 6


# --------------------------------------------------------------------------- bad input


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], run: Path) -> str:
    assert train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert not run.exists(), sorted(p.name for p in run.iterdir())  # nothing written
    return err[0]


def test_bad_hf_input_is_one_line_exit_2_nothing_written(
    shards: Path, configs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "r"
    base = ["--data_path", str(shards), "--log_dir", str(run), *CFG]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.json").write_text('{"model_type": "llama", ')
    (bad / "list.json").write_text("[1, 2]")
    (bad / "notype.json").write_text('{"hidden_size": 8}')
    (bad / "vit.json").write_text('{"model_type": "vit"}')
    (bad / "nonsense.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    (bad / "short.json").write_text(
        '{"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 16}'
    )
    cases = [
        (["model.kind=hf"], "model.kind=hf needs a transformers config.json"),
        ([*_hf(tmp_path / "missing.json")], "does not exist"),
        ([*_hf(bad)], "holds no config.json"),
        ([*_hf(bad / "broken.json")], "is not valid JSON (line 1"),
        ([*_hf(bad / "list.json")], "not a JSON object"),
        ([*_hf(bad / "notype.json")], "names no model_type"),
        ([*_hf(bad / "vit.json")], "model_type 'vit' is not a causal language model"),
        ([*_hf(bad / "nonsense.json")], "transformers refuses this llama config"),
        ([*_hf(bad / "short.json")], "data.seq_len: 32 is longer than the 16 positions"),
        ([f"model.hf_config={configs['llama']}"], "used with model.kind=hf only"),
        (
            [*_hf(configs["llama"]), "model.vocab_size=100"],
            "model.vocab_size: 100 is smaller than the data's vocabulary (256",
        ),
        (["model.init_from=" + str(tmp_path / "nowhere")], "model.init_from:"),
        (["model.init_from=" + str(bad)], "holds no model.safetensors"),
    ]
    for extra, message in cases:
        line = _refused([*base, *extra], capsys, run)
        assert message in line, (extra, line)


# --------------------------------------------------------------------------- init_from


def _first_batch(shards: Path, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The first training batch of a new one-process run of ``cfg`` on ``shards``."""
    from rootopt.train.build import ProcessInfo
    from rootopt.train.data import batches
    from rootopt.train.run.state import TrainState

    fake = SimpleNamespace(cfg=cfg, info=ProcessInfo(0, 1, 0), state=TrainState(), data_dir=shards)
    batch = next(batches(fake))  # type: ignore[arg-type]
    return batch["input"], batch["target"]


def _save_pretrained(model: Any, out: Path) -> Path:
    model.save_pretrained(str(out))
    return out


def test_init_from_starts_at_that_models_loss_and_trains_on(
    shards: Path, configs: dict[str, Path], tmp_path: Path
) -> None:
    """kind hf and kind llama: the first logged loss is the loaded model's loss on the same
    batch, computed by transformers; the run then trains on."""
    from rootopt.train.models import build_model, loss_fn
    from rootopt.train.models.transformers_lm import HFCausalLM

    torch.manual_seed(7)
    src = build_model(
        ModelConfig(kind="hf", hf_config=str(configs["gpt2"])),
        {"task": "lm", "vocab_size": 256},
        32,
    )
    assert isinstance(src, HFCausalLM)
    d = _save_pretrained(src.hf, tmp_path / "gpt2-pretrained")
    over = [*CFG, "model.kind=hf", f"model.init_from={d}", "run.max_steps=6"]
    cfg = load_config(None, over)
    x, y = _first_batch(shards, cfg)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    with torch.no_grad():
        want = float(loss_fn(reloaded(input_ids=x).logits, y))
    s = train(cfg, tmp_path / "ft", str(shards), say=_quiet)
    got = logged_losses(tmp_path / "ft")
    assert got[1] == pytest.approx(want, rel=1e-6, abs=0)
    assert s.final_loss < got[1]
    fresh = logged_losses(
        _run(shards, tmp_path / "fresh", [*CFG, *_hf(configs["gpt2"]), "run.max_steps=1"])
    )
    assert abs(fresh[1] - want) > 1e-3  # the weights came from init_from, not the seed


def _run(shards: Path, run: Path, over: list[str]) -> Path:
    train(load_config(None, over), run, str(shards), say=_quiet)
    return run


def test_init_from_shape_mismatch_is_one_line(
    shards: Path, configs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt.train.models import build_model
    from rootopt.train.models.transformers_lm import HFCausalLM

    src = build_model(
        ModelConfig(kind="hf", hf_config=str(configs["llama"])),
        {"task": "lm", "vocab_size": 256},
        32,
    )
    assert isinstance(src, HFCausalLM)
    d = _save_pretrained(src.hf, tmp_path / "llama-pretrained")
    capsys.readouterr()  # transformers' progress bar
    run = tmp_path / "r"
    base = ["--data_path", str(shards), "--log_dir", str(run), *CFG]
    wide = _tiny_config(tmp_path / "w", "llama-small", **{**LLAMA, "intermediate_size": 96})
    line = _refused([*base, *_hf(wide), f"model.init_from={d}"], capsys, run)
    assert "mlp.gate_proj.weight has shape (64, 32)" in line and "(96, 32)" in line, line
    line = _refused(
        [*base, "model.kind=hf", f"model.init_from={d}", "model.vocab_size=300"], capsys, run
    )
    assert "model.embed_tokens.weight has shape (256, 32)" in line and "(300, 32)" in line, line
    line = _refused(
        [*base, f"model.init_from={d}"], capsys, run
    )  # kind llama from a HF Llama of other sizes
    assert "model.init_from:" in line and "shape" in line, line


# --------------------------------------------------------------------------- torchrun


def _model_tensors(run: Path) -> dict[str, torch.Tensor]:
    from rootopt.distributed.checkpoint import load_full_model_state

    newest = max(
        (run / "checkpoints").glob("*-*"), key=lambda p: int(p.name.split("-")[1].split(".")[0])
    )
    if newest.suffix == ".json":
        newest = newest.with_suffix(".pt")
    if newest.is_file():
        return torch.load(newest, weights_only=True)["model"]  # type: ignore[no-any-return]
    return load_full_model_state(newest)


def test_world_sizes_1_2_ddp_and_fsdp_agree_then_export_and_init_from(
    bpe_shards: Path, configs: dict[str, Path], tmp_path: Path
) -> None:
    """The example Llama config on a bpe:512 tokenizer: W = 1, torchrun W = 2 DDP and
    W = 2 FSDP2 (gloo) log the same losses (today's tolerance, tests/test_dist_train.py)
    and end with the same parameters; the FSDP2 run's dcp checkpoint exports to a
    transformers model (with the BPE tokenizer) whose logits equal the W = 1 model's; a run
    with init_from that export starts at its loss and continues from it."""
    from rootopt.data import load_manifest
    from rootopt.train.models import build_model, loss_fn
    from rootopt.train.models.transformers_lm import HFCausalLM
    from rootopt.train.tools.export import export

    shards = bpe_shards
    manifest = load_manifest(shards)
    assert manifest["tokenizer"]["kind"] == "bpe" and manifest["tokenizer"]["vocab_size"] == 512
    over = [*CFG, *_hf(configs["llama"])]
    ref = _run(shards, tmp_path / "w1", over)
    base, base_model = logged_losses(ref), _model_tensors(ref)
    assert sorted(base) == list(range(1, STEPS + 1)) and base[STEPS] < base[1] - 0.5
    assert base_model["hf.model.embed_tokens.weight"].shape == (512, 32)  # the tokenizer's
    for name, extra in (("ddp2", []), ("fsdp2", ["distributed.parallel=fsdp"])):
        out = torchrun(2, tmp_path / name, shards, [*over, *extra])
        assert f"2 processes ({'fsdp' if extra else 'ddp'}, gloo)" in out.stdout
        got = logged_losses(tmp_path / name)
        assert sorted(got) == sorted(base)
        for step in base:
            assert abs(got[step] - base[step]) <= 1e-5 * abs(base[step]), (name, step)
        model = _model_tensors(tmp_path / name)
        assert sorted(model) == sorted(base_model)
        for k in base_model:
            torch.testing.assert_close(model[k], base_model[k], rtol=1e-4, atol=2e-5, msg=k)
    assert (tmp_path / "fsdp2" / "checkpoints" / f"dcp-{STEPS:08d}").is_dir()

    exported = export(tmp_path / "fsdp2", tmp_path / "exported", say=_quiet)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    eos = manifest["tokenizer"]["eos_id"]
    assert len(tok) == 512 and tok.eos_token_id == eos
    assert loaded.config.eos_token_id == loaded.generation_config.eos_token_id == eos
    ours = build_model(ModelConfig(kind="hf", hf_config=str(configs["llama"])), manifest, 32)
    assert isinstance(ours, HFCausalLM)
    ours.load_state_dict(base_model)
    x = tok("In the beginning God created the heaven", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = float((ours.eval()(x) - loaded(input_ids=x).logits).abs().max())
    assert diff <= 1e-4  # the FSDP2 run equals the one-process run to 2e-5 per tensor

    over_ft = [*CFG, "model.kind=hf", f"model.init_from={exported}", "run.max_steps=4"]
    xb, yb = _first_batch(shards, load_config(None, over_ft))
    with torch.no_grad():
        want = float(loss_fn(loaded(input_ids=xb).logits, yb))
    _run(shards, tmp_path / "continued", over_ft)
    first = logged_losses(tmp_path / "continued")[1]
    assert first == pytest.approx(want, rel=1e-6)
    assert first < base[1] - 0.5  # it continues from the trained model, not from scratch


def test_bench_train_overhead_tiny_run_and_refusal(
    shards: Path, configs: dict[str, Path], tmp_path: Path
) -> None:
    """The benchmark script end to end on a tiny model: rounds of paired steps, the JSON it
    writes and renders, and an existing --json refused before anything runs."""
    import subprocess
    import sys

    from _faultkit import env

    script = ROOT / "benchmarks" / "bench_train_overhead.py"
    out = tmp_path / "o.json"
    args = [
        sys.executable,
        str(script),
        "--data_path",
        str(shards),
        "--rounds",
        "2",
        "--steps",
        "3",
        "--json",
        str(out),
        f"model.hf_config={configs['llama']}",
        "data.seq_len=32",
        "data.batch_size=8",
        "monitoring.tensorboard=false",
    ]
    done = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 2 and all(
        r["bare_s"] > 0 and r["system_s"] > 0 for r in data["rounds"]
    )
    assert data["median_ratio"] == pytest.approx(
        sorted(r["ratio"] for r in data["rounds"])[0] / 2
        + sorted(r["ratio"] for r in data["rounds"])[1] / 2
    )
    assert data["status"] == "completed" and data["checkpoint_s"] > 0
    page = subprocess.run(
        [sys.executable, str(script), "--render", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert page.returncode == 0 and "Median ratio system / bare" in page.stdout
    again = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "exists" in again.stderr


def test_the_overhead_results_page_is_generated_from_its_json() -> None:
    """docs/results/train_overhead.md is the benchmark's rendering of the committed JSON,
    and the JSON's summary is what its rounds say."""
    import importlib.util
    import statistics

    spec = importlib.util.spec_from_file_location(
        "bench_train_overhead", ROOT / "benchmarks" / "bench_train_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = json.loads((ROOT / "docs" / "results" / "train_overhead.json").read_text())
    assert (ROOT / "docs" / "results" / "train_overhead.md").read_text() == bench.render(data)
    ratios = [r["system_s"] / r["bare_s"] for r in data["rounds"]]
    assert len(ratios) == 15 and data["median_ratio"] == pytest.approx(statistics.median(ratios))
    total = sum(r["system_s"] for r in data["rounds"]) / sum(r["bare_s"] for r in data["rounds"])
    assert data["total_ratio"] == pytest.approx(total)
    assert data["met"] == (data["median_ratio"] <= data["target"] == 1.05)
    # no machine paths: repository files are named relative to the repository
    assert not any(o.split("=", 1)[-1].startswith("/") for o in data["overrides"])
