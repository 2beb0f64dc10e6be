"""The built-in byte Llama (``model.kind: llama``) against ``transformers.LlamaForCausalLM`` of
the same shape: the training step, and what building the default model with transformers
would add to every start of ``rootopt train`` (docs/models.md, "Two Llamas").

Step: both models are built from the embedded default config (``rootopt.config.Config()``;
the same spec ``rootopt export`` writes,
``rootopt.train.models.transformers_lm.llama_hf_spec``) with the same weights (the built-in
state converted by ``llama_to_hf``), and run forward + backward on the same batches. Rounds interleave them (order alternating); each ratio is the median over rounds
of the per-round ratio of process CPU time (transformers over built-in), with each
``--threads`` count in turn. The logits are compared too: the two are one function.

Launch (``--launch-rounds N``): fresh processes with one thread (as the test suite starts
them), interleaved rounds (order alternating), median wall and CPU time (user + system) of

* the imports ``rootopt train`` starts with today (``rootopt.train.loop``);
* ``from transformers import LlamaForCausalLM, LlamaConfig``, and the same classes from their
  modules (``transformers.models.llama``), the lazier route past transformers' top-level
  table, each in a process of its own;
* today's imports followed by transformers' Llama: what the swap adds to them;
* ``rootopt train run.max_steps=3 --log_dir NEW`` as it is, and the same with the default
  model built as ``LlamaForCausalLM`` from that spec (:data:`SWAP`, the swap as a prototype:
  nothing else changes), each in a new directory that prepares the default data itself.

Usage: python benchmarks/bench_llama_impl.py [--rounds 3] [--steps 10] [--threads 2 1]
           [--launch-rounds 3] [--json docs/results/llama_impl.json]
       python benchmarks/bench_llama_impl.py --render docs/results/llama_impl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAGE = "docs/results/llama_impl.md"
SOURCE = "docs/results/llama_impl.json"

# `rootopt train` with model.kind=llama built as transformers' LlamaForCausalLM (the spec
# `rootopt export` writes), through the wrapper model.kind=hf trains: the swap's start-up.
SWAP = r"""
import dataclasses, sys
import rootopt.train.loop as loop
from rootopt.train import models as m
built_in = loop.build_model

def build(cfg, manifest, seq_len):
    if cfg.kind != "llama":
        return built_in(cfg, manifest, seq_len)
    from transformers import LlamaConfig, LlamaForCausalLM
    from rootopt.train.models.transformers_lm import HFCausalLM, llama_hf_spec
    cfg = dataclasses.replace(cfg, vocab_size=m.resolve_vocab(cfg, manifest))
    spec = llama_hf_spec(cfg, cfg.vocab_size, seq_len, m.token_ids(manifest))
    config = LlamaConfig(**{k: v for k, v in spec.items() if k != "model_type"})
    return HFCausalLM(LlamaForCausalLM(config), spec)

