"""deploy/ and the Dockerfile: the image installs the pinned torch first and starts the real
CLI; the Kubeflow PyTorchJob runs that image with a claim that is defined; the multi-node
launch recipe runs from any directory. Checked against the config they launch, torchrun's own
argument parser, rootopt's CLI and the kubernetes client's models (docs/deploy.md). Docker
itself is not run here."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.distributed.run import get_args_parser

from _faultkit import free_port, run_session
from _train_fixtures import TINY, prepare_tiny
from rootopt.config import load_config
from rootopt.monitor import read_jsonl

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before Python 3.11
    import tomli as tomllib

ROOT_DIR = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT_DIR / "Dockerfile"
DOCKERIGNORE = ROOT_DIR / ".dockerignore"
MANIFEST = ROOT_DIR / "deploy" / "kubeflow" / "pytorchjob.yaml"
CLAIM = ROOT_DIR / "deploy" / "kubeflow" / "pvc.yaml"
LAUNCH = ROOT_DIR / "deploy" / "multinode" / "launch.sh"
HOSTFILE = ROOT_DIR / "deploy" / "multinode" / "hostfile.example"
PYPROJECT = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text(encoding="utf-8"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


# --------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` as Docker reads them: comment lines dropped (also inside a
    continuation), lines ending in a backslash joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continuation"
    return out


def _stages(instructions: list[tuple[str, str]]) -> tuple[dict[str, str], dict[str, Any]]:
    """Global ``ARG`` defaults and ``{stage name: (FROM base, [instructions])}``."""
    global_args: dict[str, str] = {}
    stages: dict[str, Any] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions:
        if word == "FROM":
            base, _, name = rest.partition(" AS ")
            current = []
            stages[name.strip() or f"stage{len(stages)}"] = (base.strip(), current)
        elif current is None:
            assert word == "ARG", f"only ARG may come before the first FROM, not {word}"
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            current.append((word, rest))
    return global_args, stages


def _next_line_continues(command: str) -> dict[str, list[str]]:
    """``docker run`` lines that continue on the next comment line, joined."""
    lines = [
        ln[1:].strip()
        for ln in DOCKERFILE.read_text(encoding="utf-8").splitlines()
        if ln.startswith("#")
    ]
    joined: list[str] = []
    for ln in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + ln
        else:
            joined.append(ln)
    return {
        ln: shlex.split(ln, comments=True) for ln in joined if ln.startswith(f"docker {command} ")
    }


def _tags() -> dict[str, str]:
    """Build variant -> image tag, from the build commands the Dockerfile documents."""
    global_args, _ = _stages(_instructions(DOCKERFILE.read_text(encoding="utf-8")))
    tags: dict[str, str] = {}
    for argv in _next_line_continues("build").values():
        variant = global_args["VARIANT"]
        for i, a in enumerate(argv):
            if a == "--build-arg" and argv[i + 1].startswith("VARIANT="):
                variant = argv[i + 1].split("=", 1)[1]
        tags[variant] = argv[argv.index("-t") + 1]
        assert argv[-1] == ".", "the build context is the repository root"
    return tags


def _image_runs() -> list[tuple[str | None, list[str]]]:
    """``(--entrypoint or None, arguments after the image)`` of each documented docker run."""
    tags = set(_tags().values())
    runs = []
    for argv in _next_line_continues("run").values():
        image = next(i for i, a in enumerate(argv) if a in tags)
        entry = argv[argv.index("--entrypoint") + 1] if "--entrypoint" in argv[:image] else None
        runs.append((entry, argv[image + 1 :]))
    return runs


def _console_script(name: str) -> Any:
    """The function a console script runs, from the installed distributions' entry points."""
    (ep,) = importlib.metadata.entry_points(group="console_scripts", name=name)
    return ep.load()


