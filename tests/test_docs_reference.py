"""The docs are reference, and their numbers come from committed JSON (docs/operations.md,
"Documentation").

- every page of docs/results/ is what ``benchmarks/results_pages.py`` renders from its JSON,
  and docs/config.md what ``scripts/config_reference.py`` renders from the schema;
- a reference page names only defaults the code has: the options table of docs/optimizer.md
  against ``ROOT``'s signature (every keyword, with its default), ``name=value`` called "the
  default" against ``ROOT``, ``section.key`` "(default X)" against the config schema, and a
  coefficient set called the default coefficients;
- reference pages carry no measurement logs (commit hashes, load averages) and stay short;
- no page or results file names a path of the machine it was written on.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import io
import re
import tempfile
import tokenize
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from rootopt.config.schema import Config
from rootopt.optim import ROOT

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# The defaults study's page carries its own generated, provenance-stamped blocks
# (benchmarks/study_publish.py); every other page of docs/ is reference.
REFERENCE = sorted(p for p in DOCS.glob("*.md") if p.name != "benchmarks.md")
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
MAX_LINES = 700


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ------------------------------------------------------------------- generated pages


def test_every_results_page_is_the_rendering_of_its_json() -> None:
    pages = _load(REPO / "benchmarks" / "results_pages.py").render_all()
    on_disk = sorted(p.name for p in (DOCS / "results").glob("*.md"))
    assert on_disk == sorted(pages), "a results page without a renderer, or one missing"
    for name, text in pages.items():
        assert _text(DOCS / "results" / name) == text, (
            f"docs/results/{name} differs from its JSON: python benchmarks/results_pages.py"
        )


def test_config_reference_is_the_schema() -> None:
    rendered = _load(REPO / "scripts" / "config_reference.py").render()
    assert _text(DOCS / "config.md") == rendered, "python scripts/config_reference.py"
    # every key of the schema is on the page, once, with its default
    for key, default in _schema_defaults().items():
        rows = [ln for ln in rendered.splitlines() if ln.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
        cell = rows[0].split(" | ")[1].strip("`")
        assert _same(_yaml(cell), default), key


# ------------------------------------------------------------------------- defaults


def _schema_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = value

    walk(Config(), "")
    return out


def _root_defaults() -> dict[str, Any]:
    params = inspect.signature(ROOT.__init__).parameters
    return {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


def _yaml(text: str) -> Any:
    """A value as a config file reads it (YAML 1.1 leaves ``1e-05`` a string, and number
    fields accept such strings)."""
    if text == '""':
        return ""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _same(doc: Any, code: Any) -> bool:
    if isinstance(code, bool) or isinstance(doc, bool):
        return doc is code
    if isinstance(code, int | float) and isinstance(doc, int | float):
        return float(doc) == float(code)
    if isinstance(code, tuple) and isinstance(doc, tuple | list):
        return len(doc) == len(code) and all(_same(a, b) for a, b in zip(doc, code, strict=True))
    return bool(doc == code)


def _cells(cell: str) -> list[str]:
    """`a`, `b` -> ['a', 'b'] (the backticked items of a table cell)."""
    return re.findall(r"`([^`]+)`", cell)


def test_optimizer_options_table_is_roots_signature() -> None:
    text = _text(DOCS / "optimizer.md")
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    documented: dict[str, Any] = {}
    for row in rows:
        names_cell, default_cell = row.split(" | ")[:2]
        names, defaults = _cells(names_cell), _cells(default_cell)
        assert defaults, row
        if len(defaults) == 1:
            defaults *= len(names)  # one default for the names of the row
        assert len(names) == len(defaults), row
        for name, value in zip(names, defaults, strict=True):
            documented[name] = ast.literal_eval(value)
    code = _root_defaults()
    assert sorted(documented) == sorted(code), "every keyword of ROOT, and nothing else"
    wrong = {n: (documented[n], code[n]) for n in code if not _same(documented[n], code[n])}
    assert not wrong, f"docs/optimizer.md names defaults ROOT does not have: {wrong}"


# `ns_dtype="auto"` (the default) / (default)
CALLED_DEFAULT = re.compile(r"`(\w+)=([^`]+)`\s*\((?:the )?default\b")
# `run.max_nonfinite` (default 20); `checkpoint.every` steps (default 100)
SECTIONS = "|".join(f.name for f in dataclasses.fields(Config))
KEY_DEFAULT = re.compile(
    rf"`((?:{SECTIONS})\.[\w.]+)`[^`(\n]{{0,40}}\(default:? `?([^`),;]+)`?[),;]"
)
# "the default coefficients (Muon's tuple)", "ROOT default (fp32 iteration, AdaNewton, ...)"
DEFAULT_PAREN = re.compile(r"\bdefaults?(?: coefficients)? \(([^)]*)\)", re.I)
COEFFICIENT_NAMES = {
    "adanewton": "adanewton",
    "polar express": "polar_express",
    "polar_express": "polar_express",
    "cans": "cans",
    "muon": "muon",
    "official": "official",
}


def stale_defaults(text: str) -> list[str]:
    """Every default ``text`` names that the code does not have, as one line each."""
    root, schema = _root_defaults(), _schema_defaults()
    flat = " ".join(text.split())  # prose is wrapped
    out = []
    for name, value in CALLED_DEFAULT.findall(flat):
        if name in root and not _same(ast.literal_eval(value), root[name]):
            out.append(f"{name}={value} called the default; ROOT has {root[name]!r}")
    for key, value in KEY_DEFAULT.findall(flat):
        assert key in schema, f"{key}: not a config key"
        if not _same(_yaml(value.strip()), schema[key]):
            out.append(f"{key}: documented default {value.strip()}, schema {schema[key]!r}")
    for inside in DEFAULT_PAREN.findall(flat):
        named = {v for k, v in COEFFICIENT_NAMES.items() if re.search(rf"\b{k}\b", inside, re.I)}
        for coeffs in named - {root["ns_coefficients"]}:
            out.append(f"default ({inside}) names {coeffs}; ROOT's is {root['ns_coefficients']}")
    for value in re.findall(r'ns_coefficients="\w+"\)[^\n]*the default(?: is|:) "(\w+)"', text):
        if value != root["ns_coefficients"]:
            out.append(f'the default is "{value}"; ROOT\'s is {root["ns_coefficients"]}')
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_name_only_defaults_the_code_has(page: Path) -> None:
    assert stale_defaults(_text(page)) == []


def test_the_default_checks_catch_stale_text() -> None:
    """The checker fails on the sentences the pages carried when AdaNewton, then Muon's
    coefficients, then bfloat16 iterations on every device, then Polar Express stopped being
    the default, and on a changed config default."""
    stale = [
        "`tests/test_paths.py` runs every path with every option set — default coefficients "
        "(AdaNewton), float64 and bfloat16 parameters",
        "| ROOT default (fp32 iteration, AdaNewton, threshold) | 7,656 |",
        'opt = rootopt.ROOT(groups, ns_coefficients="adanewton")  # opt in (the default is "adanewton")',
        'opt = rootopt.ROOT(groups, ns_coefficients="adanewton")  # opt in (the default: "polar_express")',
        "every option set of ``tests/path_cases.py`` — the default coefficients (Polar Express's)",
        'iterates with `ns_dtype="bfloat16"` (the default) on the CPU',
        "loses at most `checkpoint.every` steps (default 1000)",
        "`outlier_quantile=0.8` (the default)",
    ]
    for sentence in stale:
        assert stale_defaults(sentence), sentence
    fine = [
        'opt = rootopt.ROOT(groups, ns_coefficients="adanewton")  # opt in (the default: "muon")',
        "every option set of ``tests/path_cases.py`` — the default coefficients (Muon's tuple)",
        "`run.max_nonfinite` (default 20) steps in a row",
        '`ns_dtype="auto"` (the default) resolves per device',
    ]
    for sentence in fine:
        assert stale_defaults(sentence) == [], sentence


# ---------------------------------------------------------- statements that went stale

# The study's page is dated text (protocols written before their runs): only what it calls
# current is checked there. The changelog and a superseded page record what was.
DATED = {"benchmarks.md"}
CURRENT = [
    p for p in PAGES if p.name != "CHANGELOG.md" and "(superseded)" not in _text(p).split("\n")[0]
]
# true the day it was written, stale when the default moves: name the setting and its time
CURRENT_DEFAULT = re.compile(r"\bthe current default\b", re.I)
# ns_dtype="auto" picks by the device's bf16 units, not by its type (docs/optimizer.md)
DEVICE_DEFAULT = re.compile(r"\bthe (?:CUDA|GPU|CPU) default\b", re.I)
# a dtype called the default without saying where ("auto" is bfloat16 only with bf16 units)
DTYPE_DEFAULT = re.compile(
    r"\b(?:bfloat16|bf16|float32|fp32)\b[^.;()]{0,40}\((?:the )?default\b([^)]*)\)"
    r"|\bthe default (?:bfloat16|bf16|float32|fp32)\b",
    re.I,
)
WHERE = re.compile(r"\b(?:on|where|with|units|device|CPU|CUDA|GPU|auto)\b", re.I)
# "... does not ... yet": a promise, stale the day it is kept; a page says what the code does
PROMISE = re.compile(r"\b(?:does|do|is|are|can|has|have)(?: not|n't)\b[^.;:]{0,60}\byet\b", re.I)
# `rootopt.a.b` given in full, and in-place functions (`name_`): each must exist, unless
# its sentence says it is gone
FULL_NAME = re.compile(r"`(rootopt(?:\.\w+)+)")
INPLACE_NAME = re.compile(r"`((?:\w+\.)*[A-Za-z]\w*[A-Za-z0-9]_)(?:\(\))?`")
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "pt", "md", "py", "txt", "toml", "csv"}
GONE = re.compile(r"\b(?:removed|renamed|no longer)\b", re.I)


@functools.cache
def _defined_in_rootopt() -> frozenset[str]:
    names = set()
    for path in (REPO / "src" / "rootopt").rglob("*.py"):
        for node in ast.walk(ast.parse(_text(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
    return frozenset(names)


@functools.cache
def _torch_names() -> frozenset[str]:
    import torch

    owners = (torch, torch.Tensor, torch.nn.Module, torch.nn.utils, torch.amp.GradScaler)
    return frozenset(n for owner in owners for n in dir(owner))


def _resolves(dotted: str) -> bool | None:
    """Whether ``dotted`` names an object (None: no leading part of it is a module)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return None