loop.build_model = build
from rootopt.cli import main
sys.argv[0] = "rootopt"
sys.exit(main())
"""

TODAY_IMPORTS = "from rootopt.train.loop import train"
TOP = "from transformers import LlamaForCausalLM, LlamaConfig"
MODULES = (
    "from transformers.models.llama.modeling_llama import LlamaForCausalLM; "
    "from transformers.models.llama.configuration_llama import LlamaConfig"
)
# name -> (what it is, the python arguments after the interpreter)
IMPORTS: dict[str, tuple[str, list[str]]] = {
    "today": ("rootopt train's imports today (`rootopt.train.loop`)", ["-c", TODAY_IMPORTS]),
    "transformers": (f"`{TOP}`", ["-c", TOP]),
    "transformers_modules": ("the same from `transformers.models.llama`", ["-c", MODULES]),
    "today_then_transformers": (
        "rootopt train's imports, then transformers' Llama",
        ["-c", f"{TODAY_IMPORTS}; {TOP}"],
    ),
}
TRAIN = ["train", "run.max_steps=3"]
RUNS: dict[str, tuple[str, list[str]]] = {
    "train_today": ("`rootopt train run.max_steps=3`, the built-in Llama", ["-m", "rootopt.cli"]),
    "train_swap": ("the same, with transformers' LlamaForCausalLM", ["-c", SWAP]),
}


def measure(rounds: int, steps: int, threads: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rootopt.config import Config
    from rootopt.train.models import LlamaLM, loss_fn
    from rootopt.train.models.transformers_lm import llama_hf_spec, llama_to_hf

    torch.set_num_threads(threads)
    cfg = Config()
    m = cfg.model
    vocab, seq, batch = 256, cfg.data.seq_len, cfg.data.batch_size
    m = dataclasses.replace(m, vocab_size=vocab)
    torch.manual_seed(0)
    ours = LlamaLM(m, seq)
    spec = llama_hf_spec(m, vocab, seq, {})
    theirs = LlamaForCausalLM(LlamaConfig(**spec))
    missing, unexpected = theirs.load_state_dict(llama_to_hf(ours.state_dict(), m), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inp, tgt = x[:, :-1], x[:, 1:]
    with torch.no_grad():
        diff = (ours(inp) - theirs(input_ids=inp).logits).abs().max().item()

    def step(which: str) -> float:
        c0 = time.process_time()
        for _ in range(steps):
            if which == "ours":
                loss = loss_fn(ours(inp), tgt)
                ours.zero_grad(set_to_none=True)
            else:
                loss = loss_fn(theirs(input_ids=inp).logits, tgt)
                theirs.zero_grad(set_to_none=True)
            loss.backward()
        return (time.process_time() - c0) / steps

    step("ours"), step("theirs")  # warm-up
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for r in range(rounds):
        for which in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            times[which].append(step(which))
    ratios = [t / o for t, o in zip(times["theirs"], times["ours"], strict=True)]
    return {
        "threads": threads,
        "max_logit_difference": diff,
        "ours_step_s": statistics.median(times["ours"]),
        "transformers_step_s": statistics.median(times["theirs"]),
        "transformers_over_ours": statistics.median(ratios),
        "ratios": ratios,
    }


def _timed(args: list[str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of ``python ARGS``, which must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench_llama_impl: {args[:2]} failed:\n{proc.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


def launch(rounds: int) -> dict[str, Any]:
    arms = {**IMPORTS, **RUNS}
    wall: dict[str, list[float]] = {k: [] for k in arms}
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as tmp:
        work = Path(tmp)
        for r in range(rounds):
            for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                args = arms[name][1]
                if name in RUNS:
                    args = [*args, *TRAIN, "--log_dir", f"{name}-{r}"]
                w, c = _timed(args, work)
                wall[name].append(w)
                cpu[name].append(c)
    return {
        "rounds": rounds,
        "arms": {
            name: {
                "what": what,
                "wall_s": statistics.median(wall[name]),
                "cpu_s": statistics.median(cpu[name]),
                "walls": wall[name],
                "cpus": cpu[name],
            }
            for name, (what, _) in arms.items()
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from rootopt.config import Config
    from rootopt_analysis.provenance import git_state, instruction_set

    load_start = os.getloadavg()[0]
    cfg = Config()
    threads = " ".join(str(t) for t in args.threads)
    data: dict[str, Any] = {
        **git_state(REPO, "benchmarks/bench_llama_impl.py", "src/rootopt"),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "instruction_set": instruction_set(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": f"python benchmarks/bench_llama_impl.py --rounds {args.rounds} --steps "
        f"{args.steps} --threads {threads} --launch-rounds {args.launch_rounds}",
        "model": {
            "d_model": cfg.model.d_model,
            "n_layers": cfg.model.n_layers,
            "vocab": 256,
            "seq_len": cfg.data.seq_len,
        },
        "batch": cfg.data.batch_size,
        "step": [],
    }
    for t in args.threads:
        data["step"].append(measure(args.rounds, args.steps, t))
    if args.launch_rounds:
        data["launch"] = launch(args.launch_rounds)
    data["load_average"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return data


def render(data: dict[str, Any]) -> str:
    """docs/results/llama_impl.md from its JSON (tests check the page matches its JSON)."""
    m = data["model"]
    lines = [
        "<!-- generated by benchmarks/results_pages.py from docs/results/llama_impl.json; "
        "edit the JSON or the script -->",
        "# The built-in Llama and transformers' LlamaForCausalLM",
        "",
        f"Generated from `{SOURCE}`: commit {(data['commit'] or 'unknown')[:7]}"
        + (" (with uncommitted changes)" if data["dirty"] else "")
        + f", {data['date (UTC)']} UTC, {data['machine']} shared with other jobs (load average "
        f"{data['load_average'][0]} at the start, {data['load_average'][1]} at the end), "
        f"Python {data['python']}, torch {data['torch']}, transformers {data['transformers']}. "
        f"Rerun: `{data['command']} --json FILE`, then `python benchmarks/results_pages.py`. "
        "Read in [models.md](../models.md#two-llamas).",
        "",
        "## Training step",
        "",
        f"The default model (d_model {m['d_model']}, {m['n_layers']} layers, vocabulary "
        f"{m['vocab']}, sequences of {m['seq_len']}, batch {data['batch']}) as the built-in "
        "`LlamaLM` and as `LlamaForCausalLM` with the same weights, forward + backward on the "
        "same batches; process CPU time per step, the median over interleaved rounds, and the "
        "median of the per-round ratios.",
        "",
        "| threads | built-in (ms) | transformers (ms) | transformers / built-in | ratio per "
        "round | largest logit difference |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for s in data["step"]:
        per_round = ", ".join(f"{r:.3f}" for r in s["ratios"])
        lines.append(
            f"| {s['threads']} | {s['ours_step_s'] * 1e3:.1f} | "
            f"{s['transformers_step_s'] * 1e3:.1f} | {s['transformers_over_ours']:.3f} | "
            f"{per_round} | {s['max_logit_difference']:.1e} |"
        )
    launch_data = data.get("launch")
    if launch_data:
        arms = launch_data["arms"]
        lines += [
            "",
            "## Start-up",
            "",
            "Fresh processes with one thread, as the test suite starts them; the median of "
            f"{launch_data['rounds']} interleaved rounds. CPU is the process's user + system "
            "time. The swap row builds the default model as `LlamaForCausalLM` from the spec "
            "`rootopt export` writes and changes nothing else (a prototype in "
            "`benchmarks/bench_llama_impl.py`); each run prepares the default data in its new "
            "directory.",
            "",
            "| process | wall (s) | CPU (s) | wall per round (s) |",
            "|---|---:|---:|---|",
        ]
        for arm in arms.values():
            per_round = ", ".join(f"{w:.2f}" for w in arm["walls"])
            lines.append(
                f"| {arm['what']} | {arm['wall_s']:.2f} | {arm['cpu_s']:.2f} | {per_round} |"
            )
        add = arms["today_then_transformers"]
        today = arms["today"]
        train_add = arms["train_swap"]
        train_today = arms["train_today"]
        lines += [
            "",
            "Added by transformers' Llama: "
            f"{add['cpu_s'] - today['cpu_s']:.2f} s CPU ({add['wall_s'] - today['wall_s']:.2f} s "
            f"wall) to the imports; {train_add['cpu_s'] - train_today['cpu_s']:.2f} s CPU "
            f"({train_add['wall_s'] - train_today['wall_s']:.2f} s wall) to a 3-step run.",
        ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--launch-rounds", type=int, default=0, help="0: no start-up measurement")
    ap.add_argument("--json", type=Path, help="write the results here (refused if it exists)")
    ap.add_argument("--render", type=Path, help="print the results page of this JSON and exit")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text(encoding="utf-8"))), end="")
        return 0
    if args.json and os.path.lexists(args.json):
        ap.error(f"{args.json}: the file exists; name a new one")  # before measuring anything
    if min(args.rounds, args.steps, *args.threads) < 1 or args.launch_rounds < 0:
        ap.error("--rounds, --steps and --threads must be >= 1, --launch-rounds >= 0")
    data = run(args)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
