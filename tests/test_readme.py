"""The README is the front door: its first two commands are the ones CI runs and they do what
it says (install torch pinned first, then rootopt; train / test), its usage lines are the
commands the training tests run, its Python snippet runs, its results table is the committed
study's numbers, and every relative link in it and in the pages it introduced resolves."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
from pathlib import Path

import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
README = ROOT_DIR / "README.md"
CI = ROOT_DIR / ".ci" / "run"
DEV = ROOT_DIR / "scripts" / "dev.sh"
# The README and the pages written with it; the older docs link among themselves.
TORCH = "2.13.0"  # the pin the README promises
# Run verbatim by the training tests (tests/test_train.py, tests/test_dist_train.py).
USAGE = [
    "rootopt train",
    "torchrun --standalone --nproc_per_node=2 -m rootopt.train",
    "torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m rootopt.train",
    "rootopt train --config configs/deployment_example.yaml --log_dir runs/a",
]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _blocks(text: str, lang: str) -> list[list[str]]:
    """Fenced code blocks of one language, as lists of lines."""
    return [b.splitlines() for b in re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)]


def _first_commands() -> list[str]:
    lines = _text(README).splitlines()
    start = lines.index("```bash")
    assert start <= 4, "the commands come right after the title and the one sentence"
    assert sum(1 for ln in lines[1:start] if ln.strip()) == 1, "one sentence, then the commands"
    end = lines.index("```", start + 1)
    return [ln.strip() for ln in lines[start + 1 : end]]


def _executed_lines(path: Path) -> list[str]:
    return [ln.strip() for ln in _text(path).splitlines() if ln.strip() and ln[:1] != "#"]


def test_first_two_commands_are_what_ci_runs() -> None:
    run, test = _first_commands()
    assert (run, test) == ("./scripts/dev.sh run", "./scripts/dev.sh test")
    assert os.access(DEV, os.X_OK) and os.access(CI, os.X_OK)
    ci = _executed_lines(CI)
    assert test in ci, "CI must run the README's test command"
    # CI runs it before its own lint and type lines, in the environment it made
    assert ci.index(test) < ci.index("mypy")
    assert not any("pip install" in ln for ln in ci), (
        "CI installs only through the README's command"
    )


def test_readme_is_short_and_shows_the_usage_verbatim() -> None:
    text = _text(README)
    assert len(text.splitlines()) <= 110
    commands = [ln for block in _blocks(text, "bash") for ln in block if ln and ln[0] != "#"]
    for line in USAGE:
        assert line in commands, line
    assert 'pytest -q -m "not e2e and not slow"' in text


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A VENV whose python and rootopt record their arguments (one line each) instead of
    installing or training."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "rootopt"):
        exe = venv / "bin" / name
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        exe.chmod(0o755)
    return venv, log


def _dev(venv: Path, cwd: Path, *args: str, **env: str) -> list[str]:
    log = venv.parent / "calls"
    log.unlink(missing_ok=True)
    full = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "TORCH_VERSION")}
    full.update(VENV=str(venv), **env)
    proc = subprocess.run(
        [str(DEV), *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_dev_script_pins_torch_first_then_installs_then_runs(tmp_path: Path) -> None:
    assert f"`torch=={TORCH}`" in _text(README)
    venv, _ = _fake_venv(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    calls = _dev(venv, elsewhere, "run", "run.max_steps=3")
    cpu = "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert calls == [
        f"python -m pip install --quiet --no-deps {cpu} torch=={TORCH}",
        f"python -m pip install --quiet torch=={TORCH}",  # its dependencies, default index
        f"python -m pip install --quiet -e {ROOT_DIR}[train]",
        "rootopt train run.max_steps=3",
    ]
    # installed once: the rerun (e.g. after Ctrl-C) goes straight to training
    assert _dev(venv, elsewhere, "run") == ["rootopt train"]
    # every extra for the tests, run from the repository whatever the caller's directory
    calls = _dev(venv, elsewhere, "test", "-x")
    assert calls[2:] == [
        f"python -m pip install --quiet -e {ROOT_DIR}[train,bench,dev,integrations,rl,anneal] "
        f"-e {ROOT_DIR}/analysis",
        "python -m pytest -q -x",
    ]
    assert calls[0] == f"python -m pip install --quiet --no-deps {cpu} torch=={TORCH}"
    # `run` after `test`: the installed extras cover it, nothing is reinstalled
    assert _dev(venv, elsewhere, "run") == ["rootopt train"]
    # an empty TORCH_INDEX_URL takes the default index
    venv2, _ = _fake_venv(tmp_path / "second")
    first = _dev(venv2, elsewhere, "run", TORCH_INDEX_URL="")[0]
    assert first == f"python -m pip install --quiet --no-deps torch=={TORCH}"


def test_dev_script_usage_is_one_error(tmp_path: Path) -> None:
    proc = subprocess.run([str(DEV), "nope"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "scripts/dev.sh run" in proc.stderr and "scripts/dev.sh test" in proc.stderr


def test_python_snippet_runs_as_written() -> None:
    (snippet,) = _blocks(_text(README), "python")
    model = torch.nn.Sequential(
        torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
    )
    x = torch.randint(0, 16, (4, 5))
    loader = [(x, x)] * 3
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    before = [p.detach().clone() for p in model.parameters()]
    scope = {"model": model, "loader": loader, "loss_fn": loss_fn}
    exec("\n".join(snippet), scope)
    opt = scope["opt"]
    assert type(opt).__name__ == "ROOT"
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    # the embedding and the output head go to AdamW, the hidden matrix to ROOT
    algorithm = {ln.split()[0]: ln.split()[2] for ln in str(scope["report"]).splitlines()[2:-1]}
    assert algorithm == {
        "0.weight": "adamw", "1.weight": "root", "1.bias": "adamw",
        "2.weight": "adamw", "2.bias": "adamw",
    }  # fmt: skip


def test_results_table_is_the_committed_study() -> None:
    """The README's results block is rendered from the defaults study (docs/study_results.json, v3, once its runs are in; v2's docs/study_results_v2.json until then)
    and names the default the library ships."""
    from rootopt.optim import ROOT
    from rootopt_analysis.bench.study_report import (
        HEADLINE_BEGIN,
        HEADLINE_END,
        headline,
        headline_view,
    )

    text = _text(README)
    section = text.split("## Measured", 1)[1].split("\n## ", 1)[0]
    assert section.count(HEADLINE_BEGIN) == 1 and section.count(HEADLINE_END) == 1
    block = section[section.index(HEADLINE_BEGIN) : section.index(HEADLINE_END) + len(HEADLINE_END)]
    study = json.loads(_text(ROOT_DIR / "docs" / "study_results_v2.json"))
    v3 = json.loads(_text(ROOT_DIR / "docs" / "study_results.json"))
    from rootopt_analysis.bench import study_v3_pages

    if study_v3_pages.ready(v3):  # v3's table replaces v2's once its runs are in
        assert block + "\n" == study_v3_pages.headline(v3)
        params = inspect.signature(ROOT.__init__).parameters
        assert params["ns_coefficients"].default == v3["decisions"]["ns_coefficients"]["winner"]
        assert params["ns_dtype"].default == "auto"
        return
    want = headline(study)
    assert block + "\n" == want
    table = [line for line in block.splitlines() if line.startswith("|")]
    assert len(table) >= 2  # header and rule; a row per task whose runs have finished
    arm, decision, _ = headline_view(study)  # the ROOT column: the setting ROOT() ships
    assert (arm == decision) == (study["default"]["arm"] == arm)
    options = study["arms"][arm]["options"]
    params = inspect.signature(ROOT.__init__).parameters
    for key in ("ns_coefficients", "outlier_quantile", "ortho_method"):
        assert params[key].default == options[key], key
    # "auto": the arm of either dtype ("auto" takes bfloat16 where the CPU has bf16 units)
    assert params["ns_dtype"].default == "auto" and options["ns_dtype"] in ("bfloat16", "float32")
