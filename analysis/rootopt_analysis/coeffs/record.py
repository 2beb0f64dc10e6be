"""Record real momentum spectra for AdaNewton (``rootopt coeffs record``).

Trains small byte-level transformer language models with :class:`rootopt.ROOT`
(``telemetry=True, record_spectra=True``) on CPython's standard-library source (real
text present on every Python install, no download) and dumps, every ``--every`` steps,
the Frobenius-normalised singular values of the clipped momentum of every ROOT matrix.
Each spectrum is quantile-compressed to at most ``--quantiles`` values (the fitter only
needs the distribution) and written to a JSON file with its provenance.

Three model widths give a spread of aspect ratios: square attention projections, fused
QKV (1:3), MLP (1:4) and a gated MLP with fused gate/up (1:5.33 at d=96, ffn=256).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "momentum_spectra.json"


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, gated: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.gated = gated
        self.up = nn.Linear(d, (2 if gated else 1) * ffn, bias=False)  # fused gate/up if gated
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        h = self.up(self.ln2(x))
        if self.gated:
            g, u = h.chunk(2, dim=-1)
            h = F.silu(g) * u
        else:
            h = F.gelu(h)
        out: Tensor = x + self.down(h)
        return out


class TinyLM(nn.Module):
    """A byte-level causal transformer (untied head so the head is a plain matrix)."""

    def __init__(self, *, d: int, layers: int, heads: int, ffn: int, gated: bool, ctx: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Block(d, heads, ffn, gated) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, 256, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits: Tensor = self.lm_head(self.ln(x))
        return logits


MODELS: dict[str, dict[str, Any]] = {
    "gpt-d64": dict(d=64, layers=2, heads=4, ffn=256, gated=False),
    "gpt-d96": dict(d=96, layers=2, heads=4, ffn=384, gated=False),
    "llama-d96": dict(d=96, layers=2, heads=4, ffn=256, gated=True),
}


def _corpus(max_bytes: int) -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for f in sorted(root.glob("*.py")):
        b = f.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def _compress(sv: np.ndarray, k: int) -> list[float]:
    s = np.sort(sv[sv > 0])[::-1]
    if s.size > k:
        pos = (np.arange(k) + 0.5) / k * s.size - 0.5
        s = np.interp(pos, np.arange(s.size), s)
    s = s / math.sqrt(float(np.sum(s * s)))
    return [float(f"{v:.6g}") for v in s]


def record(
    *,
    steps: int,
    every: int,
    start: int,
    seed: int,
    quantiles: int,
    models: list[str],
    batch: int = 16,
    ctx: int = 128,
) -> dict[str, Any]:
    from rootopt import ROOT, param_groups

    data = torch.from_numpy(_corpus(2_000_000).astype(np.int64))
    spectra: list[dict[str, Any]] = []
    losses: dict[str, float] = {}
    for mi, mname in enumerate(models):
        torch.manual_seed(seed + mi)
        gen = torch.Generator().manual_seed(seed + mi)
        model = TinyLM(ctx=ctx, **MODELS[mname])
        groups, _ = param_groups(model, lr=3e-3)
        opt = ROOT(groups, lr=3e-3, telemetry=True, record_spectra=True)
        loss = torch.zeros(())
        for step in range(1, steps + 1):
            ix = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
            x = torch.stack([data[i : i + ctx] for i in ix.tolist()])
            y = torch.stack([data[i + 1 : i + ctx + 1] for i in ix.tolist()])
            loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            if step >= start and step % every == 0:
                for pname, tel in opt.telemetry.items():
                    sv = tel.get("singular_values")
                    if sv is None:
                        continue
                    p = dict(model.named_parameters())[pname]
                    rows, cols = p.shape[0], int(p[0].numel())
                    svs = sv.double().numpy()
                    for row in svs.reshape(-1, svs.shape[-1]):
                        spectra.append(
                            dict(
                                name=f"{mname}/{pname}",
                                rows=int(rows),
                                cols=int(cols),
                                step=step,
                                sigma=_compress(row, quantiles),
                            )
                        )
        losses[mname] = float(loss.detach())
    return dict(
        format="rootopt.momentum_spectra/1",
        source=(
            "ROOT (telemetry record_spectra: Frobenius-normalised singular values of the "
            "clipped momentum), byte-level tiny LMs on CPython stdlib source"
        ),
        provenance=dict(
            steps=steps,
            every=every,
            start=start,
            seed=seed,
            quantiles=quantiles,
            models={m: MODELS[m] for m in models},
            batch=batch,
            ctx=ctx,
            lr=3e-3,
            final_loss=losses,
            torch=torch.__version__,
            python=platform.python_version(),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        ),
        spectra=spectra,
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rootopt coeffs record", description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--start", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantiles", type=int, default=48)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = record(
        steps=a.steps,
        every=a.every,
        start=a.start,
        seed=a.seed,
        quantiles=a.quantiles,
        models=[m for m in a.models.split(",") if m],
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, separators=(",", ":")) + "\n")
    tmp.replace(a.out)
    print(
        f"recorded {len(res['spectra'])} spectra in {time.perf_counter() - t0:.0f}s "
        f"(final loss {res['provenance']['final_loss']}) -> {a.out.name}"
    )
    return 0
