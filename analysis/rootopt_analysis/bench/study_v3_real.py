"""The real-model cell of the defaults study v3 (docs/benchmarks.md, v3 "Real-model cell").

A ``transformers`` Llama trained with ``rootopt train`` as a user would, on BPE tokens of
CPython's standard-library source, and scored on held-out files through ``rootopt export``
and ``transformers``. Two job kinds, both resumable: :class:`DataJob` (split the corpus by a
hash of each file's path, then ``rootopt data prepare`` with ``--tokenizer bpe:8192`` for
training and validation and with the resulting ``tokenizer.json`` for the test files) and
:class:`TrainJob` (one ``rootopt train`` run; a run killed midway resumes from its last
checkpoint when the study asks for it again). Their records go to the study's
``timing.jsonl`` (it holds every record that is not a :class:`RunSpec` run).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rootopt_analysis.bench.study import Arm
    from rootopt_analysis.bench.study_v3 import WalkV3

Result = dict[str, Any]
CELL = "llama-bpe@1000"
DIR = "llama-bpe"  # under the study directory
VOCAB = 8192
SEQ, BATCH, STEPS, WARMUP = 128, 8, 1000, 100
EVAL_EVERY, EVAL_BATCHES = 100, 64
TEST_PERCENT = 5
SELECT_SEED, REPORT_SEEDS = 100, (400, 401, 402)
# lr grids per optimizer (rootopt train's optimization.optimizer), extended once by x2 / /2
LR_GRID = {"ROOT": (2e-3, 4e-3, 8e-3), "Muon": (2e-3, 4e-3, 8e-3), "AdamW": (1e-3, 2e-3, 4e-3)}
# the model: a transformers LlamaForCausalLM (docs/benchmarks.md, v3)
HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 672,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}
P_REAL = 20


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class DataJob:
    vocab: int = VOCAB
    seq_len: int = SEQ
    test_percent: int = TEST_PERCENT
    task: str = "llama-bpe"

    @property
    def run_id(self) -> str:
        return f"llama-bpe-data-{_digest(asdict(self))}"


@dataclass(frozen=True)
class TrainJob:
    arm: str  # the study's arm name
    optimizer: str  # rootopt train's optimization.optimizer
    options: tuple[tuple[str, Any], ...]  # optimization.* overrides (ROOT's options)
    lr: float
    seed: int
    role: str  # "selection" | "report"
    data: str  # the DataJob's run id
    steps: int = STEPS
    task: str = "llama-bpe"

    @property
    def run_id(self) -> str:
        d = asdict(self)
        d.pop("role")
        return f"llama-bpe-{self.optimizer}-lr{self.lr:g}-s{self.seed}-{_digest(d)}"

    def overrides(self, config: Path) -> list[str]:
        return [
            "model.kind=hf",
            f"model.hf_config={config}",
            f"run.max_steps={self.steps}",
            f"run.seed={self.seed}",
            "run.threads=1",
            "run.log_every=50",
            f"run.eval_every={EVAL_EVERY}",
            f"run.eval_batches={EVAL_BATCHES}",
            f"data.batch_size={BATCH}",
            f"data.seq_len={SEQ}",
            f"optimization.optimizer={self.optimizer}",
            f"optimization.base_lr={self.lr:g}",
            f"optimization.warmup_steps={WARMUP}",
            "optimization.schedule=cosine",
            "optimization.min_lr_ratio=0.1",
            f"checkpoint.every={EVAL_EVERY}",
            "checkpoint.keep_last=1",
            "monitoring.progress_bar=false",
            "monitoring.plot=false",
            *(f"optimization.{k}={'null' if v is None else v}" for k, v in self.options),
        ]


# ----------------------------------------------------------------------------- the walk


def _train_arms(default: Arm) -> list[tuple[str, str, tuple[tuple[str, Any], ...]]]:
    """(arm, rootopt train optimizer, optimization.* overrides)."""
    from rootopt_analysis.bench.study import arm_by_name

    opts = dict(default.options)
    root = tuple(
        (k, opts[k]) for k in ("ns_coefficients", "ns_dtype", "outlier_quantile") if k in opts
    )
    return [
        (default.name, "ROOT", root),
        (arm_by_name("muon-bf16").name, "Muon", ()),
        (arm_by_name("adamw").name, "AdamW", ()),
    ]


def _score(r: Result) -> float:
    v = r.get("final_val_loss")
    return (
        float(v)
        if isinstance(v, (int, float)) and math.isfinite(v) and not r["diverged"]
        else math.inf
    )


def walk(w: WalkV3, default: Arm, timing_lookup: Any) -> None:
    """Ask for the data, then each arm's lr selection, then its report seeds."""
    b = w.base
    data = DataJob()
    got = timing_lookup(data.run_id)
    w.real = {"cell": CELL, "data": got, "arms": {}}
    if got is None:
        b.need((P_REAL, 0), [data])
        return
    for i, (arm, optimizer, options) in enumerate(_train_arms(default)):
        entry: dict[str, Any] = {"optimizer": optimizer, "options": dict(options), "selection": {}}
        w.real["arms"][arm] = entry
        grid = list(LR_GRID[optimizer])

        def job(
            lr: float, seed: int, role: str, a: str = arm, o: str = optimizer, op: Any = options
        ) -> TrainJob:
            return TrainJob(a, o, op, lr, seed, role, data.run_id)

        for _ in range(2):  # the grid, then (at most) one extension past an edge
            results = {lr: timing_lookup(job(lr, SELECT_SEED, "selection").run_id) for lr in grid}
            missing = [job(lr, SELECT_SEED, "selection") for lr, r in results.items() if r is None]
            if missing:
                b.need((P_REAL, 1, i), missing)
                break
            entry["selection"] = {f"{lr:g}": r for lr, r in results.items()}
            best = min(grid, key=lambda lr: (_score(results[lr]), lr))
            if len(grid) == 3 and best in (grid[0], grid[-1]):
                grid = [best / 2, *grid] if best == grid[0] else [*grid, best * 2]
                continue
            entry["lr"] = best
            break
        if "lr" not in entry:
            continue
        jobs = [job(entry["lr"], sd, "report") for sd in REPORT_SEEDS]
        reports = [timing_lookup(j.run_id) for j in jobs]
        if any(r is None for r in reports):
            b.need((P_REAL, 2, i), [j for j, r in zip(jobs, reports, strict=True) if r is None])
        else:
            entry["report"] = reports


