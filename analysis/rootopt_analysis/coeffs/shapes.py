"""Matrix shapes of common model families, for the shipped AdaNewton table.

Each shape is ``(min dim, max dim)`` of a 2-D weight as ROOT orthogonalizes it (conv
weights flattened to ``(out, in·kh·kw)``). Dimensions from the published configs:

- GPT-2 small/medium/large/xl: d = 768/1024/1280/1600, MLP 4d, fused QKV 3d.
- Llama 3.2 1B (d 2048, MLP 8192, 8 KV heads × 64), 3.2 3B (3072, 8192, 8 × 128),
  3 8B (4096, 14336, 8 × 128), 2 13B (5120, 13824, MHA), 3 70B (8192, 28672, 8 × 128);
  unfused q/k/v/o and gate/up/down, fused QKV ``d + 2·kv`` and fused gate/up ``2·ffn``.
  Llama 3.2 1B's fused QKV and fused gate/up are two of the paper's four shapes.
- Mistral 7B (as Llama 3 8B), Qwen2.5 0.5B (896, 4864, 2 × 64), 1.5B (1536, 8960,
  2 × 128), 7B (3584, 18944, 4 × 128).
- ViT-B/16 (768, MLP 3072, patch embedding 768 × 3·16·16) and ViT-L/16 (1024, 4096).
- ResNet-50: every conv weight flattened to ``(out, in·k·k)`` and the 1000-way head.
- The paper's four shapes (2048 × 2048/3072/8192/16384).
"""

from __future__ import annotations


def _llama(d: int, ffn: int, kv: int) -> dict[str, tuple[int, int]]:
    out = {
        "attn q/o": (d, d),
        "mlp gate/up/down": (d, ffn),
        "fused qkv": (d, d + 2 * kv),
        "fused gate/up": (d, 2 * ffn),
    }
    if kv != d:
        out["attn k/v"] = (kv, d)
    return out


def _gpt(d: int) -> dict[str, tuple[int, int]]:
    return {"attn proj": (d, d), "fused qkv": (d, 3 * d), "mlp": (d, 4 * d)}


def _resnet50() -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {"conv1 7x7": (64, 3 * 49), "fc": (1000, 2048)}
    c_in = 64
    for stage, width in enumerate((64, 128, 256, 512), start=1):
        c_out = 4 * width
        out[f"layer{stage} 1x1 reduce (first)"] = (width, c_in)
        out[f"layer{stage} 1x1 reduce"] = (width, c_out)
        out[f"layer{stage} 3x3"] = (width, 9 * width)
        out[f"layer{stage} 1x1 expand"] = (width, c_out)
        out[f"layer{stage} downsample"] = (c_in, c_out)
        c_in = c_out
    return out


MODEL_SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "gpt2-small": _gpt(768),
    "gpt2-medium": _gpt(1024),
    "gpt2-large": _gpt(1280),
    "gpt2-xl": _gpt(1600),
    "llama-1b": _llama(2048, 8192, 512),
    "llama-3b": _llama(3072, 8192, 1024),
    "llama-8b": _llama(4096, 14336, 1024),
    "llama-13b": _llama(5120, 13824, 5120),
    "llama-70b": _llama(8192, 28672, 1024),
    "mistral-7b": _llama(4096, 14336, 1024),
    "qwen-0.5b": _llama(896, 4864, 128),
    "qwen-1.5b": _llama(1536, 8960, 256),
    "qwen-7b": _llama(3584, 18944, 512),
    "vit-b16": {**_gpt(768), "patch embed": (768, 768)},
    "vit-l16": {**_gpt(1024), "patch embed": (768, 1024)},
    "resnet50": _resnet50(),
    "paper": {
        "2048x2048": (2048, 2048),
        "2048x3072": (2048, 3072),
        "2048x8192": (2048, 8192),
        "2048x16384": (2048, 16384),
    },
}


def _key(s: tuple[int, int]) -> tuple[int, int]:
    return (min(s), max(s))


def table_shapes() -> dict[tuple[int, int], list[str]]:
    """Every distinct ``(min, max)`` shape -> the ``family:layer`` names that use it."""
    out: dict[tuple[int, int], list[str]] = {}
    for fam, layers in MODEL_SHAPES.items():
        for layer, s in layers.items():
            out.setdefault(_key(s), []).append(f"{fam}:{layer}")
    return dict(sorted(out.items()))


def family_of(shape: tuple[int, int]) -> str:
    """A coarse shape family for reports: square / wide (aspect <= 4) / very wide."""
    m, n = _key(shape)
    r = n / m
    if r == 1:
        return "square"
    if r <= 4:
        return "aspect<=4"
    return "aspect>4"
