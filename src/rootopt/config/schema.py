"""Typed, component-owned run configuration.

One dataclass per component; each field carries its range/help in ``metadata``. Validation
lives in :mod:`rootopt.config.load` and reports every problem as one line. The section and
key names of the deployment example (``distributed`` / ``optimization`` /
``mixed_precision`` with ``base_lr``, ``warmup_steps``, ``beta1``, ``beta2``, ``epsilon``,
``loss_scale`` …) are kept verbatim so that its YAML loads as written (docs/training.md,
"Configuration").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def _f(default: Any, help: str, **rules: Any) -> Any:
    """A dataclass field with a default, a help string and validation rules.

    Rules: ``min`` / ``max`` (inclusive), ``gt`` (exclusive lower bound).
    """
    return field(default=default, metadata={"help": help, **rules})


@dataclass
class RunConfig:
    name: str = _f(
        "rootopt", "run name (metric labels; names the default run directory when changed)"
    )
    seed: int = _f(0, "global random seed", min=0, max=2**63 - 1)
    max_steps: int = _f(300, "optimizer steps to train", min=1, max=10**10)
    max_time: float = _f(
        0.0,
        "wall-clock limit of one session in seconds; 0 = none (checkpoint and stop when hit; rerun to continue)",
        min=0,
        max=10**8,
    )
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "device; auto = cuda when available")
    peak_tflops: float = _f(
        0.0,
        "peak dense TFLOP/s of one device in the training dtype, for the mfu metric; 0 = a "
        "table of known GPUs, or measured once at start on a CPU (docs/monitoring.md)",
        min=0,
        max=1e7,
    )
    threads: int = _f(
        1,
        "torch intra-op threads; 0 = torch default. 1 stays fast on a shared CPU; keep it fixed across a resume for bit-identical results",
        min=0,
        max=4096,
    )
    log_every: int = _f(10, "steps between metric records", min=1, max=10**9)
    eval_every: int = _f(
        100, "steps between validation passes; 0 = only at the end", min=0, max=10**10
    )
    eval_batches: int = _f(8, "validation batches per pass", min=1, max=10**7)
    max_nonfinite: int = _f(
        20,
        "stop as diverged after this many consecutive non-finite (skipped) steps; 0 = never",
        min=0,
        max=10**9,
    )
    max_nonfinite_total: int = _f(
        200, "stop as diverged after this many non-finite steps in total; 0 = never", min=0
    )
    loss_spike_factor: float = _f(
        3.0,
        "stop as diverged when the loss stays above factor × the median of the previous "
        "loss_spike_window steps for loss_spike_patience steps; 0 = off",
        min=0,
    )
    loss_spike_window: int = _f(50, "steps in the loss-spike rule's median", min=2, max=10**6)
    loss_spike_patience: int = _f(
        10, "consecutive spiking steps before the loss-spike rule stops the run", min=1
    )


@dataclass
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = _f(
        "auto", "collective backend (auto: nccl on CUDA, gloo on CPU)"
    )
    init_method: str = _f("env://", "process-group init method")
    rank: int = _f(0, "this process's rank (the launcher's RANK env var wins)", min=0)
    world_size: int = _f(
        1, "number of processes (the launcher's WORLD_SIZE env var wins)", min=1, max=1 << 20
    )
    timeout_s: float = _f(1800.0, "collective timeout in seconds", gt=0)
    rendezvous_timeout_s: float = _f(
        120.0,
        "seconds to wait at start for every rank to join the process group; a missing peer "
        "then fails with one line",
        gt=0,
    )
    parallel: Literal["ddp", "fsdp"] = _f(
        "ddp",
        "data parallelism at world size > 1: ddp (replicated; ROOT and Muon synchronise the "
        "gradients in the optimizer, other optimizers run under DDP) or fsdp (FSDP2, sharded)",
    )


@dataclass
class ModelConfig:
    kind: Literal["llama", "hf", "mlp"] = _f(
        "llama",
        "llama: the built-in causal LM; hf: a transformers causal LM (model.hf_config); "
        "mlp: classifier",
    )
    hf_config: str = _f(
        "",
        "kind=hf: a transformers config.json (or a directory holding one); empty = "
        "model.init_from's config.json",
    )
    init_from: str = _f(
        "",
        "a Hugging Face model directory whose safetensors weights a new run starts from "
        "(ignored when resuming a checkpoint)",
    )
    vocab_size: int = _f(
        0,
        "vocabulary size; 0 = the data's tokenizer's (a larger one may be named, never a "
        "smaller one)",
        min=0,
        max=1 << 24,
    )
    d_model: int = _f(128, "hidden width", min=8, max=1 << 16)
    n_layers: int = _f(4, "transformer blocks", min=1, max=1024)
    n_heads: int = _f(4, "attention heads", min=1, max=1024)
    n_kv_heads: int = _f(2, "key/value heads (grouped-query attention); must divide n_heads", min=1)
    ffn_hidden: int = _f(
        0, "SwiGLU hidden width; 0 = 8/3·d_model rounded to 32", min=0, max=1 << 18
    )
    rope_theta: float = _f(10000.0, "RoPE base", gt=0)
    norm_eps: float = _f(1e-5, "RMSNorm epsilon", gt=0)
    tie_embeddings: bool = _f(True, "share input embedding and output head")
    init_std: float = _f(0.02, "weight init std", gt=0)
    mlp_hidden: int = _f(256, "hidden width of the mlp classifier", min=1, max=1 << 18)
    activation_checkpointing: bool = _f(
        False, "recompute block activations in backward to save memory"
    )


@dataclass
class DataConfig:
    path: str = _f(
        "", "prepared shard directory (manifest.json); empty = prepare `corpus` into the run dir"
    )
    corpus: str = _f(
        "stdlib",
        "stdlib | bbc | kjv | digits | bbc-classes | a text file, a .jsonl file (one document "
        "per line) or a directory of them",
    )
    tokenizer: str = _f(
        "bytes",
        "bytes (one id per byte) | bpe:N (a byte-level BPE of N ids trained on the corpus) | "
        "the path of a tokenizer.json (docs/data.md, Your own data)",
    )
    text_field: str = _f("text", "the field of a .jsonl line that holds the document's text")
    max_bytes: int = _f(
        4_000_000,
        "bytes of corpus text to tokenize when preparing; 0 = all of it",
        min=0,
        max=1 << 40,
    )
    seq_len: int = _f(128, "tokens per training sequence", min=2, max=1 << 20)
    samples_per_shard: int = _f(2000, "samples per .tar shard when preparing", min=1, max=1 << 30)
    val_fraction: float = _f(0.05, "fraction of shards held out for validation", min=0, max=0.5)
    batch_size: int = _f(
        16,
        "sequences per micro-batch over all ranks (the global batch; split across ranks)",
        min=1,
        max=1 << 24,
    )
    num_workers: int = _f(0, "data-loader worker processes", min=0, max=256)
    shuffle: bool = _f(True, "shuffle shard order and samples within a shard each epoch")
    verify_checksums: bool = _f(
        True, "check each shard's sha256 against the manifest before reading"
    )


@dataclass
class ClipConfig:
    mode: Literal["norm", "value", "adaptive", "none"] = _f(
        "norm", "gradient clipping mode (docs/training.md: Schedules, clipping)"
    )
    max_norm: float = _f(1.0, "global-norm threshold (norm/adaptive)", gt=0)
    value: float = _f(1.0, "per-element threshold (value)", gt=0)
    adaptive_beta: float = _f(
        0.98, "EMA factor of the running grad norm (adaptive)", min=0, max=0.9999
    )
    adaptive_factor: float = _f(2.0, "clip at factor × running norm (adaptive)", gt=0)


@dataclass
class OptimizationConfig:
    optimizer: str = _f(
        "ROOT", "ROOT | AdamW | Adam | SGD | Muon | LAMB | Shampoo (case-insensitive)"
    )
    base_lr: float = _f(6e-3, "peak learning rate", gt=0)
    warmup_steps: int = _f(30, "linear warmup steps", min=0, max=10**10)
    schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "decay after warmup")
    min_lr_ratio: float = _f(0.1, "final lr as a fraction of base_lr (cosine/linear)", min=0, max=1)
    beta1: float = _f(
        0.9, "AdamW β1 (ROOT's internal AdamW and Adam-family optimizers)", min=0, max=0.99999
    )
    beta2: float = _f(0.95, "AdamW β2", min=0, max=0.99999)
    epsilon: float = _f(1e-8, "AdamW ε", gt=0)
    weight_decay: float = _f(0.1, "decoupled weight decay", min=0)
    momentum: float = _f(0.95, "ROOT/Muon/SGD momentum", min=0, max=0.99999)
    nesterov: bool = _f(True, "Nesterov momentum (ROOT)")
    ns_steps: int = _f(5, "Newton–Schulz iterations (ROOT)", min=1, max=20)
    ns_coefficients: str = _f(
        "muon",
        "Newton–Schulz coefficient preset (ROOT; default chosen in docs/benchmarks.md)",
    )
    ns_dtype: Literal["auto", "bfloat16", "float32"] = _f(
        "auto",
        "Newton–Schulz iteration dtype (ROOT; docs/optimizer.md): auto = bfloat16 where the "
        "device multiplies it natively (CUDA; x86 CPUs with AVX-512 BF16 or AMX), float32 "
        "elsewhere",
    )
    outlier_quantile: float = _f(
        0.9,
        "soft-threshold quantile (ROOT; a coefficient 0.1 = top 10% as outliers ⇔ 0.9)",
        gt=0,
        max=1,
    )
    lr_scale: Literal["moonlight", "muon", "none"] = _f("moonlight", "ROOT lr scaling rule")
    ortho_method: Literal["newton_schulz", "svd", "qr"] = _f(
        "newton_schulz", "ROOT orthogonalization (svd = exact UVᵀ, slower)"
    )
    telemetry: bool = _f(
        True, "collect ROOT's per-matrix telemetry (ε, clip fraction, update ratio)"
    )
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step", min=1, max=1 << 20)
    controller: str = _f(
        "",
        "learned lr/quantile controller: a policy dir from 'rootopt rl train' (extra [rl]); '' = none",
    )
    clip: ClipConfig = field(default_factory=ClipConfig)


@dataclass
class MixedPrecisionConfig:
    enabled: bool | Literal["auto"] = _f(
        False,
        "autocast the forward pass: true, false, or auto = on CUDA only (a CPU without "
        "native bfloat16 runs bf16 autocast several times slower than fp32: docs/training.md)",
    )
    dtype: Literal["auto", "bf16", "fp16"] = _f("auto", "auto: fp16 on CUDA, bf16 on CPU")
    loss_scale: str = _f(
        "dynamic", "fp16 loss scaling: 'dynamic' (GradScaler) or a static number such as 8192"
    )
    init_scale: float = _f(65536.0, "dynamic scaler's initial scale (2^16)", gt=0)
    growth_interval: int = _f(2000, "overflow-free steps before the scale grows", min=1)
    growth_factor: float = _f(2.0, "scale growth factor", gt=1)
    backoff_factor: float = _f(0.5, "scale backoff factor on overflow", gt=0, max=0.999)


@dataclass
class CheckpointConfig:
    every: int = _f(
        100,
        "steps between checkpoints: a killed or restarted run loses at most this many "
        "(docs/training.md, 'Checkpoints and resume')",
        min=1,
        max=10**10,
    )
    keep_last: int = _f(3, "checkpoints of this run to keep", min=1, max=10**6)
    dir: str = _f("", "checkpoint directory; empty = <log_dir>/checkpoints")
    resume: str = _f(
        "auto",
        "auto = newest valid checkpoint in dir; never (refused on a directory that holds "
        "checkpoints); restart = move the old run aside into <log_dir>/previous/ and start over; "
        "or a checkpoint file",
    )
    on_signal: bool = _f(True, "checkpoint and stop on SIGTERM/SIGINT")


@dataclass
class PrometheusConfig:
    enabled: bool = _f(False, "serve metrics over HTTP for Prometheus")
    host: str = _f("127.0.0.1", "bind address")
    port: int = _f(9464, "port; 0 = ephemeral", min=0, max=65535)


@dataclass
class MonitoringConfig:
    jsonl: bool = _f(True, "write metrics.jsonl")
    tensorboard: bool = _f(True, "write TensorBoard scalars and histograms")
    histogram_every: int = _f(
        100, "steps between TensorBoard histograms; 0 = never", min=0, max=10**10
    )
    progress_bar: bool = _f(True, "show a progress bar")
    plot: bool = _f(True, "write loss_curve.png at the end")
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
