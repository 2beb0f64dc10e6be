"""Load, override and validate a :class:`~rootopt.config.schema.Config` — in one place.

Every problem (unknown key, wrong type, out-of-range value, inconsistent combination) becomes
one line of :class:`ConfigError`; the command line prints them and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from rootopt.config.schema import Config
from rootopt.optim.registry import REGISTRY

# The optimizer registry is the one list of valid names.
OPTIMIZERS: tuple[str, ...] = tuple(REGISTRY)
# Keys of earlier releases: a config naming one gets one line saying what replaced it.
REMOVED: dict[str, str] = {
    "distributed.ddp_design": "removed; under ddp, ROOT and Muon use the owner design and "
    "synchronise the gradients themselves (docs/distributed.md); delete the key",
    "distributed.fsdp_design": "removed; under fsdp every matrix is orthogonalized whole on "
    "its owner (docs/distributed.md); delete the key",
}


class ConfigError(ValueError):
    """One or more configuration problems, one per line."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a YAML alias bomb must not flood the terminal)."""
    if isinstance(value, (dict, list)):
        # repr of a deeply aliased structure is exponential; never build it in full
        kind = "mapping" if isinstance(value, dict) else "list"
        return f"a {kind} of {len(value)} item(s)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_number_string(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _coerce(value: Any, tp: Any, where: str, rules: dict[str, Any], problems: list[str]) -> Any:
    """Check ``value`` against the annotated type ``tp``; return the typed value or None."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType) and bool in get_args(tp):
        # `bool | Literal[...]` (mixed_precision.enabled: true, false or auto)
        words = [w for a in get_args(tp) if get_origin(a) is Literal for w in get_args(a)]
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in words:
            return value.lower()
        problems.append(
            f"{where}: expected true, false or {' or '.join(map(str, words))}; got {short(value)}"
        )
        return None
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        problems.append(
            f"{where}: expected one of {', '.join(map(str, choices))}; got {short(value)}"
        )
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{where}: expected true or false; got {short(value)}")
        return None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                problems.append(f"{where}: expected an integer; got {short(value)}")
                return None
    elif tp is float:
        # YAML 1.1 reads `5e-4` (no dot) as a string; configs/deployment_example.yaml
        # writes exactly that.
        if isinstance(value, str) and _is_number_string(value):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number; got {short(value)}")
            return None
        value = float(value)
        if not math.isfinite(value):
            problems.append(f"{where}: expected a finite number; got {short(value)}")
            return None
    elif tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # e.g. loss_scale: 8192
        if not isinstance(value, str):
            problems.append(f"{where}: expected a string; got {short(value)}")
            return None
    if "min" in rules and value < rules["min"]:
        problems.append(f"{where}: must be >= {rules['min']}; got {short(value)}")
        return None
    if "gt" in rules and value <= rules["gt"]:
        problems.append(f"{where}: must be > {rules['gt']}; got {short(value)}")
        return None
    if "max" in rules and value > rules["max"]:
        problems.append(f"{where}: must be <= {rules['max']}; got {short(value)}")
        return None
    return value


def _build(cls: type[Any], data: Any, where: str, problems: list[str]) -> Any:
    if data is None and where:  # `model:` with nothing under it (every key commented out?)
        problems.append(f"{where}: the section is empty (null); give it keys or remove the line")
        return cls()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{where or 'config'}: expected a mapping of keys; got {short(data)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if isinstance(key, str) and f"{where}.{key}" in REMOVED:
            problems.append(f"{where}.{key}: {REMOVED[f'{where}.{key}']}")
        elif key not in fields:
            known = ", ".join(fields)
            problems.append(
                f"{where + '.' if where else ''}{short(key) if not isinstance(key, str) else key[:60]}: "
                f"unknown key (known: {known})"
            )
    out = cls()
    for name, f in fields.items():
        if name not in data:
            continue
        sub = f"{where + '.' if where else ''}{name}"
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            setattr(out, name, _build(tp, data[name], sub, problems))
            continue
        value = _coerce(data[name], tp, sub, dict(f.metadata), problems)
        if value is not None:
            setattr(out, name, value)
    return out


def _cross_checks(cfg: Config, problems: list[str]) -> None:
    m, o, mp = cfg.model, cfg.optimization, cfg.mixed_precision
    if m.n_heads % m.n_kv_heads:
        problems.append(
            f"model.n_kv_heads: must divide model.n_heads={m.n_heads}; got {m.n_kv_heads}"
        )
    if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
        problems.append(
            f"model.d_model: must be a multiple of 2·n_heads (even head size for RoPE); "
            f"got d_model={m.d_model}, n_heads={m.n_heads}"
        )
    _model_files(m, problems)
    if o.optimizer.lower() not in OPTIMIZERS:
        problems.append(
            f"optimization.optimizer: expected one of {', '.join(OPTIMIZERS)}; got {o.optimizer!r}"
        )
    ls = mp.loss_scale.strip().lower()
    if ls != "dynamic":
        try:
            val = float(ls)
        except ValueError:
            val = -1.0
        if not (math.isfinite(val) and val > 0):
            problems.append(
                f"mixed_precision.loss_scale: expected 'dynamic' or a positive number; got {mp.loss_scale!r}"
            )
    if cfg.distributed.rank >= cfg.distributed.world_size:
        problems.append(
            f"distributed.rank: must be < distributed.world_size={cfg.distributed.world_size}; "
            f"got {cfg.distributed.rank}"
        )
    if (
        cfg.checkpoint.resume not in ("auto", "never", "restart")
        and not Path(cfg.checkpoint.resume).is_file()
        and not (Path(cfg.checkpoint.resume) / "rootopt.json").is_file()
    ):
        problems.append(
            "checkpoint.resume: expected auto, never, restart or an existing checkpoint file "
            "(ckpt-*.pt, or a dcp-* directory); "
            f"got {short(cfg.checkpoint.resume)}"
        )
    if not cfg.data.corpus.strip():
        problems.append(
            "data.corpus: empty; name a corpus (stdlib, bbc, kjv, digits, bbc-classes) or a "
            "directory or file of text"
        )
    from rootopt.data.tokenizer import spec_problem

    problem = spec_problem(cfg.data.tokenizer)
    if problem:
        problems.append(f"data.{problem}")
    if not cfg.data.text_field.strip():
        problems.append("data.text_field: expected the name of a JSON field; got ''")
    if 0 < cfg.run.loss_spike_factor <= 1:
        problems.append(
            f"run.loss_spike_factor: must be 0 (off) or > 1; got {cfg.run.loss_spike_factor}"
        )


def hf_config_file(path: str | Path) -> Path:
    """The ``config.json`` that ``model.hf_config`` (a file or a directory) names."""
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_hf_config(path: str | Path, where: str = "model.hf_config") -> dict[str, Any]:
    """A transformers ``config.json`` as a mapping; :class:`ValueError` with one line naming
    ``where`` when it is missing, not a JSON object or names no ``model_type``."""
    p = hf_config_file(path)
    if not p.exists():
        what = "holds no config.json" if Path(path).is_dir() else "does not exist"
        raise ValueError(f"{where}: {str(path)!r} {what}")
    if not p.is_file():
        raise ValueError(f"{where}: {str(p)!r} is not a regular file")
    try:
        raw = p.read_bytes()[: (16 << 20) + 1]
    except OSError as exc:
        raise ValueError(f"{where}: {str(p)!r} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > 16 << 20:
        raise ValueError(f"{where}: {str(p)!r} is larger than 16 MiB; not a model config")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: {str(p)!r} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: {str(p)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {str(p)!r} holds {short(data)}, not a JSON object")
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise ValueError(
            f"{where}: {str(p)!r} names no model_type (a transformers config.json has one, "
            'e.g. "llama" or "gpt2")'
        )
    return data


def _model_files(m: Any, problems: list[str]) -> None:
    """``model.kind`` / ``hf_config`` / ``init_from``: consistent, and the files they name
    readable (the architecture itself is checked when the model is built, before any write)."""
    if m.kind != "hf" and m.hf_config:
        problems.append(f"model.hf_config: used with model.kind=hf only; got kind={m.kind}")
    if m.kind == "mlp" and m.init_from:
        problems.append("model.init_from: loads language models (kind llama or hf); got kind=mlp")
    if m.kind == "hf" and not (m.hf_config or m.init_from):
        problems.append(
            "model.hf_config: model.kind=hf needs a transformers config.json (model.hf_config) "
            "or a model directory (model.init_from)"
        )
    if m.kind == "hf" and (m.hf_config or m.init_from):
        try:
            if m.hf_config:
                read_hf_config(m.hf_config)
            else:
                read_hf_config(m.init_from, "model.init_from")
        except ValueError as exc:
            problems.append(str(exc))
    if m.init_from:
        d = Path(m.init_from)
        if not d.is_dir():
            what = "does not exist" if not d.exists() else "is not a directory"
            problems.append(f"model.init_from: {str(d)!r} {what} (a Hugging Face model directory)")
        elif not any(os.path.lexists(d / n) for n in SAFETENSORS_FILES):
            problems.append(
                f"model.init_from: {str(d)!r} holds no model.safetensors (or "
                "model.safetensors.index.json); save the model with safetensors"
            )


# The weight files of a Hugging Face model directory (one file, or shards and their index).
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")


def config_warnings(cfg: Config) -> list[str]:
    """Valid settings that are probably not what was meant, one line each (printed at the
    start of a run; nothing is refused)."""
    found = []
    o, r = cfg.optimization, cfg.run
    if o.warmup_steps >= r.max_steps:
        found.append(
            f"optimization.warmup_steps={o.warmup_steps} >= run.max_steps={r.max_steps}: the "
            f"learning rate never leaves its warmup and never reaches base_lr={o.base_lr:g}; "
            f"a warmup of about 10 % of the run is usual (optimization.warmup_steps="
            f"{max(1, r.max_steps // 10)})"
        )
    return found


def from_dict(data: Any) -> Config:
    """Validate a plain mapping (e.g. parsed YAML) into a :class:`Config`; raise :class:`ConfigError`."""
    problems: list[str] = []
    cfg: Config = _build(Config, data, "", problems)
    if not problems:
        _cross_checks(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved configuration as plain data (for YAML, JSON and checkpoints)."""
    return dataclasses.asdict(cfg)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML scalars) to a mapping."""
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or key.startswith("-"):
            problems.append(f"override {item!r}: expected section.key=value")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"override {item!r}: {part} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return data


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last silently)."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    """A mapping whose explicit keys are unique; YAML merge keys (``<<: *base``) are
    supported (an explicit key overrides a merged one, as YAML specifies)."""
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        try:
            dup = key in seen
        except TypeError:
            continue  # unhashable key: the schema check reports it
        if dup:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {short(key)}", mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


def _read_yaml(p: Path) -> Any:
    if p.is_dir():
        raise ConfigError([f"config file {str(p)!r} is a directory, not a YAML file"])
    if not p.exists():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    if not p.is_file():  # a FIFO, socket or device: reading it could block or never end
        raise ConfigError([f"config file {str(p)!r} is not a regular file"])
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(
            [f"config file {str(p)!r} cannot be read ({exc.strerror or exc})"]
        ) from None
    if len(raw) > 1 << 20:
        raise ConfigError([f"config file {str(p)!r} is {len(raw)} bytes; a config is < 1 MiB"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"config file {str(p)!r} is not UTF-8 text (byte {exc.start})"]
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = str(getattr(exc, "problem", None) or "")
        tag = re.search(r"could not determine a constructor for the tag '([^']*)'", problem)
        if tag is not None:  # `!!python/object:...`, `!custom`: never constructed
            name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(
                [
                    f"config file {p.name}{at}: the YAML tag {name[:60]!r} is not supported "
                    "(a config holds mappings, lists, strings, numbers, booleans and null)"
                ]
            ) from None
        what = f": {problem[:80]}" if "duplicate key" in problem else ""
        raise ConfigError([f"config file {p.name}: invalid YAML{at}{what}"]) from None
    except RecursionError:
        raise ConfigError([f"config file {p.name}: YAML nested too deeply"]) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from the embedded defaults), apply overrides, validate."""
    data: Any = {}
    if path is not None:
        p = Path(path)
        data = _read_yaml(p)
        if data is None:
            raise ConfigError(
                [f"config file {p.name} is empty; omit --config to run the embedded default"]
            )
        if not isinstance(data, dict):
            raise ConfigError(
                [f"config file {p.name}: expected a mapping of sections at the top level"]
            )
        empty = _null_sections(Config, data, "")
        if empty:  # before the overrides, which would fill a null section in
            raise ConfigError(
                [
                    f"{w}: the section is empty (null); give it keys or remove the line"
                    for w in empty
                ]
            )
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data)


def _null_sections(cls: type[Any], data: Any, where: str) -> list[str]:
    """The sections (dataclass-typed keys, nested too) that ``data`` gives as null."""
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.name in data and isinstance(tp, type) and dataclasses.is_dataclass(tp):
            sub = f"{where}.{f.name}" if where else f.name
            out += [sub] if data[f.name] is None else _null_sections(tp, data[f.name], sub)
    return out


def dump_yaml(cfg: Config) -> str:
    text: str = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    return text


def loss_scale_value(cfg: Config) -> float | None:
    """Static loss scale, or None for dynamic scaling."""
    ls = cfg.mixed_precision.loss_scale.strip().lower()
    return None if ls == "dynamic" else float(ls)
