"""The ``rootopt.dist`` → ``rootopt.distributed`` rename keeps the old name working for one
release (docs/distributed.md, "Package name")."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import pytest

import rootopt.distributed
import rootopt.distributed.root


def test_old_name_warns_and_is_the_same_package() -> None:
    sys.modules.pop("rootopt.dist", None)
    with pytest.warns(DeprecationWarning, match="rootopt.distributed"):
        old = importlib.import_module("rootopt.dist")
    assert old.DistributedROOT is rootopt.distributed.DistributedROOT
    assert sorted(old.__all__) == sorted(rootopt.distributed.__all__)
    # every submodule resolves to the very same module object, so isinstance and pickles agree
    for name in ("checkpoint", "group", "model", "owners", "root", "sampler"):
        assert importlib.import_module(f"rootopt.dist.{name}") is importlib.import_module(
            f"rootopt.distributed.{name}"
        )


def test_a_pickle_naming_the_old_module_loads() -> None:
    """An object pickled when its class lived in ``rootopt.dist.root`` unpickles to the new
    class (StepStats now lives in rootopt.distributed.flat; root still names it)."""
    stats = rootopt.distributed.root.StepStats(ns_matrices=3)
    blob = pickle.dumps(stats, protocol=2).replace(
        b"rootopt.distributed.flat", b"rootopt.dist.root"
    )
    assert b"rootopt.dist.root" in blob
    code = (
        "import pickle, sys, warnings; warnings.simplefilter('ignore');"
        "o = pickle.loads(sys.stdin.buffer.read());"
        "print(type(o).__module__, type(o).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, check=True
    ).stdout.decode()
    assert out.split() == ["rootopt.distributed.flat", "StepStats"]


def test_new_name_does_not_warn() -> None:
    code = (
        "import warnings; warnings.simplefilter('error');"
        "import rootopt.distributed, rootopt.distributed.root; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert out.stdout.decode().strip() == "ok"