def _rootopt_accepts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Run the real ``rootopt`` CLI on ``argv + --print-config`` (resolves and prints the config,
    trains nothing) from the repository root, which the image copies to its WORKDIR."""
    module, _, func = PYPROJECT["project"]["scripts"]["rootopt"].partition(":")
    main = getattr(importlib.import_module(module), func)
    assert argv[0] == "train", argv
    capsys.readouterr()
    rc = main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    cfg = yaml.safe_load(out)
    assert isinstance(cfg, dict) and "optimization" in cfg, out[:500]
    return cfg


def test_dockerfile_installs_the_pinned_torch_first_then_rootopt_train() -> None:
    global_args, stages = _stages(_instructions(DOCKERFILE.read_text(encoding="utf-8")))
    # the image pins the torch this suite runs on
    assert global_args["TORCH_VERSION"] == Version(torch.__version__).base_version
    assert Version(global_args["TORCH_VERSION"]) in SpecifierSet(
        next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))[5:]
    ), "pip must keep the pinned torch when it installs rootopt"
    tags = _tags()
    assert set(tags) == {"cpu", "cuda"}
    assert global_args["VARIANT"] == "cpu"
    version = PYPROJECT["project"]["version"]
    for variant, tag in tags.items():
        assert tag == f"rootopt:{version}-{variant}"
        base, body = stages[f"torch-{variant}"]
        assert base == "base"
        installs = [r for w, r in body if w == "RUN" and "pip install" in r]
        assert len(installs) == 1 and '"torch==${TORCH_VERSION}"' in installs[0].split()
        assert "ARG" in [w for w, _ in body] and ("ARG", "TORCH_VERSION") in body
        index = re.search(r"--index-url (\S+)", installs[0])
        assert index, installs[0]
        if variant == "cpu":
            assert index.group(1) == CPU_INDEX
        else:
            assert index.group(1) != CPU_INDEX
    final_base, final = list(stages.values())[-1]
    assert final_base == "torch-${VARIANT}"  # torch first, from the chosen variant
    runs = [r for w, r in final if w == "RUN"]
    assert any('pip install ".[train]"' in r for r in runs)
    assert not any("torch" in r.split("&&")[0] for r in runs), "torch is installed only once"
    assert "train" in PYPROJECT["project"]["optional-dependencies"]
    # what `pip install .` reads is in the build context and copied into the image
    copied = {w for word, rest in final if word == "COPY" for w in rest.split()[:-1]}
    assert {"pyproject.toml", "README.md", "src", "configs"} <= copied
    allowed = {
        ln[1:] for ln in DOCKERIGNORE.read_text(encoding="utf-8").splitlines() if ln.startswith("!")
    }
    assert copied <= allowed


def test_image_entrypoint_and_documented_runs_are_the_real_cli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    instructions = _instructions(DOCKERFILE.read_text(encoding="utf-8"))
    last = {word: rest for word, rest in instructions}  # Docker keeps the last of each
    entrypoint, cmd = json.loads(last["ENTRYPOINT"]), json.loads(last["CMD"])
    assert entrypoint == ["rootopt"] and entrypoint[0] in PYPROJECT["project"]["scripts"]
    assert _console_script("rootopt") is importlib.import_module("rootopt.cli").main
    monkeypatch.chdir(ROOT_DIR)  # the image's WORKDIR holds configs/ as the repository does
    default = _rootopt_accepts(cmd, capsys)  # `docker run IMAGE`: rootopt train
    assert default == _rootopt_accepts(["train"], capsys)
    runs = _image_runs()
    assert {entry for entry, _ in runs} == {None, "torchrun"}
    for entry, args in runs:
        if entry is None:  # arguments after the image replace CMD
            _rootopt_accepts(args or cmd, capsys)
            continue
        assert _console_script(entry) is importlib.import_module("torch.distributed.run").main
        parsed = get_args_parser().parse_args(args)
        assert parsed.module and parsed.training_script == "rootopt.train"
        _rootopt_accepts(["train", *parsed.training_script_args], capsys)


def test_deploy_doc_names_the_image_tags() -> None:
    docs = (ROOT_DIR / "docs" / "deploy.md").read_text(encoding="utf-8")
    for tag in _tags().values():
        assert tag in docs


# --------------------------------------------------------------------------------------------
# Kubeflow PyTorchJob and its claim
# --------------------------------------------------------------------------------------------


def _model(data: dict[str, Any], kind: str) -> Any:
    from kubernetes.client import ApiClient

    # the client's own deserializer builds (and type-checks) its models, e.g. V1PodTemplateSpec
    return ApiClient().deserialize(json.dumps(data), kind, "application/json")


def test_volume_claim_is_defined_shared_and_the_one_the_pods_mount() -> None:
    data = yaml.safe_load(CLAIM.read_text(encoding="utf-8"))
    assert (data["apiVersion"], data["kind"]) == ("v1", "PersistentVolumeClaim")
    claim = _model(data, "V1PersistentVolumeClaim")
    assert claim.spec.access_modes == ["ReadWriteMany"], "every node writes checkpoints"
    assert claim.spec.resources.requests["storage"]
    job = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    referenced = set()
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        pod = _model(spec["template"], "V1PodTemplateSpec")
        referenced |= {
            v.persistent_volume_claim.claim_name
            for v in pod.spec.volumes
            if v.persistent_volume_claim is not None
        }
    assert referenced == {claim.metadata.name}


def _operator_env(job: dict[str, Any], node_rank: int) -> dict[str, str]:
    """What the training operator injects (MASTER_*, WORLD_SIZE, RANK, PET_*)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(int(s["replicas"]) for s in specs.values())
    nproc = int(job["spec"]["nprocPerNode"])
    return {
        "MASTER_ADDR": "rootopt-train-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": str(nodes * nproc),
        "RANK": str(node_rank),
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(node_rank),
    }


