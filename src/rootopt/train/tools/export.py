"""``rootopt export RUN_DIR OUT_DIR``: a run's newest valid checkpoint as a Hugging Face
model directory (docs/models.md, "From your text to a Hugging Face model").

OUT_DIR gets ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer's files, so that ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and
``AutoTokenizer.from_pretrained(OUT_DIR)`` load it offline. The built-in Llama becomes a
``LlamaForCausalLM``
(:func:`rootopt.train.models.transformers_lm.llama_to_hf`); a ``model.kind=hf`` run its own
architecture, from the config its checkpoint records. Checkpoints of both formats are
read in this process (``dcp-*`` resharded to whole tensors). The tokenizer's files are
``transformers``' own ``PreTrainedTokenizerFast.save_pretrained`` output for the trained
``tokenizer.json`` and every special token it has
(:func:`rootopt.data.tokenizer.transformers_files`).

Everything is checked before the first write: OUT_DIR must be missing or empty (not a
link, not under a file), the run must hold a valid checkpoint and the tokenizer it was
trained with (the ``tokenizer.json`` whose sha256 the checkpoint records; no link in the
run's ``tokenizer/``). The directory is then written as a hidden sibling, loaded back with
``transformers`` and compared with what was trained: the logits with rootopt's own model,
the token ids of :data:`HELD_OUT` and the special tokens with the trained tokenizer. Only
then is it renamed into place: a kill leaves no half export under OUT_DIR (at most a
hidden ``.OUT_DIR.partial-*`` sibling), and a mismatch publishes nothing. Every file gets
the mode an ordinary ``open()`` gives under the umask (0644 under 022).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rootopt._atomic import LinkError, atomic_write, file_mode, fsync_dir, is_link
from rootopt.checkpoint import CheckpointError, CheckpointUnreadable
from rootopt.config import ModelConfig
from rootopt.train.checkpoint import Checkpointer, Found
from rootopt.train.models.transformers_lm import SOURCE_FILE
from rootopt.train.run.directory import TOKENIZER_DIR

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

# Largest logit difference the export accepts between rootopt's model and the reloaded
# transformers model (float32; the tests hold the two to 1e-5).
LOGIT_TOLERANCE = 1e-4
# The text the export encodes with the trained tokenizer and with what
# AutoTokenizer.from_pretrained(OUT_DIR) loads, which must give the same ids. It holds what
# tokenizers split differently: contractions in both cases, runs of digits, letters after
# punctuation, runs of spaces, tabs and line ends (\n, \r\n, blank lines), code, and text
# outside ASCII composed and decomposed ("é" and "e" + U+0301: a normalizer shows).
HELD_OUT = (
    "It's 2026; they'd counted 650841823 grains (about 6.5e8) in 12 jars. DON'T panic!\n\n"
    "    def f(x):\r\n\treturn {'a': x**2, \"b\": [1, 2, 3]}  # trailing   spaces   \n"
    "Crème brûlée, naïve café, e\u0301, Ελληνικά, русский, 中文字符, 日本語, emoji 🙂👍.\n"
    "(parenthesised)words, hyphen-ated, snake_case, CamelCase, URL https://example.org/a?b=1"
)


class ExportError(ValueError):
    """A run or target that cannot be exported (one line, exit status 2)."""


class ExportMismatch(RuntimeError):
    """The reloaded model or tokenizer differs from what was trained (exit status 1)."""


@dataclasses.dataclass(frozen=True)
class TrainedTokenizer:
    """The tokenizer a run was trained with: its ``tokenizer.json`` text, its special
    tokens (role -> token, ``additional_special_tokens`` -> [tokens]) and where it was read
    (for messages)."""

    text: str
    special: dict[str, Any]
    where: str

    @functools.cached_property
    def tokenizer(self) -> HFTokenizer:
        """The parsed ``tokenizer.json`` (parsed once, on first use)."""
        from rootopt.data.tokenizer import from_json

        return from_json(self.text, self.where)

    def ids(self) -> dict[str, int | None]:
        """The bos/eos/pad ids a model config records."""
        tok = self.tokenizer

        def find(role: str) -> int | None:
            name = self.special.get(role)
            found = tok.token_to_id(name) if isinstance(name, str) else None
            return int(found) if found is not None else None

        return {"bos": find("bos_token"), "eos": find("eos_token"), "pad": find("pad_token")}


def _check_target(out_dir: Path) -> None:
    if is_link(out_dir):
        if not out_dir.exists():
            raise ExportError(f"{str(out_dir)!r} is a broken symbolic link; name a new directory")
        raise ExportError(str(LinkError(out_dir)))
    for above in out_dir.parents:  # the nearest existing one: a directory to create it in
        if above.exists() or is_link(above):
            if not above.is_dir():
                raise ExportError(
                    f"cannot create {str(out_dir)!r}: {str(above)!r} is not a directory"
                )
            break
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ExportError(f"{str(out_dir)!r} exists and is not a directory")
        if any(out_dir.iterdir()):
            raise ExportError(
                f"{str(out_dir)!r} exists and is not empty; export into a new directory "
                "(nothing was written)"
            )


def _newest(run_dir: Path, say: Callable[[str], None]) -> tuple[Checkpointer, Found]:
    """The run's checkpointer and its newest valid checkpoint (saying which newer ones it
    skipped and why)."""
    if not run_dir.is_dir():
        raise ExportError(f"{str(run_dir)!r} is not a directory (a run directory of rootopt train)")
    if not (run_dir / "run.json").is_file():
        raise ExportError(f"{str(run_dir)!r} is not a rootopt run directory (no run.json)")
    checkpointer = Checkpointer.of_run(run_dir)
    try:
        found, skipped = checkpointer.newest(say)
    except CheckpointUnreadable as exc:
        raise ExportError(f"cannot export: {exc}") from None
    if found is None:
        why = f" ({len(skipped)} invalid: {skipped[-1]})" if skipped else ""
        raise ExportError(f"{str(run_dir)!r} holds no valid checkpoint to export{why}")
    return checkpointer, found


def _weights(checkpointer: Checkpointer, found: Found) -> dict[str, torch.Tensor]:
    try:
        return checkpointer.model_state(found)
    except CheckpointError as exc:
        raise ExportError(f"cannot export: {exc}") from None


def _model_config(saved: dict[str, Any]) -> ModelConfig:
    """The run's model settings as recorded (not re-validated: the files they named may
    have moved since; the checkpoint holds what the export needs)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