# ----------------------------------------------------------------------------- running


def _rootopt(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "rootopt.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def run_data(job: DataJob, out_dir: str) -> Result:
    """Split the corpus and prepare both datasets (idempotent: a finished prepare is kept)."""
    from rootopt._atomic import atomic_write

    here = Path(out_dir) / DIR
    here.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[str]] = {"train": [], "test": []}
    sizes = {"train": 0, "test": 0}
    for path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = str(path.relative_to(root))
        split = (
            "test"
            if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < job.test_percent
            else "train"
        )
        parts[split].append(json.dumps({"text": text}))
        sizes[split] += len(text.encode("utf-8"))
    for split, lines in parts.items():
        atomic_write(here / f"corpus-{split}.jsonl", ("\n".join(lines) + "\n").encode())
    out: Result = {"run_id": job.run_id, "kind": "real-data", "job": asdict(job)}
    steps = (
        ("data", ["--corpus", "corpus-train.jsonl", "--tokenizer", f"bpe:{job.vocab}"]),
        (
            "test",
            [
                "--corpus",
                "corpus-test.jsonl",
                "--tokenizer",
                "data/tokenizer.json",
                "--val_fraction",
                "0",
            ],
        ),
    )
    for name, args in steps:
        if not (here / name / "manifest.json").is_file():
            done = _rootopt(
                "data", "prepare", *args, "--out", name, "--seq_len", str(job.seq_len),
                "--seed", "0", "--no-progress", cwd=here,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"data prepare {name}: {done.stderr.strip()[-500:]}")
        manifest = json.loads((here / name / "manifest.json").read_text())
        out[name] = {
            "text_bytes": sizes["train" if name == "data" else "test"],
            "files": len(parts["train" if name == "data" else "test"]),
            "splits": {
                s: sum(int(e["samples"]) for e in es) for s, es in manifest["splits"].items()
            },
            "tokenizer_sha256": (manifest.get("tokenizer") or {}).get("sha256"),
            "manifest_text_bytes": manifest.get("text_bytes"),
            "manifest_tokens": manifest.get("tokens"),
        }
    atomic_write(Path(out_dir) / "timing" / f"{job.run_id}.json", json.dumps(out).encode())
    return out


