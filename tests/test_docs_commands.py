"""Every documented command runs (docs/operations.md, "Documentation").

The shell commands of README.md and docs/*.md — fenced ``bash``/``sh``/``shell`` blocks, and
the ``$ ``-prompted lines of ``console`` blocks — are collected in page order. Each one is
either run here, in one scratch directory that holds links to the repository's ``configs/``,
``docs/`` and ``benchmarks/`` (the README's and pages' commands run from the repository root),
or listed in :data:`NOT_HERE` with the reason it cannot run on a CI machine (a GPU, a cluster,
Docker, the network, a long run, the test suite itself). A command in neither table fails
:func:`test_every_documented_command_is_classified`, so a new command in the docs must be
classified; a classified command the docs no longer show fails it too.

Commands run in page order (README, training, models, data, monitoring, then the rest by
name), so a command finds what the commands before it made (shards, runs, a policy); the
first five pages and the rest are two lanes that run side by side (:func:`lanes`). Where a
command would train or measure for minutes, :data:`RUN` appends small overrides (the last
value of a key or option wins) and says why. A command that exits with a status other than its expected
one fails the test, with its output; a ``console`` block's output lines must appear in the
command's output (``...`` matches anything).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from _faultkit import env

REPO = Path(__file__).resolve().parents[1]
FIRST = ("README.md", "docs/training.md", "docs/models.md", "docs/data.md", "docs/monitoring.md")
FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.S | re.M
)
SHELL = ("bash", "sh", "shell", "console")


@dataclass(frozen=True)
class Command:
    page: str
    text: str
    output: tuple[str, ...] = ()  # a console block's lines after the command


@dataclass(frozen=True)
class Run:
    """How a documented command runs here: ``extra`` is appended to it (its reason says why),
    ``status`` the exit statuses it may end with, ``setup`` a shell line run before it in the
    scratch directory (an input the page assumes the user has)."""

    extra: str = ""
    why: str = ""
    status: tuple[int, ...] = (0,)
    setup: str = ""
    timeout: float = 300


TINY = "run.max_steps=3"
SHORT = "shortened: the documented run trains for minutes"
REPORT = (
    "a few-step run can FAIL a criterion (exit 1: e.g. step time against its baseline on a "
    "loaded machine); 2 would be a broken command"
)
DOCS_JSONL = (
    "python -c \"import json; open('docs.jsonl', 'w').write(''.join(json.dumps({'body': t}) "
    "+ chr(10) for t in ['The first document.', 'A second one, with more words in it.'] * 50))\""
)

# command text -> how it runs here
RUN: dict[str, Run] = {
    # README.md
    "rootopt train": Run(TINY, SHORT),
    "torchrun --standalone --nproc_per_node=2 -m rootopt.train": Run(
        "run.max_steps=4", SHORT, timeout=400
    ),
    "torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m rootopt.train": Run(
        "run.max_steps=4", SHORT + "; finds the run the line before trained complete", timeout=400
    ),
    "rootopt train --config configs/deployment_example.yaml --log_dir runs/a": Run(TINY, SHORT),
    # docs/training.md
    "rootopt data prepare --corpus stdlib --out shards/": Run(),
    "rootopt train --config configs/default.yaml --data_path shards/ --log_dir runs/exp_001": Run(
        "run.max_steps=20 run.eval_every=10", SHORT + "; two validations for rootopt report"
    ),
    "python -m rootopt.train --config configs/default.yaml --data_path shards/ --log_dir runs/exp_001": Run(
        "run.max_steps=20 run.eval_every=10", "the run the line before made, already complete"
    ),
    "mkdir -p my_texts && cp docs/*.md my_texts/": Run(),
    "rootopt data prepare --corpus my_texts --tokenizer bpe:2048 --out shards-mine --seq_len 128": Run(),
    "torchrun --standalone --nproc_per_node=2 -m rootopt.train --config configs/hf_llama.yaml --data_path shards-mine --log_dir runs/hf-llama": Run(
        "run.max_steps=4", SHORT, timeout=400
    ),
    "rootopt report runs/hf-llama": Run(why=REPORT, status=(0, 1)),
    "rootopt export runs/hf-llama hf-llama": Run(),
    "python -c \"import json; print(json.dumps({'text': open('README.md').read()}))\" > heldout.jsonl": Run(
        setup=f"cp '{REPO / 'README.md'}' README.md",
        why="the page runs from the repository root, where README.md is",
    ),
    "rootopt data prepare --corpus kjv --out shards-kjv/ --seq_len 256": Run(),
    "rootopt data prepare --corpus bbc --out shards-bbc/": Run(),
    "rootopt data prepare --corpus digits --out shards-digits/": Run(),
    "rootopt data prepare --corpus bbc-classes --out shards-news/": Run(),
    "rootopt data verify shards/": Run(),
    "cp -r \"$(python -c 'import email, os; print(os.path.dirname(email.__file__))')\" my_corpus": Run(),
    "rootopt data prepare --corpus my_corpus/ --out my_data/ --tokenizer bpe:4096 --max_bytes 0": Run(),
    "rootopt train --data_path my_data/ --log_dir runs/mine run.max_steps=30": Run(TINY, SHORT),
    "rootopt data prepare --corpus docs.jsonl --text-field body --tokenizer my_data/tokenizer.json --out docs_data/ --max_bytes 0": Run(
        setup=DOCS_JSONL, why="docs.jsonl is the user's file: a small one is written first"
    ),
    "rootopt train --log_dir runs/own data.corpus=my_corpus/ data.tokenizer=bpe:4096 data.max_bytes=0": Run(
        "run.max_steps=10", SHORT + "; the console block below names its step-10 checkpoint"
    ),
    "rootopt train --log_dir runs/own data.corpus=my_corpus/ data.tokenizer=bytes model.vocab_size=4096": Run(
        "run.max_steps=10", "the refusal the page shows", status=(2,)
    ),
    "rootopt train optimization.base_lr=-1 model.heads=4": Run(
        why="the config errors the page shows", status=(2,)
    ),
    # docs/monitoring.md
    "rootopt report runs/exp_001": Run(why=REPORT, status=(0, 1)),
    "rootopt train --config configs/default.yaml --data_path shards/ --log_dir runs/adamw_001 optimization.optimizer=AdamW optimization.base_lr=3e-3": Run(
        "run.max_steps=20 run.eval_every=10", SHORT + "; as runs/exp_001"
    ),
    "rootopt report runs/exp_001 --baseline runs/adamw_001": Run(why=REPORT, status=(0, 1)),
    "rootopt report runs/exp_001 --json": Run(why=REPORT, status=(0, 1)),
    "rootopt diagnose runs/exp_001": Run(),
    "rootopt diagnose --config configs/default.yaml": Run(),
    # docs/adanewton.md
    "rootopt coeffs show": Run(),
    "rootopt coeffs show 4096x14336 --dtype bfloat16": Run(),
    "rootopt coeffs fit --shape 96x384": Run(),
    "rootopt coeffs families": Run(),
    "OMP_NUM_THREADS=1 rootopt coeffs heldout --json heldout.json": Run(
        "--tasks digits --steps 5,10", "shortened: the documented run records four tasks (minutes)"
    ),
    "rootopt coeffs build-table --out table.json": Run(
        "--shape 64x64", "shortened: the documented build fits 64 shapes (minutes)"
    ),
    # docs/benchmarks-family.md
    "rootopt bench all --finished-only --out bench-results": Run(
        why="nothing has finished in a new directory: one line, exit 1, as the page says",
        status=(1,),
    ),
    # docs/distributed.md
    "torchrun --standalone --nproc_per_node=2 -m rootopt.train --config configs/default.yaml": Run(
        TINY, SHORT, timeout=400
    ),
    "rootopt plan": Run(),
    "rootopt plan --model llama3-70b --worlds 8 64 512 1024 --json new.json": Run(),
    # docs/outlook.md
    "rootopt rl train --out policy6k --timesteps 6000 --seed 0": Run(
        "--timesteps 12 --steps 12 --every 6", "shortened: the documented policy trains for minutes"
    ),
    "rootopt rl eval policy6k --seeds 0,1,2": Run("--seeds 0 --steps 12", SHORT),
    "rootopt rl eval policy6k --tasks stdlib-d32,digits-w8,bbc-h32 --seeds 0,1,2": Run(
        "--seeds 0 --steps 12", SHORT
    ),
    "rootopt rl eval policy6k --seeds 0,1,2 --base-lr 0.1125": Run("--seeds 0 --steps 12", SHORT),
    "rootopt anneal check": Run(),
    "rootopt anneal head --task bbc --steps 100 --seeds 0,1,2 --s 0.02": Run(
        "--steps 2 --seeds 0", "shortened: the solver takes about a second per step"
    ),
    "rootopt anneal head --task bbc --steps 100 --seeds 0,1,2 --s 0.05 --methods qubo --sampler tabu": Run(
        "--steps 2 --seeds 0", "shortened: the solver takes about a second per step"
    ),
    "rootopt anneal head --task digits --hidden 1 --steps 100 --seeds 0,1,2 --s 0.02": Run(
        "--steps 2 --seeds 0", "shortened: the solver takes seconds per step"
    ),
    # docs/performance.md
    "python benchmarks/bench_step.py --threads 1 --json step.json": Run(
        "--rounds 1 --skip-shapes --d-model 128 --count-d-model 256 --count-layers 2",
        "shortened: the documented bench times a 768-wide model for minutes",
    ),
    "OMP_NUM_THREADS=1 python benchmarks/bench_gram.py --json gram.json": Run(
        "--shapes 64x192 --draws 1", "shortened: the documented bench draws hundreds of matrices"
    ),
    "OMP_NUM_THREADS=1 python benchmarks/bench_memory.py --json memory.json": Run(
        "--count 4 --shape 128x256", "shortened: the documented bench steps 128 MiB of matrices"
    ),
}

GPU = "needs GPUs"
CLUSTER = "needs several machines (a shared /nfs and a rendezvous endpoint)"
DOCKER = "needs Docker and a container registry"
SUITE = "the test suite or CI's own lint and type lines: CI runs them itself (.ci/run)"
NETWORK = "creates .venv and installs packages from the network; CI runs it (.ci/run)"

# command text -> why it does not run here
NOT_HERE: dict[str, str] = {
    "./scripts/dev.sh run": NETWORK,
    "./scripts/dev.sh test": NETWORK,
    "torchrun --nproc_per_node=8 -m rootopt.train --config configs/deployment_example.yaml --data_path /dataset/shard_000 --log_dir /logs/exp_001": GPU
    + " (8) and the guide's /dataset and /logs",
    "torchrun --standalone --nproc_per_node=8 -m rootopt.train --config configs/deployment_example.yaml --log_dir runs/a": GPU
    + " (8)",
    "torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29500 --rdzv-id=exp_001 -m rootopt.train --config configs/deployment_example.yaml --log_dir /nfs/runs/exp_001": CLUSTER,
    "torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29500 -m rootopt.train --config configs/default.yaml --log_dir /nfs/runs/a": CLUSTER,
    "node0$ MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 NPROC=8 RUN_DIR=/nfs/runs/a ~/rootopt/deploy/multinode/launch.sh": CLUSTER,
    "node1$ MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 NPROC=8 RUN_DIR=/nfs/runs/a ~/rootopt/deploy/multinode/launch.sh": CLUSTER,
    "docker build -t rootopt:0.1.0-cpu .": DOCKER,
    "docker build --build-arg VARIANT=cuda -t rootopt:0.1.0-cuda .": DOCKER,
    'docker run --rm -v "$PWD/runs:/opt/rootopt/runs" rootopt:0.1.0-cpu': DOCKER,
    "docker run --rm rootopt:0.1.0-cpu train --config configs/deployment_example.yaml --print-config": DOCKER,
    "docker run --rm --gpus all --entrypoint torchrun rootopt:0.1.0-cuda --standalone --nproc_per_node=2 -m rootopt.train": DOCKER
    + "; "
    + GPU,
    "docker tag rootopt:0.1.0-cuda registry.example.com/ml/rootopt:0.1.0-cuda": DOCKER,
    "docker push registry.example.com/ml/rootopt:0.1.0-cuda": DOCKER,
    "kubectl apply -f deploy/kubeflow/pvc.yaml -f deploy/kubeflow/pytorchjob.yaml": "needs a Kubernetes cluster with the Kubeflow Training Operator",
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf --model_args pretrained=hf-llama,max_length=128,dtype=float32 --include_path examples/lm_eval --tasks rootopt_heldout --batch_size 8": "needs lm-eval, not a dependency of rootopt (docs/models.md measured it once; tests/test_export_families.py checks the plain-transformers evaluation)",
    "rootopt coeffs bench --json bench.json": "about a minute on 2 cores (every table shape and the recorded spectra); tests/test_adanewton_fit.py runs the bench small",
    "rootopt coeffs record --out spectra.json": "trains three LMs: minutes even shortened",
    "rootopt bench all --quick --out bench-quick": "1–2 minutes; tests/test_bench.py runs this pipeline",
    "rootopt bench all --out bench-results": "the full family benchmark: about an hour",
    "rootopt bench robustness --out bench-results": "a suite of the family benchmark: tens of minutes",
    "pytest -q tests/test_routing.py tests/test_integrations_*.py": SUITE,
    "pytest tests/test_train.py tests/test_config.py tests/test_data.py tests/test_checkpoint.py tests/test_monitor.py -q": SUITE,
    "pytest tests/test_train.py -m slow -q": SUITE,
    "pytest tests/test_user_path.py -q": SUITE,
    "pytest tests/test_hf_train.py tests/test_export.py -q": SUITE,
    "pytest tests/test_docs_commands.py -q": SUITE + " (this test)",
    "pytest -q tests/test_faults.py tests/test_faults_inputs.py tests/test_rundir.py tests/test_resume_safety.py tests/test_errors.py tests/test_integrity.py": SUITE,
    "pytest -q -m slow tests/test_faults.py tests/test_battery.py -s": SUITE,
    "ruff check src analysis tests benchmarks examples": SUITE,
    "ruff format --check src analysis tests benchmarks examples": SUITE,
    "mypy": SUITE,
}


# ------------------------------------------------------------------------- collect


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (outside quotes and ``$( )``)."""
    quote, depth, i = "", 0, 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif line.startswith("$(", i):
            depth += 1
            i += 2
            continue
        elif c == ")" and depth:
            depth -= 1
        elif c == "#" and not depth and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
        i += 1
    return line.rstrip()