# --------------------------------------------------------------------------- the tokenizer


def _recorded_tokenizer(state: dict[str, Any]) -> dict[str, Any] | None:
    """The tokenizer the checkpoint's data identity names (kind, spec, vocabulary, sha256
    of its ``tokenizer.json``); None for a checkpoint that records no identity."""
    from rootopt.data import identity_tokenizer

    identity = (state.get("data") or {}).get("identity")
    return identity_tokenizer(identity) if isinstance(identity, str) else None


def _refuse_links(own: Path) -> None:
    """The run's ``tokenizer/`` and everything in it are the run's own files: a symbolic
    link there (to a file of the user's, say) is refused, never read through."""
    try:
        if is_link(own):
            raise LinkError(own)
        if own.is_dir():
            for p in sorted(own.iterdir()):
                if is_link(p):
                    raise LinkError(p)
    except LinkError as exc:
        raise ExportError(f"cannot export: {exc}") from None
    except OSError as exc:
        raise ExportError(f"{str(own)!r} cannot be read ({exc.strerror or exc})") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ExportError(f"{str(path)!r} cannot be read ({exc.strerror or exc})") from None


def _special_map(path: Path) -> dict[str, Any]:
    """The run copy's ``special_tokens_map.json`` ({} without one)."""
    from rootopt.data.tokenizer import EXTRA, ROLES, token_name

    if not path.exists():
        return {}
    try:
        data = json.loads(_read(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{str(path)!r} is not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{str(path)!r} is not a JSON object of special tokens")
    out: dict[str, Any] = {}
    for role in ROLES:
        if data.get(role) is not None:
            name = token_name(data[role])
            if name is None:
                raise ExportError(f"{str(path)!r}: {role} is not a token")
            out[role] = name
    extra = data.get(EXTRA)
    if extra:
        names = [token_name(v) for v in extra] if isinstance(extra, list) else [None]
        if any(n is None for n in names):
            raise ExportError(f"{str(path)!r}: {EXTRA} is not a list of tokens")
        out[EXTRA] = names
    return out


def trained_tokenizer(run_dir: Path, state: dict[str, Any], name: str) -> TrainedTokenizer:
    """The tokenizer checkpoint ``name`` (its ``state``) was trained with: the run
    directory's copy, else the data the checkpoint names (runs started before the copy
    existed), checked against the sha256 the checkpoint records; byte tokens are written
    anew. :class:`ExportError`, naming the file, for anything else."""
    from rootopt.data.tokenizer import (
        BYTES,
        EXTRA,
        FILE_NAME,
        MAP_FILE,
        TokenizerError,
        bytes_tokenizer_json,
    )

    own = run_dir / TOKENIZER_DIR
    _refuse_links(own)
    recorded = _recorded_tokenizer(state)
    if recorded is not None and recorded.get("kind", BYTES) == BYTES:
        return TrainedTokenizer(bytes_tokenizer_json(), {}, "byte tokens")
    if (own / FILE_NAME).is_file():
        path = own / FILE_NAME
        raw = _read(path)
        special = _special_map(own / MAP_FILE)
    else:
        path, raw, special = _from_data(run_dir, state)
    want = (recorded or {}).get("sha256")
    got = hashlib.sha256(raw).hexdigest()
    if isinstance(want, str) and got != want:
        raise ExportError(
            f"{str(path)!r} is not the tokenizer {name} was trained with (its sha256 "
            f"{got[:12]}…, the checkpoint records {want[:12]}…); restore it (nothing was written)"
        )
    try:
        trained = TrainedTokenizer(raw.decode("utf-8"), special, str(path))
        tok = trained.tokenizer
    except UnicodeDecodeError:
        raise ExportError(f"{str(path)!r} is not UTF-8 text") from None
    except TokenizerError as exc:
        raise ExportError(f"cannot export: {exc}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    names = [v for v in special.values() if isinstance(v, str)] + list(special.get(EXTRA) or [])
    for token in names:
        if token not in vocab:
            raise ExportError(
                f"cannot export: the special token {token!r} is not in the vocabulary of "
                f"{str(path)!r}"
            )
    return trained


def _from_data(run_dir: Path, state: dict[str, Any]) -> tuple[Path, bytes, dict[str, Any]]:
    from rootopt.data import load_manifest
    from rootopt.data.tokenizer import FILE_NAME, dataset_tokenizer

    own = run_dir / TOKENIZER_DIR
    where = (state.get("data") or {}).get("path")
    if not where:
        raise ExportError(f"{str(run_dir)!r} holds no tokenizer/ and its checkpoint names no data")
    try:
        manifest = load_manifest(where)
        text, special = dataset_tokenizer(Path(where), manifest)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"cannot export: the tokenizer is not in {str(own)!r} and the run's data "
            f"{where!r} cannot be read ({str(exc).splitlines()[0][:160]})"
        ) from None
    return Path(where) / FILE_NAME, text.encode("utf-8"), special


def _source(run_dir: Path, entry: Any, state: dict[str, Any]) -> bytes:
    """Where the export comes from (``rootopt.json``): what ``model.init_from`` checks the
    tokenizer against and names when a run starts from it."""
    from rootopt.data import identity_tokenizer
    from rootopt.train.models.transformers_lm import source_record

    try:
        run_id = str(json.loads((run_dir / "run.json").read_text(encoding="utf-8"))["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        run_id = ""
    ident = (state.get("data") or {}).get("identity")
    tok = identity_tokenizer(ident) if isinstance(ident, str) else {"kind": "bytes"}
    return source_record(run_dir, run_id, entry.name, int(entry.step), tok)


def _check_tokenizer(directory: Path, trained: TrainedTokenizer) -> None:
    """The tokenizer ``AutoTokenizer.from_pretrained(directory)`` loads must encode
    :data:`HELD_OUT` to the trained tokenizer's ids and name the same special tokens.
    transformers picks the class from the model's ``model_type`` as well as from
    ``tokenizer_config.json``: 5.x loads a ``qwen2`` directory with its own Qwen2Tokenizer,
    which builds Qwen2's pre-tokenizer and normalizer whatever ``tokenizer.json`` says."""
    from transformers import AutoTokenizer

    from rootopt.data.tokenizer import EXTRA, ROLES

    loaded: Any = AutoTokenizer.from_pretrained(str(directory))
    want = trained.tokenizer.encode(HELD_OUT, add_special_tokens=False).ids
    got = list(loaded(HELD_OUT, add_special_tokens=False)["input_ids"])
    cls = type(loaded).__name__
    if got != want:
        at = next(
            (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
        )
        model_type = json.loads((directory / "config.json").read_text(encoding="utf-8")).get(
            "model_type"
        )
        raise ExportMismatch(
            f"cannot export: transformers' AutoTokenizer loads this {model_type} model's "
            f"tokenizer as {cls}, which encodes a held-out text to {len(got)} ids, the trained "
            f"tokenizer to {len(want)} (first difference at id {at}); nothing was published"
        )
    for role in ROLES:
        if getattr(loaded, role, None) != trained.special.get(role):
            raise ExportMismatch(
                f"cannot export: transformers' {cls} has {role} "
                f"{getattr(loaded, role, None)!r}, the trained tokenizer "
                f"{trained.special.get(role)!r}; nothing was published"
            )
    missing = set(trained.special.get(EXTRA) or []) - set(loaded.all_special_tokens)
    if missing:
        raise ExportMismatch(
            f"cannot export: transformers' {cls} does not know the special token "
            f"{sorted(missing)[0]!r}; nothing was published"
        )


# --------------------------------------------------------------------------- the model


def _build(
    mcfg: ModelConfig,
    state: dict[str, Any],
    weights: dict[str, torch.Tensor],
    seq_len: int,
    ids: dict[str, int | None],
) -> tuple[Any, nn.Module]:
    """``(the transformers model holding the weights, rootopt's own model)``."""
    from transformers import AutoModelForCausalLM

    from rootopt.train.models import LlamaLM
    from rootopt.train.models.transformers_lm import (
        HFCausalLM,
        hf_config_object,
        llama_hf_spec,
        llama_to_hf,
    )

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


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _save_model(hf: Any, tmp: Path, out_dir: Path) -> None:
    """``hf.save_pretrained(tmp)``; a failed write (a full disk, say) becomes an
    :class:`OSError` naming the file as it would be in ``out_dir``. safetensors' writer
    raises its own ``SafetensorError`` ("Error while serializing: I/O error: No space left
    on device (os error 28)"), which names no file."""
    from safetensors import SafetensorError

    try:
        hf.save_pretrained(str(tmp))
    except (OSError, SafetensorError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            code, what = exc.errno, exc.strerror or str(exc)
            name = Path(exc.filename).name if exc.filename else "model.safetensors"
        else:
            m = _OS_ERROR.search(str(exc))
            code = int(m.group(1)) if m else errno.EIO
            what, name = os.strerror(code), "model.safetensors"
        raise OSError(code, what, str(out_dir / name)) from None


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


# --------------------------------------------------------------------------- the export


def _missing_parents(out_dir: Path) -> list[Path]:
    """The directories above ``out_dir`` that do not exist yet, the outermost first."""
    missing = []
    for above in out_dir.parents:
        if above.exists() or is_link(above):
            break
        missing.append(above)
    return missing[::-1]


def export(run_dir: Path, out_dir: Path, *, say: Callable[[str], None] = print) -> Path:
    """Write the newest valid checkpoint of ``run_dir`` as a Hugging Face model directory
    ``out_dir`` (see the module docstring); :class:`ExportError` for what the user can fix."""
    from rootopt.data.tokenizer import TokenizerError, transformers_files

    _check_target(out_dir)
    checkpointer, found = _newest(run_dir, say)
    entry, state = found.entry, found.state
    mcfg, seq_len = _saved_model(entry.name, state)
    trained = trained_tokenizer(run_dir, state, entry.name)
    weights = _weights(checkpointer, found)
    _quiet_transformers()
    try:
        files = transformers_files(trained.text, trained.special)
    except TokenizerError as exc:
        raise ExportError(f"cannot export: {trained.where!r}: {exc}") from None
    files[SOURCE_FILE] = _source(run_dir, entry, state)
    made = _missing_parents(out_dir)
    tmp = _staging_dir(out_dir, made)
    try:
        _write_files(tmp, out_dir, files)
        hf, ours = _build(mcfg, state, weights, seq_len, trained.ids())
        _save_model(hf, tmp, out_dir)
        vocab = int(hf.get_input_embeddings().weight.shape[0])
        diff = _compare(tmp, ours, vocab, seq_len)
        if not diff <= LOGIT_TOLERANCE:
            raise ExportMismatch(
                f"cannot export: transformers' {type(hf).__name__} differs from rootopt's model "
                f"by {diff:.3g} in the logits (allowed {LOGIT_TOLERANCE:g}); nothing was published"
            )
        _check_tokenizer(tmp, trained)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_made(made)
        raise
    n = sum(p.numel() for p in hf.parameters())
    say(
        f"exported {entry.name} (step {entry.step}) of {run_dir} to {out_dir}: "
        f"{type(hf).__name__}, {n / 1e6:.2f} M parameters, vocabulary {vocab}; logits equal "
        f"rootopt's within {diff:.1e}, token ids the trained tokenizer's; load with "
        f"AutoModelForCausalLM.from_pretrained({str(out_dir)!r}) and "
        f"AutoTokenizer.from_pretrained({str(out_dir)!r})"
    )
    return out_dir


def _saved_model(name: str, state: dict[str, Any]) -> tuple[ModelConfig, int]:
    """The checkpoint's model settings and sequence length; a classifier is refused."""
    try:
        saved = state["config"]
        mcfg = _model_config(saved["model"])
        seq_len = int(saved["data"]["seq_len"])
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{name}: holds no model or data settings") from None
    if mcfg.kind == "mlp":
        raise ExportError(
            f"{name}: a classifier (model.kind=mlp) has no Hugging Face causal-LM form"
        )
    return mcfg, seq_len


def _staging_dir(out_dir: Path, made: list[Path]) -> Path:
    """The hidden sibling ``.OUT_DIR.partial-<id>/`` the export is written into."""
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:12]}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        _remove_made(made)
        raise ExportError(f"cannot create {str(out_dir)!r} ({exc.strerror or exc})") from None
    return tmp


def _write_files(tmp: Path, out_dir: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        try:
            atomic_write(tmp / name, data)
        except OSError as exc:  # named as the file the user will look for
            raise OSError(exc.errno, exc.strerror, str(out_dir / name)) from None


def _publish(tmp: Path, out_dir: Path) -> None:
    """Every file at the umask's mode and on disk, then ``tmp`` renamed to ``out_dir``."""
    for p in tmp.iterdir():
        # safetensors creates model.safetensors 0600: a reader running as another user
        # could not load the weights; every file gets the mode the umask gives
        os.chmod(p, file_mode())
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


def _remove_made(made: list[Path]) -> None:
    """Remove the directories this export created above OUT_DIR (empty ones only)."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            return


def _quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on the export's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]


__all__ = [
    "HELD_OUT",
    "ExportError",
    "ExportMismatch",
    "TrainedTokenizer",
    "export",
    "trained_tokenizer",
]