def test_loss(model_dir: Path, test_dir: Path) -> tuple[float, int]:
    """Mean cross-entropy (nats per token) of the model ``rootopt export`` wrote over every
    test sample, and the number of tokens scored; through ``transformers`` alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from rootopt.data.shards import ShardSamples, collate

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()  # type: ignore[no-untyped-call]
    samples = ShardSamples(test_dir, "train", shuffle=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(samples), 32):
            items = [samples[i] for i in range(start, min(start + 32, len(samples)))]
            batch = collate(items, samples.task)
            logits = model(input_ids=batch["input"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), batch["target"].flatten(), reduction="sum"
            )
            total += float(loss)
            count += batch["target"].numel()
    return total / count, count


def run_train(job: TrainJob, out_dir: str) -> Result:
    """One ``rootopt train`` run (resumed if an earlier attempt was killed), its test loss
    through ``rootopt export`` and ``transformers``; the checkpoints are removed after."""
    from rootopt._atomic import atomic_write
    from rootopt._threads import one_thread
    from rootopt.monitor import read_jsonl
    from rootopt_analysis.provenance import instruction_set

    started = time.time()
    here = Path(out_dir) / DIR
    config = here / "llama.json"
    if not config.is_file():
        atomic_write(config, json.dumps(HF_CONFIG, indent=1).encode())
    run = here / "runs" / job.run_id
    c0 = time.perf_counter()
    done = _rootopt(
        "train", "--data_path", "data", "--log_dir", str(run.relative_to(here)),
        *job.overrides(Path("llama.json")), cwd=here,
    )  # fmt: skip
    wall = time.perf_counter() - c0
    rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    evals = [(r["step"], r["val_loss"]) for r in rows if isinstance(r.get("val_loss"), float)]
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), float)]
    summary = (
        json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    )
    finished = done.returncode == 0 and summary.get("status") == "completed"
    result: Result = {
        "run_id": job.run_id,
        "kind": "real-model",
        "job": {**asdict(job), "options": [list(kv) for kv in job.options]},
        "diverged": not finished,
        "error": "" if finished else (done.stderr.strip().splitlines() or ["?"])[-1][:300],
        "final_val_loss": evals[-1][1]
        if finished and evals and evals[-1][0] == job.steps
        else math.nan,
        "val_curve": {"step": [s for s, _ in evals], "val_loss": [v for _, v in evals]},
        "train_loss_first_last": [losses[0], losses[-1]] if losses else None,
        "wall_s": wall,
        "started": started,
        "machine": instruction_set(),
    }
    if finished and job.role == "report":
        export = here / "exports" / job.run_id
        if export.exists():
            shutil.rmtree(export)
        ex = _rootopt("export", str(run.relative_to(here)), str(export.relative_to(here)), cwd=here)
        if ex.returncode != 0:
            raise RuntimeError(f"export: {ex.stderr.strip()[-500:]}")
        with one_thread():
            loss, tokens = test_loss(export, here / "test")
        result["final_test_loss"] = loss
        result["test_tokens"] = tokens
        shutil.rmtree(export)
    for ckpts in (run / "checkpoints",):
        if finished and ckpts.is_dir():
            shutil.rmtree(ckpts)  # the study's own checkpoints; the metrics stay
    result["ended"] = time.time()
    atomic_write(Path(out_dir) / "timing" / f"{job.run_id}.json", json.dumps(result).encode())
    return result


def run_job(job: DataJob | TrainJob, out_dir: str) -> Result:
    if isinstance(job, DataJob):
        return run_data(job, out_dir)
    return run_train(job, out_dir)
