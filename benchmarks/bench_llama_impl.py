"""The built-in byte Llama (``model.kind: llama``) against ``transformers.LlamaForCausalLM`` of
the same shape, on the training default's model and batch (docs/models.md, "Two Llamas").

Both models are built from the embedded default config (``rootopt.config.Config()``; the
same spec ``rootopt export`` writes, ``rootopt.train.hf.llama_hf_spec``) with the same
weights (the built-in state converted by ``llama_to_hf``), and run forward + backward on the
same batches. Rounds interleave them (order alternating); each ratio is the median over rounds
of the per-round ratio of process CPU time (transformers over built-in), with
``--threads`` threads. The logits are compared too: the two are one function.

Usage: python benchmarks/bench_llama_impl.py [--rounds 3] [--steps 10] [--threads 2]
           [--json docs/results/llama_impl.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def measure(rounds: int, steps: int, threads: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rootopt.config import Config
    from rootopt.train.hf import llama_hf_spec, llama_to_hf
    from rootopt.train.model import LlamaLM, loss_fn
    from rootopt_analysis.provenance import git_state, instruction_set

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
        **git_state(REPO, "benchmarks/bench_llama_impl.py", "src/rootopt"),
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "instruction_set": instruction_set(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": f"python benchmarks/bench_llama_impl.py --rounds {rounds} --steps {steps} "
        f"--threads {threads}",
        "model": {"d_model": m.d_model, "n_layers": m.n_layers, "vocab": vocab, "seq_len": seq},
        "batch": batch,
        "max_logit_difference": diff,
        "ours_step_s": statistics.median(times["ours"]),
        "transformers_step_s": statistics.median(times["theirs"]),
        "transformers_over_ours": statistics.median(ratios),
        "ratios": ratios,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    data = measure(args.rounds, args.steps, args.threads)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