def _sentence(flat: str, at: int) -> str:
    start = flat.rfind(". ", 0, at) + 1
    end = flat.find(". ", at)
    return flat[start : end if end >= 0 else len(flat)]


def _unknown_names(flat: str) -> list[str]:
    out = []
    for m in FULL_NAME.finditer(flat):
        name = m.group(1)
        if name.rsplit(".", 1)[-1] in FILE_SUFFIXES or GONE.search(_sentence(flat, m.start())):
            continue
        if not _resolves(name):
            out.append(f"`{name}`: no such name in rootopt")
    for m in INPLACE_NAME.finditer(flat):
        name = m.group(1)
        found = _resolves(name) if "." in name else None
        if found is None:
            found = name.rsplit(".", 1)[-1] in _defined_in_rootopt() | _torch_names()
        if not found and not GONE.search(_sentence(flat, m.start())):
            out.append(f"`{name}`: no such function in rootopt or torch")
    return out


def stale_statements(text: str, scope: str = "page") -> list[str]:
    """Statements of ``text`` that were true once, as one line each. ``scope``: ``page``
    (today's reference: every check), ``dated`` (text written at one time: what it calls
    current, and the names it gives), ``comment`` (a test's docstrings and comments: what it
    calls the default)."""
    flat = " ".join(text.split())
    out = [
        f"{m.group(0)!r}: a default as of writing; name the setting and its time"
        for m in CURRENT_DEFAULT.finditer(flat)
    ]
    if scope in ("page", "comment"):
        out += [
            f"{m.group(0)!r}: ns_dtype='auto' picks by bf16 units, not by device type"
            for m in DEVICE_DEFAULT.finditer(flat)
        ]
        out += [
            f"{m.group(0)!r}: the default dtype is 'auto'; say where it is this one"
            for m in DTYPE_DEFAULT.finditer(flat)
            if not WHERE.search(m.group(1) or "")
        ]
    if scope == "page":
        out += [
            f"{m.group(0)!r}: a promise, not what the code does" for m in PROMISE.finditer(flat)
        ]
    if scope in ("page", "dated"):
        out += _unknown_names(flat)
    return out