def _expand(arg: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"manifest refers to $({m.group(1)}) that nothing sets"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Z_]+)\)", sub, arg)


def test_pytorchjob_manifest_matches_the_image_and_the_config_it_launches(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    workdir = {w: r for w, r in _instructions(DOCKERFILE.read_text(encoding="utf-8"))}["WORKDIR"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1
    nproc = int(job["spec"]["nprocPerNode"])
    nodes = sum(int(s["replicas"]) for s in specs.values())
    world = nodes * nproc
    assert world >= 2
    for rtype, spec in specs.items():
        assert spec["restartPolicy"] == "OnFailure"
        pod = _model(spec["template"], "V1PodTemplateSpec")  # the kubernetes client's models
        containers = {c.name: c for c in pod.spec.containers}
        assert "pytorch" in containers, "the operator only configures the container named pytorch"
        c = containers["pytorch"]
        # the CUDA image the Dockerfile documents (a registry prefix may be added when pushed)
        assert c.image.rsplit("/", 1)[-1] == _tags()["cuda"], c.image
        assert c.working_dir == workdir
        assert [p.name for p in c.ports] == ["pytorchjob-port"]
        assert int(c.resources.limits["nvidia.com/gpu"]) == nproc  # one process per GPU
        mounts = {m.mount_path: m.name for m in c.volume_mounts}
        volumes = {v.name: v for v in pod.spec.volumes}
        assert volumes[mounts["/shared"]].persistent_volume_claim.claim_name
        # torchrun's own parser reads the arguments after the operator's substitution
        for node_rank in range(nodes):
            env = _operator_env(job, node_rank)
            argv = [_expand(a, env) for a in c.args]
            assert c.command == ["torchrun"]  # replaces the image's ENTRYPOINT (rootopt)
            assert (
                _console_script("torchrun") is importlib.import_module("torch.distributed.run").main
            )
            args = get_args_parser().parse_args(argv)
            assert args.nnodes == str(nodes), rtype
            assert args.nproc_per_node == str(nproc)
            assert int(args.node_rank) == node_rank
            assert int(args.master_port) == c.ports[0].container_port
            assert args.max_restarts > 0
            assert args.module and args.training_script == "rootopt.train"
        train_args = args.training_script_args
        config = train_args[train_args.index("--config") + 1]
        log_dir = train_args[train_args.index("--log_dir") + 1]
        overrides = [a for a in train_args if "=" in a and not a.startswith("-")]
        assert (ROOT_DIR / config).is_file(), config
        cfg = load_config(ROOT_DIR / config, overrides)
        # what the config says must fit the job that runs it
        assert cfg.distributed.backend in ("nccl", "auto")  # GPU pods
        assert cfg.distributed.init_method == "env://"  # the operator provides env://
        assert cfg.data.batch_size >= world, "every rank needs at least one sample"
        assert log_dir.startswith("/shared/"), "checkpoints must be on the shared volume"
        assert cfg.checkpoint.dir == "" or cfg.checkpoint.dir.startswith("/shared/")
        assert cfg.distributed.timeout_s > 0
        monkeypatch.chdir(ROOT_DIR)  # the container's workingDir is the image's copy of the repo
        assert _rootopt_accepts(["train", *train_args], capsys)["distributed"]["backend"] == "nccl"


def _fake_python(tmp_path: Path) -> Path:
    """A `python` on PATH that records its arguments instead of starting torchrun."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    fake.chmod(0o755)
    return bindir


def _launch(
    tmp_path: Path, env: dict[str, str], *extra: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    bindir = _fake_python(tmp_path)
    full = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(
        ["bash", str(LAUNCH), *extra],
        env=full,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd or ROOT_DIR,
    )


def test_multinode_recipe_with_hostfile_from_another_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"NODE_RANK": "1", "HOSTFILE": str(HOSTFILE), "RUN_DIR": "/nfs/runs/a"}
    proc = _launch(tmp_path, env, "run.max_steps=10", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text(encoding="utf-8").splitlines()
    assert argv[:2] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[2:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "10.0.0.1:29500"
    assert args.module and args.training_script == "rootopt.train"
    config = str(ROOT_DIR / "configs" / "default.yaml")  # found from the script's location
    assert args.training_script_args == [
        "--config", config, "--log_dir", "/nfs/runs/a", "run.max_steps=10",
    ]  # fmt: skip
    load_config(config, ["run.max_steps=10"])
    assert not list(elsewhere.iterdir())


def test_multinode_recipe_dry_run_prints_the_command_and_runs_nothing(tmp_path: Path) -> None:
    env = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "RUN_DIR": "r", "DRY_RUN": "1"}
    proc = _launch(tmp_path, env, "run.seed=3", "data.corpus=my corpus", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "argv").exists()
    argv = shlex.split(proc.stdout)
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "1", 0)
    assert args.training_script_args[-2:] == ["run.seed=3", "data.corpus=my corpus"]
    assert Path(args.training_script_args[1]) == ROOT_DIR / "configs" / "default.yaml"


def test_launch_sh_trains_from_another_directory(tmp_path: Path) -> None:
    """The recipe for real: one node, one process, torchrun's c10d rendezvous on loopback,
    started from a directory that is not the repository; the run directory is relative to
    the caller's directory and the default config is the repository's."""
    shards = prepare_tiny(tmp_path / "shards")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    over = [*TINY, "run.max_steps=4", "checkpoint.every=2", "run.eval_every=0"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT_DIR / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
        "NNODES": "1",
        "NODE_RANK": "0",
        "NPROC": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RUN_DIR": "run",
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HOSTFILE", "CONFIG", "DRY_RUN"):
        env.pop(key, None)
    try:
        done = run_session(
            ["bash", str(LAUNCH), "--data_path", str(shards), *over],
            env=env,
            timeout=240,
            cwd=elsewhere,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("launch.sh did not finish within 240 s")
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, out[-2000:] + err[-3000:]
    run = elsewhere / "run"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["run"]
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert steps and steps[-1] == 4
    # the repository's default config, with the overrides, is what ran (the run records the
    # vocabulary it resolved from the data's tokenizer: 256 byte tokens)
    expected = load_config(ROOT_DIR / "configs" / "default.yaml", [*over, "model.vocab_size=256"])
    assert load_config(run / "config.yaml") == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HOSTFILE": str(HOSTFILE), "RUN_DIR": "/r"}, "set NODE_RANK"),
        ({"NODE_RANK": "x", "MASTER_ADDR": "a", "RUN_DIR": "/r"}, "NODE_RANK must be a number"),
        ({"NODE_RANK": "0", "RUN_DIR": "/r"}, "set MASTER_ADDR"),
        ({"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "set RUN_DIR"),
        ({"NODE_RANK": "5", "HOSTFILE": str(HOSTFILE), "RUN_DIR": "/r"}, "NODE_RANK 5 >= 2"),
        ({"NODE_RANK": "0", "HOSTFILE": "no-such-file", "RUN_DIR": "/r"}, "HOSTFILE no-such"),
        (
            {"NODE_RANK": "0", "MASTER_ADDR": "a", "RUN_DIR": "/r", "CONFIG": "nope.yaml"},
            "CONFIG nope.yaml is not a file",
        ),
    ],
)
def test_multinode_recipe_refuses_missing_settings(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    proc = _launch(tmp_path, env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("launch.sh: ") and message in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "argv").exists()
