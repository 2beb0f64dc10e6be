"""``rootopt export RUN_DIR OUT_DIR``: a run's newest valid checkpoint as a Hugging Face
model directory (docs/models.md, "From your text to a Hugging Face model").

OUT_DIR gets ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer's files, so that ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and
``AutoTokenizer.from_pretrained(OUT_DIR)`` load it offline. The built-in Llama becomes a
``LlamaForCausalLM`` (:func:`rootopt.train.hf.llama_to_hf`); a ``model.kind=hf`` run its
own architecture, from the config its checkpoint records. Checkpoints of both formats are
read in this process (``dcp-*`` resharded to whole tensors).

Everything is checked before the first write: OUT_DIR must be missing or empty, the run
must hold a valid checkpoint and the tokenizer. The directory is then written as a hidden
sibling, loaded back with ``transformers`` and its logits compared with rootopt's own
model, and only then renamed into place: a kill leaves no half export under OUT_DIR (at
most a hidden ``.OUT_DIR.partial-*`` sibling), and a mismatch publishes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rootopt._atomic import atomic_write, fsync_dir
from rootopt.checkpoint import CheckpointUnreadable
from rootopt.config import ModelConfig
from rootopt.train.hf import SOURCE_FILE

# The run directory's copy of the tokenizer's files, written when a run starts, so an
# export does not depend on the data directory staying where it was.
TOKENIZER_DIR = "tokenizer"
# Largest logit difference the export accepts between rootopt's model and the reloaded
# transformers model (float32; the tests hold the two to 1e-5).
LOGIT_TOLERANCE = 1e-4


class ExportError(ValueError):
    """A run or target that cannot be exported (one line, exit status 2)."""


class ExportMismatch(RuntimeError):
    """The reloaded model's logits differ from rootopt's (a defect; exit status 1)."""


def _check_target(out_dir: Path) -> None:
    if out_dir.is_symlink() and not out_dir.exists():
        raise ExportError(f"{str(out_dir)!r} is a broken symbolic link; name a new directory")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ExportError(f"{str(out_dir)!r} exists and is not a directory")
        if any(out_dir.iterdir()):
            raise ExportError(
                f"{str(out_dir)!r} exists and is not empty; export into a new directory "
                "(nothing was written)"
            )


def _ckpt_dir(run_dir: Path) -> Path:
    """The run's checkpoint directory (``checkpoint.dir`` of its config.yaml, else
    ``checkpoints/``)."""
    try:
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        d = cfg["checkpoint"]["dir"]
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        d = ""
    return Path(d) if isinstance(d, str) and d else run_dir / "checkpoints"


def _newest(run_dir: Path) -> tuple[Any, dict[str, Any]]:
    from rootopt.train import ckpts

    if not run_dir.is_dir():
        raise ExportError(f"{str(run_dir)!r} is not a directory (a run directory of rootopt train)")
    if not (run_dir / "run.json").is_file():
        raise ExportError(f"{str(run_dir)!r} is not a rootopt run directory (no run.json)")
    ckpt_dir = _ckpt_dir(run_dir)
    try:
        found, skipped, _ = ckpts.newest_readable(ckpt_dir)
    except CheckpointUnreadable as exc:
        raise ExportError(f"cannot export: {exc}") from None
    if found is None:
        why = f" ({len(skipped)} invalid: {skipped[-1]})" if skipped else ""
        raise ExportError(f"{str(run_dir)!r} holds no valid checkpoint to export{why}")
    return found.entry, found.state


def _model_config(saved: dict[str, Any]) -> ModelConfig:
    """The run's model settings as recorded (not re-validated: the files they named may
    have moved since; the checkpoint holds what the export needs)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


def tokenizer_files(run_dir: Path, state: dict[str, Any]) -> dict[str, bytes]:
    """The tokenizer's files: the run directory's copy, else from the data the checkpoint
    names (runs started before the copy existed)."""
    own = run_dir / TOKENIZER_DIR
    if own.is_dir():
        files = {p.name: p.read_bytes() for p in sorted(own.iterdir()) if p.is_file()}
        if files:
            return files
    from rootopt.data import load_manifest
    from rootopt.data.tokenizer import hf_files

    where = (state.get("data") or {}).get("path")
    if not where:
        raise ExportError(f"{str(run_dir)!r} holds no tokenizer/ and its checkpoint names no data")
    try:
        manifest = load_manifest(where)
        got: dict[str, bytes] = hf_files(Path(where), manifest)
        return got
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"cannot export: the tokenizer is not in {str(own)!r} and the run's data "
            f"{where!r} cannot be read ({str(exc).splitlines()[0][:120]})"
        ) from None