@pytest.mark.parametrize("page", CURRENT, ids=lambda p: p.name)
def test_pages_make_no_stale_statements(page: Path) -> None:
    assert stale_statements(_text(page), "dated" if page.name in DATED else "page") == []


def _comments_and_docstrings(path: Path) -> str:
    source = _text(path)
    parts = [
        tok.string.lstrip("#")
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


# this file quotes stale sentences on purpose
TEST_SOURCES = sorted(p for p in (REPO / "tests").rglob("*.py") if p.name != Path(__file__).name)


@pytest.mark.parametrize("path", TEST_SOURCES, ids=lambda p: str(p.relative_to(REPO / "tests")))
def test_tests_call_only_todays_defaults_the_default(path: Path) -> None:
    text = _comments_and_docstrings(path)
    assert stale_defaults(text) + stale_statements(text, "comment") == []


def test_the_statement_checks_catch_stale_text() -> None:
    """The checks fail on the sentences the pages and tests carried after ``ns_dtype="auto"``
    came to mean bfloat16 by bf16 units, Polar Express became the default coefficients, the
    per-matrix reference was renamed and ``ROOT`` began to read the ``transposed`` flag."""
    stale = {
        "page": [
            # docs/distributed.md
            "in the dtype the update is exact in (bfloat16 when every matrix of the round "
            "iterated in it — the CUDA default — float32 otherwise",
            # docs/optimizer.md and docs/operations.md
            "The per-matrix reference implementation is "
            "`rootopt.optim.functional.root_update_`; the fast paths are tested equal to it.",
            "4. `optim/`: the per-matrix reference `root_update_`, `ROOT`, routing and the "
            "optimizer registry.",
            # docs/integrations.md
            'With `lr_scale="muon"` (`sqrt(max(1, fan_out/fan_in))`) it does: today\'s `ROOT` '
            "does not read the flag yet, so for Conv1D weights it applies the inverted factor",
        ],
        "dated": [
            # docs/benchmarks.md, the v2 protocol
            "Coefficient candidates at `outlier_quantile=0.9`, float32 iterations, the current "
            "default first: `root-muon`, `root-adanewton`, `root-polar`.",
        ],
        "comment": [
            '"default": ({}, torch.float32),  # bfloat16 iterations (the default ns_dtype)',
            "bfloat16 Newton–Schulz (the default) with the updates returned in bfloat16",
            "# float32 iterations (not the default bfloat16): the ranks are compared",
            "# a power of two: bfloat16 iterations (the default) round the scaled input exactly",
            "# float32 iterations: the world sizes are compared to float32 rounding (with the "
            "default bfloat16 they agree to bfloat16 rounding: tests/test_parity.py)",
        ],
    }
    for scope, sentences in stale.items():
        for sentence in sentences:
            assert stale_statements(sentence, scope), sentence
    # and the docstring naming Polar Express's coefficients, by the defaults check
    assert stale_defaults(
        "every option set of ``tests/path_cases.py`` — the default coefficients (Polar Express's)"
    )
    fine = {
        "page": [
            "bfloat16 when every matrix of the round iterated in it — what "
            '`ns_dtype="auto"` picks on a device with bf16 units — float32 otherwise',
            "The per-matrix reference implementation is "
            "`rootopt.optim.functional._single_tensor_root`.",
            "`momentum_` and `apply_`; torch's `clip_grad_norm_` and `GradScaler.unscale_`",
            "The package was `rootopt.dist` until the previous release; its deprecated import "
            "alias is removed. A `dcp-*` directory's marker `rootopt.json`.",
            'With bfloat16 iterations (the default, `ns_dtype="auto"`, on CUDA and on CPUs '
            "with bf16 units); with float32 iterations (the default on other CPUs)",
            "Not yet measured on a GPU.",
        ],
        "dated": ["float32 iterations, the default at the time first: `root-muon`"],
    }
    for scope, sentences in fine.items():
        for sentence in sentences:
            assert stale_statements(sentence, scope) == [], sentence


# ------------------------------------------------------------- reference, not a log


@pytest.mark.parametrize("page", REFERENCE, ids=lambda p: p.name)
def test_reference_pages_carry_no_measurement_log(page: Path) -> None:
    text = _text(page)
    flat = " ".join(text.split())
    assert len(text.splitlines()) <= MAX_LINES, f"{page.name}: split it or move detail out"
    logs = re.findall(r"\bload average\b|\b(?:at |on )?commit [0-9a-f]{7,40}\b", flat, re.I)
    logs += re.findall(r"before the (?:refactor|removal)", flat, re.I)
    assert not logs, f"{page.name}: measurement history belongs in docs/results or CHANGELOG.md"


def test_no_page_names_a_path_of_this_machine() -> None:
    roots = {tempfile.gettempdir(), str(Path.home()), str(REPO)}
    files = [*PAGES, *(DOCS / "results").glob("*.md"), *(DOCS / "results").glob("*.json")]
    for path in files:
        text = _text(path)
        for root in roots:
            assert f"{root}/" not in text, f"{path.name} names a path under {root}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize(
    "page",
    [*PAGES, *sorted((DOCS / "results").glob("*.md"))],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_relative_links_resolve(page: Path) -> None:
    for link in re.findall(r"\]\(([^)\s]+)\)", _text(page)):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", _text(target), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: {link}"
