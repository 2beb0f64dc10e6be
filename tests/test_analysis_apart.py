"""The runtime and the analysis apart: the rootopt wheel is exactly the runtime package (no
benchmark, study, fitter, cost model or counter, no recorded spectra), ``import rootopt`` and
``rootopt train`` run where the rootopt-analysis package cannot be imported, the commands that
need it say in one line how to install it, and that line's package installs and is found."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from _faultkit import tree_state
from _train_fixtures import FAST, prepare_tiny
from rootopt import cli

ROOT_DIR = Path(__file__).resolve().parents[1]
SRC = ROOT_DIR / "src"
ANALYSIS = ROOT_DIR / "analysis"
INSTALL_LINE = (
    "needs the rootopt-analysis package, which the rootopt wheel does not carry; "
    "install it from a rootopt source checkout with: pip install ./analysis"
)


def _files(root: Path, package: str) -> set[str]:
    """Every file of ``root/package`` as a path relative to ``root`` (no bytecode)."""
    return {
        p.relative_to(root).as_posix()
        for p in (root / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def _copy(names: list[str], to: Path) -> Path:
    """A copy of the named top-level entries of the checkout: a build writes beside its
    sources (build/, *.egg-info), so it never runs in the checkout itself."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    to.mkdir(parents=True)
    for name in names:
        src = ROOT_DIR / name
        if src.is_dir():
            shutil.copytree(src, to / name, ignore=ignore)
        else:
            shutil.copy2(src, to / name)
    return to


def _pip(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_wheel_is_the_runtime_package_and_nothing_else(tmp_path: Path) -> None:
    tree = _copy(["pyproject.toml", "README.md", "src"], tmp_path / "tree")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(tree))
    (wheel,) = (tmp_path / "w").glob("rootopt-*.whl")
    names = {
        n for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(".dist-info")
    }
    runtime = _files(SRC, "rootopt")
    assert names == runtime, (sorted(names - runtime), sorted(runtime - names))
    # what the runtime reads stays (ns_coefficients="adanewton" reads the table) ...
    assert "rootopt/coeffs/data/adanewton_table.json" in names
    assert "rootopt/tasks.py" in names  # the benchmark tasks' data and models: rl, anneal
    # ... and no analysis code under any name: none of its files' bytes are in the wheel
    wheel_bytes = {zipfile.ZipFile(wheel).read(n) for n in names}
    analysis = _files(ANALYSIS, "rootopt_analysis")
    assert {"rootopt_analysis/bench/study.py", "rootopt_analysis/costmodel.py"} <= analysis
    shared = [n for n in analysis if (ANALYSIS / n).read_bytes() in wheel_bytes - {b""}]
    assert shared == []
    assert not [n for n in names if n.startswith(("rootopt/bench/", "rootopt/tools/"))]