def _model_weights(entry: Any, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    if entry.kind == "pt":
        weights = state.get("model")
        if not isinstance(weights, dict):
            raise ExportError(f"{entry.name} holds no model weights")
        return weights
    from rootopt.distributed import checkpoint as dcp

    try:
        return dcp.load_full_model_state(entry.path)
    except dcp.DistCheckpointError as exc:
        raise ExportError(f"cannot export: {exc}") from None


def _source(run_dir: Path, entry: Any, state: dict[str, Any]) -> bytes:
    """Where the export comes from (``rootopt.json``): what ``model.init_from`` checks the
    tokenizer against and names when a run starts from it."""
    import json

    from rootopt.data import identity_tokenizer
    from rootopt.train.hf import source_record

    try:
        run_id = str(json.loads((run_dir / "run.json").read_text(encoding="utf-8"))["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        run_id = ""
    ident = (state.get("data") or {}).get("identity")
    tok = identity_tokenizer(ident) if isinstance(ident, str) else {"kind": "bytes"}
    return source_record(run_dir, run_id, entry.name, int(entry.step), tok)


def _tokenizer_ids(directory: Path) -> tuple[Any, dict[str, int | None]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    ids = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    return tok, ids


def _build(
    mcfg: ModelConfig,
    state: dict[str, Any],
    weights: dict[str, torch.Tensor],
    seq_len: int,
    ids: dict[str, int | None],
) -> tuple[Any, nn.Module]:
    """``(the transformers model holding the weights, rootopt's own model)``."""
    from transformers import AutoModelForCausalLM

    from rootopt.train.hf import HFCausalLM, hf_config_object, llama_hf_spec, llama_to_hf
    from rootopt.train.model import LlamaLM

    if mcfg.kind == "llama":
        vocab = int(weights["embed.weight"].shape[0])
        ours: nn.Module = LlamaLM(dataclasses.replace(mcfg, vocab_size=vocab), seq_len)
        ours.load_state_dict(weights)
        spec = llama_hf_spec(mcfg, vocab, seq_len, ids)
        mapped = llama_to_hf(weights, mcfg)
    else:
        recorded = state.get("hf_config")
        if not isinstance(recorded, dict):
            raise ExportError("the checkpoint records no transformers config (model.kind=hf)")
        spec = dict(recorded)
        mapped = {k.removeprefix("hf."): v for k, v in weights.items()}
    config = hf_config_object(spec, "export")
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    missing, unexpected = hf.load_state_dict(mapped, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        bad = sorted(set(missing) - tied) or sorted(unexpected)
        raise ExportError(
            f"cannot export: the checkpoint's weights do not fit {type(hf).__name__} "
            f"({bad[0]!r}{' and more' if len(bad) > 1 else ''})"
        )
    if mcfg.kind == "hf":
        ours = HFCausalLM(hf, spec)
    return hf, ours


@torch.no_grad()
def _compare(directory: Path, ours: nn.Module, vocab: int, seq_len: int) -> float:
    """Largest |logit| difference between rootopt's model and the directory loaded back
    with ``AutoModelForCausalLM.from_pretrained`` (float32, two random sequences)."""
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    loaded.eval()
    ours.eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, min(seq_len, 32)), generator=g)
    theirs = loaded(input_ids=tokens, use_cache=False).logits
    return float((ours(tokens) - theirs).abs().max())


def export(run_dir: Path, out_dir: Path, *, say: Callable[[str], None] = print) -> Path:
    """Write the newest valid checkpoint of ``run_dir`` as a Hugging Face model directory
    ``out_dir`` (see the module docstring); :class:`ExportError` for what the user can fix."""
    _check_target(out_dir)
    entry, state = _newest(run_dir)
    try:
        saved = state["config"]
        mcfg = _model_config(saved["model"])
        seq_len = int(saved["data"]["seq_len"])
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{entry.name}: holds no model or data settings") from None
    if mcfg.kind == "mlp":
        raise ExportError(
            f"{entry.name}: a classifier (model.kind=mlp) has no Hugging Face causal-LM form"
        )
    files = tokenizer_files(run_dir, state)
    weights = _model_weights(entry, state)
    _quiet_transformers()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        for name, data in files.items():
            atomic_write(tmp / name, data)
        atomic_write(tmp / SOURCE_FILE, _source(run_dir, entry, state))
        _tok, ids = _tokenizer_ids(tmp)
        hf, ours = _build(mcfg, state, weights, seq_len, ids)
        hf.save_pretrained(str(tmp))
        vocab = int(hf.get_input_embeddings().weight.shape[0])
        diff = _compare(tmp, ours, vocab, seq_len)
        if not diff <= LOGIT_TOLERANCE:
            raise ExportMismatch(
                f"cannot export: transformers' {type(hf).__name__} differs from rootopt's model "
                f"by {diff:.3g} in the logits (allowed {LOGIT_TOLERANCE:g}); nothing was published"
            )
        for p in tmp.iterdir():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        _check_target(out_dir)  # still missing or empty (another process may have written)
        try:
            os.rename(tmp, out_dir)
        except OSError as exc:
            raise ExportError(
                f"cannot publish {str(out_dir)!r} ({exc.strerror or exc}); nothing was written there"
            ) from None
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(p.numel() for p in hf.parameters())
    say(
        f"exported {entry.name} (step {entry.step}) of {run_dir} to {out_dir}: "
        f"{type(hf).__name__}, {n / 1e6:.2f} M parameters, vocabulary {vocab}; logits equal "
        f"rootopt's within {diff:.1e}; load with AutoModelForCausalLM.from_pretrained("
        f"{str(out_dir)!r}) and AutoTokenizer.from_pretrained({str(out_dir)!r})"
    )
    return out_dir


def _quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on the export's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def write_tokenizer_copy(run_dir: Path, files: dict[str, bytes]) -> None:
    """The run directory's copy of the tokenizer (:data:`TOKENIZER_DIR`), each file atomic."""
    d = run_dir / TOKENIZER_DIR
    d.mkdir(exist_ok=True)
    for name, data in files.items():
        if Path(name).name != name:
            raise ValueError(f"tokenizer file name {name!r} is not a plain file name")
        if (d / name).is_file() and (d / name).read_bytes() == data:
            continue
        atomic_write(d / name, data)


__all__ = ["ExportError", "ExportMismatch", "export", "write_tokenizer_copy"]
