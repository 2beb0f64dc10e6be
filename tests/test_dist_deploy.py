"""deploy/: the Kubeflow PyTorchJob manifest and the multi-node launch recipe agree with the
config they launch and with torchrun's own argument parser."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.run import get_args_parser

from rootopt.config import load_config

ROOT_DIR = Path(__file__).resolve().parents[1]
MANIFEST = ROOT_DIR / "deploy" / "kubeflow" / "pytorchjob.yaml"
LAUNCH = ROOT_DIR / "deploy" / "multinode" / "launch.sh"
HOSTFILE = ROOT_DIR / "deploy" / "multinode" / "hostfile.example"


def _pod_template(data: dict[str, Any]) -> Any:
    from kubernetes.client import ApiClient

    # the client's own deserializer builds (and type-checks) V1PodTemplateSpec models
    return ApiClient().deserialize(json.dumps(data), "V1PodTemplateSpec", "application/json")


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


def test_pytorchjob_manifest_matches_the_config_it_launches() -> None:
    job = yaml.safe_load(MANIFEST.read_text())
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
        pod = _pod_template(spec["template"])  # the kubernetes client's models
        containers = {c.name: c for c in pod.spec.containers}
        assert "pytorch" in containers, "the operator only configures the container named pytorch"
        c = containers["pytorch"]
        assert [p.name for p in c.ports] == ["pytorchjob-port"]
        assert int(c.resources.limits["nvidia.com/gpu"]) == nproc  # one process per GPU
        mounts = {m.mount_path: m.name for m in c.volume_mounts}
        volumes = {v.name: v for v in pod.spec.volumes}
        assert volumes[mounts["/shared"]].persistent_volume_claim.claim_name
        # torchrun's own parser reads the arguments after the operator's substitution
        for node_rank in range(nodes):
            env = _operator_env(job, node_rank)
            argv = [_expand(a, env) for a in c.args]
            assert c.command == ["python", "-m", "torch.distributed.run"]
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


def _fake_python(tmp_path: Path) -> Path:
    """A `python` on PATH that records its arguments instead of starting torchrun."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\n')
    fake.chmod(0o755)
    return bindir


def _launch(tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    bindir = _fake_python(tmp_path)
    full = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(
        ["bash", str(LAUNCH), *extra], env=full, capture_output=True, text=True, timeout=30
    )


def test_multinode_recipe_with_hostfile(tmp_path: Path) -> None:
    env = {"NODE_RANK": "1", "HOSTFILE": str(HOSTFILE), "RUN_DIR": "/nfs/runs/a"}
    proc = _launch(tmp_path, env, "run.max_steps=10")
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:2] == ["-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(argv[2:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "10.0.0.1:29500"
    assert args.module and args.training_script == "rootopt.train"
    assert args.training_script_args == [
        "--config", "configs/default.yaml", "--log_dir", "/nfs/runs/a", "run.max_steps=10",
    ]  # fmt: skip
    load_config(ROOT_DIR / "configs" / "default.yaml", ["run.max_steps=10"])


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HOSTFILE": str(HOSTFILE), "RUN_DIR": "/r"}, "NODE_RANK"),
        ({"NODE_RANK": "0", "RUN_DIR": "/r"}, "MASTER_ADDR"),
        ({"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "RUN_DIR"),
        ({"NODE_RANK": "5", "HOSTFILE": str(HOSTFILE), "RUN_DIR": "/r"}, "NODE_RANK 5 >= 2"),
    ],
)
def test_multinode_recipe_refuses_missing_settings(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    proc = _launch(tmp_path, env)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "argv").exists()
