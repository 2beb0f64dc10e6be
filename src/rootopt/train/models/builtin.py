"""The built-in models — one definition per task — and their loss.

* :class:`LlamaLM`: the built-in causal LM (``rootopt train``, the LM benchmarks, the quickstart).
* :class:`MLPClassifier`: feature-vector classifier (``model.kind=mlp``, BBC News topics).
* :class:`DigitsCNN`: a small CNN for 8×8 digit images, so conv kernels (4-D) go through
  ROOT flattened to ``(out, in·kh·kw)``.

Llama block (pre-norm): ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``; attention
uses rotary position embeddings (RoPE) on queries/keys and grouped-query attention (GQA:
``n_kv_heads`` key/value heads shared by ``n_heads / n_kv_heads`` query heads each). The
output head shares the token embedding (tied), so ROOT's routing sends that one matrix to
the internal AdamW.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rootopt.config import ModelConfig

# The vocabulary of byte tokens: the built-in model's when nothing else names one.
BYTE_VOCAB = 256


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y: Tensor = out.to(x.dtype) * self.weight.to(x.dtype)
        return y


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(seq_len, head_dim/2)`` for rotary embeddings."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (even, odd) of ``x`` ``(B, H, T, D)`` by position-dependent angles."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    c, s = cos[: x.size(-2)], sin[: x.size(-2)]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv  # GQA: each kv head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.wo(y.transpose(1, 2).reshape(B, T, -1))
        return out


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: Tensor = x + self.ffn(self.ffn_norm(x))
        return out


def llama_ffn_hidden(cfg: ModelConfig) -> int:
    """The SwiGLU hidden width: ``model.ffn_hidden``, else 8/3 · d_model rounded up to 32."""
    return cfg.ffn_hidden or 32 * math.ceil(8 * cfg.d_model / 3 / 32)


class LlamaLM(nn.Module):
    """Causal LM: ``forward(tokens (B, T)) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        hidden = llama_ffn_hidden(cfg)
        vocab = cfg.vocab_size or BYTE_VOCAB
        self.cfg = cfg
        self.embed = nn.Embedding(vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, hidden) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init(cfg.init_std)

    def _init(self, std: float) -> None:
        for name, p in self.named_parameters():
            if p.ndim == 2:
                # Output projections get the GPT-2 depth scaling.
                scale = (
                    1 / math.sqrt(2 * self.cfg.n_layers)
                    if name.endswith(("wo.weight", "w_down.weight"))
                    else 1.0
                )
                nn.init.normal_(p, std=std * scale)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        cos, sin = self.rope_cos, self.rope_sin
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits: Tensor = self.lm_head(self.norm(x))
        return logits


class MLPClassifier(nn.Module):
    """Two hidden layers with GELU: ``forward(x (B, F)) -> logits (B, classes)``."""

    def __init__(self, in_dim: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


class DigitsCNN(nn.Module):
    """Two 3×3 conv layers (the second strided) and a linear head: ``(B, 1, 8, 8) -> (B, classes)``.

    The head is named ``head`` so ROOT's routing sends it to AdamW (like an LM head); the
    conv kernels are routed to ROOT.
    """

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, stride=2)
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        out: Tensor = self.head(h.flatten(1))
        return out


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy in float32 (LM logits are flattened over time)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1))