def _block_commands(page: str, lang: str, lines: list[str]) -> list[Command]:
    prompted = lang == "console" or any(ln.startswith("$ ") for ln in lines)
    if lang not in SHELL and not prompted:
        return []  # an output block, or code of another language
    out: list[Command] = []
    pending = ""
    for i, raw in enumerate(lines):
        if prompted and not pending:
            if not raw.startswith("$ "):
                continue
            raw = raw[2:]
        line = _strip_comment(raw)
        if not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line.strip()).strip()
        pending = ""
        output: list[str] = []
        if prompted:
            for follow in lines[i + 1 :]:
                if follow.startswith("$ "):
                    break
                output.append(follow)
        out.append(Command(page, text, tuple(o for o in output if o.strip())))
    return out


def documented_commands() -> list[Command]:
    """Every command of README.md and docs/*.md, in the order they run here."""
    pages = [*FIRST, *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
    found: list[Command] = []
    for page in dict.fromkeys(pages):
        text = (REPO / page).read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            lines = [ln[len(m["indent"]) :] for ln in m["body"].splitlines()]
            found += _block_commands(page, m["lang"], lines)
    return found


# ------------------------------------------------------------------------ the tests


def test_every_documented_command_is_classified() -> None:
    commands = documented_commands()
    texts = {c.text for c in commands}
    assert len(texts) > 40  # the collector found the pages' commands
    both = sorted(set(RUN) & set(NOT_HERE))
    assert not both, f"run and not run: {both}"
    unknown = sorted(f"{c.page}: {c.text}" for c in commands if c.text not in RUN | NOT_HERE)
    assert not unknown, "classify in RUN or NOT_HERE (tests/test_docs_commands.py):\n" + "\n".join(
        unknown
    )
    stale = sorted((set(RUN) | set(NOT_HERE)) - texts)
    assert not stale, f"classified but no longer in the docs: {stale}"
    for text, run in RUN.items():
        assert not run.extra or run.why, f"{text}: say why it is shortened"


def test_the_collector_reads_blocks_as_a_shell_would() -> None:
    lines = [
        "# a comment line",
        "rootopt train   # Ctrl-C, then the same command resumes",
        "cp -r \"$(python -c 'import os; print(1)')\" x   # copy",
        "torchrun --standalone \\",
        "    -m rootopt.train --log_dir 'a # b'",
    ]
    got = [c.text for c in _block_commands("p", "bash", lines)]
    assert got == [
        "rootopt train",
        "cp -r \"$(python -c 'import os; print(1)')\" x",
        "torchrun --standalone -m rootopt.train --log_dir 'a # b'",
    ]
    console = ["$ rootopt train x=1", "error: one", "... two", "$ rootopt report r", "PASS"]
    got_console = _block_commands("p", "console", console)
    assert [(c.text, c.output) for c in got_console] == [
        ("rootopt train x=1", ("error: one", "... two")),
        ("rootopt report r", ("PASS",)),
    ]
    assert _block_commands("p", "", ["rootopt train", "output"]) == []  # not a command block
    assert _block_commands("p", "python", ["import rootopt"]) == []


def _expected(line: str) -> re.Pattern[str]:
    parts = [re.escape(p.strip()) for p in re.split(r"\.\.\.|…", line)]
    return re.compile(".*".join(parts))


def _scratch(tmp: Path) -> Path:
    work = tmp / "repo"
    work.mkdir(parents=True)
    for name in ("configs", "docs", "benchmarks"):
        (work / name).symlink_to(REPO / name, target_is_directory=True)
    return work


def lanes() -> list[list[Command]]:
    """The commands :func:`test_documented_commands_run` runs, in two lanes: the pages of
    :data:`FIRST` (each builds on the ones before: shards, runs, a tokenizer) and every other
    page (whose commands make what they use). A command an earlier page ran is not run again."""
    done: set[str] = set()
    out: list[list[Command]] = [[], []]
    for cmd in documented_commands():
        if cmd.text in NOT_HERE or cmd.text in done:
            continue  # not here, or an earlier page ran the same line
        done.add(cmd.text)
        out[cmd.page not in FIRST].append(cmd)
    return out


def _run_lane(
    commands: list[Command], work: Path, environment: dict[str, str]
) -> tuple[list[str], list[tuple[float, str]]]:
    """Run ``commands`` in order in ``work``: the failures and the time of each."""
    failures: list[str] = []
    times: list[tuple[float, str]] = []
    for cmd in commands:
        run = RUN[cmd.text]
        if run.setup:
            subprocess.run(
                ["bash", "-c", run.setup], cwd=work, env=environment, check=True, timeout=60
            )
        line = f"{cmd.text} {run.extra}".strip()
        start = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", "-c", f"set -o pipefail; {line}"],
                cwd=work,
                env=environment,
                capture_output=True,
                text=True,
                timeout=run.timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            failures.append(f"{cmd.page}: {line}: no end within {run.timeout:.0f} s")
            continue
        times.append((time.monotonic() - start, line))
        said = proc.stdout + proc.stderr
        if proc.returncode not in run.status:
            failures.append(
                f"{cmd.page}: {line}: exit {proc.returncode} (expected {run.status})\n"
                + said[-2500:]
            )
            continue
        for expected in cmd.output:
            if not any(_expected(expected).search(ln) for ln in said.splitlines()):
                failures.append(
                    f"{cmd.page}: {line}: no output line like {expected!r}\n{said[-1500:]}"
                )
    return failures, times


def test_the_lanes_hold_every_command_once_in_page_order() -> None:
    first, rest = lanes()
    assert first and rest and all(c.page in FIRST for c in first)
    assert not {c.page for c in rest} & set(FIRST)
    texts = [c.text for c in first + rest]
    assert len(texts) == len(set(texts)) == len(RUN)
    seen = [c.text for c in documented_commands()]
    for lane in (first, rest):
        at = [seen.index(c.text) for c in lane]
        assert at == sorted(at)


def test_documented_commands_run(tmp_path: Path) -> None:
    """Every command of RUN, in page order (e2e). The two :func:`lanes` run side by side,
    each in a scratch directory of its own: most commands are a process start and a
    single-threaded prepare or a few steps, so two at a time use both cores."""
    bin_dir = str(Path(sys.executable).parent)
    environment = env(
        PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        ROOTOPT_CACHE_DIR=str(tmp_path / "cache"),
        TORCH_HOME=str(tmp_path / "torch-home"),
        MPLBACKEND="Agg",
    )
    work = [_scratch(tmp_path / f"lane{i}") for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_run_lane, lanes(), work, [environment] * 2))
    failures = [f for fails, _ in results for f in fails]
    times = [t for _, ts in results for t in ts]
    for seconds, line in sorted(times, reverse=True):
        print(f"{seconds:6.1f} s  {line}")
    print(f"{sum(s for s, _ in times):6.1f} s  in all ({len(times)} commands)")
    assert not failures, "\n\n".join(failures)
    assert len(times) == len(RUN)