def test_the_analysis_package_installs_from_the_line_and_is_found(tmp_path: Path) -> None:
    """The install line's package builds, carries its data, and the commands find it."""
    tree = _copy(["analysis"], tmp_path / "tree")
    site = tmp_path / "site"
    _pip(
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
        str(tree / "analysis"),
    )
    installed = _files(site, "rootopt_analysis")
    assert installed == _files(ANALYSIS, "rootopt_analysis")
    assert "rootopt_analysis/coeffs/data/momentum_spectra.json" in installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(site)])}
    argv = ["plan", "--model", "llama3-8b", "--worlds", "8", "--designs", "owner"]
    proc = subprocess.run(
        [sys.executable, "-m", "rootopt.cli", *argv, "--json", str(tmp_path / "plan.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "plan.json").read_text())
    assert [(r["model"], r["world"], r["design"]) for r in rows] == [("llama3-8b", 8, "owner")]


# Installed into an interpreter, this makes rootopt_analysis missing whether or not it is
# installed: importing it fails as for a package that is not there.
BLOCKER = """
import sys


class NoAnalysis:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "rootopt_analysis":
            raise ModuleNotFoundError("No module named 'rootopt_analysis'", name="rootopt_analysis")
        return None


sys.meta_path.insert(0, NoAnalysis())
"""


def _hidden(tmp_path: Path) -> dict[str, str]:
    """An environment whose interpreters cannot import rootopt_analysis (the blocker as a
    sitecustomize), with this checkout's rootopt."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(SRC)])}


def _hide_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same blocker in this process, for one test."""
    scope: dict[str, object] = {}
    exec(BLOCKER.replace("sys.meta_path.insert(0, NoAnalysis())", ""), scope)
    for name in [m for m in sys.modules if m.split(".")[0] == "rootopt_analysis"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [scope["NoAnalysis"](), *sys.meta_path])  # type: ignore[operator]


def test_import_rootopt_and_rootopt_train_run_without_the_analysis_package(
    tmp_path: Path,
) -> None:
    env = _hidden(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import rootopt_analysis"], capture_output=True, text=True, env=env
    )
    assert probe.returncode == 1  # hidden indeed
    assert "ModuleNotFoundError: No module named 'rootopt_analysis'" in probe.stderr
    code = (
        "import torch, rootopt\n"
        "for spec in ('muon', 'adanewton'):\n"
        "    p = torch.nn.Parameter(torch.randn(37, 101)); p.grad = torch.randn(37, 101)\n"
        "    rootopt.ROOT([p], ns_coefficients=spec).step()\n"
        "print(rootopt.coeffs.resolve_record('adanewton', 64, 256, 5).source)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert (proc.returncode, proc.stdout) == (0, "table\n"), proc.stderr[-2000:]
    shards, run = prepare_tiny(tmp_path / "data"), tmp_path / "run"
    argv = ["--data_path", str(shards), "--log_dir", str(run), *FAST, "run.max_steps=3"]
    proc = subprocess.run(
        [sys.executable, "-m", "rootopt.cli", "train", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [json.loads(ln).get("step") for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--help"],
        ["bench", "study", "--out", "OUT"],
        ["plan"],
        ["plan", "--json", "OUT"],
        ["coeffs", "fit", "--shape", "64x256"],
        ["coeffs", "bench", "--json", "OUT"],
        ["coeffs", "heldout", "--out", "OUT"],
    ],
)
def test_analysis_commands_without_the_package_say_how_to_install_it(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _hide_here(monkeypatch)
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    before = tree_state(tmp_path)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"rootopt {argv[0]}: {INSTALL_LINE}\n")
    assert tree_state(tmp_path) == before  # nothing written


def test_the_runtime_parts_of_those_commands_need_no_analysis_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rootopt import ROOT
    from rootopt.coeffs import CoefficientError

    _hide_here(monkeypatch)
    assert cli.main(["coeffs", "show", "64x256"]) == 0
    assert capsys.readouterr().out.startswith("AdaNewton 64x256, K=5, float32: source table")
    assert cli.main(["coeffs", "--help"]) == 0
    assert "rootopt coeffs show" in capsys.readouterr().out
    # ns_fit=True is the optimizer's one way into the analysis package: refused in one line
    import torch

    p = torch.nn.Parameter(torch.randn(37, 101))
    with pytest.raises(CoefficientError) as info:
        ROOT([p], ns_coefficients="adanewton", ns_fit=True)
    (line,) = str(info.value).splitlines()
    assert "ns_fit=True" in line and "pip install ./analysis" in line
    # the same construction without ns_fit works (the table's certified generalisation)
    assert ROOT([p], ns_coefficients="adanewton").coefficient_resolutions()


def test_scipy_missing_while_a_command_runs_points_at_the_analysis_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scipy (the study's statistics) is a dependency of rootopt-analysis, not of rootopt."""

    def main(argv: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'scipy'", name="scipy")

    monkeypatch.setitem(cli.COMMANDS, "fake", "needs scipy when it runs")
    monkeypatch.setitem(sys.modules, "rootopt.commands.fake", types.SimpleNamespace(main=main))
    assert cli.main(["fake"]) == 2
    assert capsys.readouterr().err == f"rootopt fake: {INSTALL_LINE}\n"
