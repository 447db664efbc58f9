"""A small GPT (pre-norm transformer decoder) with tied input and output embeddings."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "lm_loss"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`."""

    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128


class Block(nn.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)  # a key bias has no gradient, only noise
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(att, "b h t d -> b t (h d)"))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, and a head tied to the token embedding.

    Examples:
        >>> import torch
        >>> from zfunc.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, d_model=8))
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 10])
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on ``batch = {"x": tokens, "y": next tokens}``.

    Examples:
        >>> import torch
        >>> from zfunc.models import GPT, GPTConfig, lm_loss
        >>> torch.manual_seed(0) and None
        >>> model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, d_model=8))
        >>> x = torch.randint(0, 10, (2, 8))
        >>> round(lm_loss(model, {"x": x, "y": x}).item(), 1)
        2.2
    """
    logits = model(batch["x"])
    return F.cross_entropy(rearrange(logits, "b t v -> (b t) v").float(), rearrange(batch["y"], "b t -> (b t)"))
