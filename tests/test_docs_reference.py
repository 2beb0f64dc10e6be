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
import importlib.util
import inspect
import re
import tempfile
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
    for value in re.findall(r'ns_coefficients="\w+"\)[^\n]*the default is "(\w+)"', text):
        if value != root["ns_coefficients"]:
            out.append(f'the default is "{value}"; ROOT\'s is {root["ns_coefficients"]}')
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_name_only_defaults_the_code_has(page: Path) -> None:
    assert stale_defaults(_text(page)) == []


def test_the_default_checks_catch_stale_text() -> None:
    """The checker fails on the sentences the pages carried when AdaNewton, then Muon's
    coefficients, then bfloat16 iterations on every device stopped being the default, and
    on a changed config default."""
    stale = [
        "`tests/test_paths.py` runs every path with every option set — default coefficients "
        "(AdaNewton), float64 and bfloat16 parameters",
        "| ROOT default (fp32 iteration, AdaNewton, threshold) | 7,656 |",
        'opt = rootopt.ROOT(groups, ns_coefficients="adanewton")  # opt in (the default is "adanewton")',
        'opt = rootopt.ROOT(groups, ns_coefficients="adanewton")  # opt in (the default is "muon")',
        'iterates with `ns_dtype="bfloat16"` (the default) on the CPU',
        "loses at most `checkpoint.every` steps (default 1000)",
        "`outlier_quantile=0.8` (the default)",
    ]
    for sentence in stale:
        assert stale_defaults(sentence), sentence
    fine = [
        'opt = rootopt.ROOT(groups, ns_coefficients="adanewton")  # opt in (the default: "polar_express")',
        "`run.max_nonfinite` (default 20) steps in a row",
        '`ns_dtype="auto"` (the default) resolves per device',
    ]
    for sentence in fine:
        assert stale_defaults(sentence) == [], sentence


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
