"""The vision towers' transformer layer, written once for static export: one tile's patches [tokens, dim] in and out.

SigLIP (SmolVLM / Idefics3) and InternViT (InternVL) differ only in options set when the layer is built:
  SigLIP     LayerNorm, q/k/v biases, no q/k norm, no layer scale
             (transformers/models/siglip/modeling_siglip.py SiglipEncoderLayer)
  InternViT  LayerNorm or RMSNorm, q/k/v biases or not, optional RMSNorm over the full q / k width, a per-channel
             layer scale on both residual branches (transformers/models/internvl/modeling_internvl.py
             InternVLVisionLayer; OpenGVLab's InternVisionEncoderLayer: ls1 / ls2)

Names: norm1, q_proj, k_proj, v_proj, q_norm, k_norm, out_proj, scale1, norm2, fc1, fc2, scale2 (each family's
weight table maps its checkpoint's names onto these).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import RMSNorm, activation


@dataclass(frozen=True)
class ViTOptions:
    """What a family's vision layer has, beyond its sizes."""

    norm: str = "layer_norm"  # "layer_norm" | "rms_norm" (norm1, norm2)
    qkv_bias: bool = True
    qk_norm: bool = False  # RMSNorm (eps 1e-6) over the full q / k width, before the heads are split
    layer_scale: bool = False  # x + scale1 * attn(...), x + scale2 * mlp(...)


class ViTLayer(nn.Module):
    """Pre-norm ViT block: x + [scale1 ·] attn(norm1(x)); x + [scale2 ·] mlp(norm2(x)).

    forward(x [tokens, dim]) -> [tokens, dim]; full (non-causal) multi-head attention over the tile.
    """

    def __init__(self, dim: int, heads: int, intermediate: int, eps: float, act: str, opts: ViTOptions = ViTOptions()):
        super().__init__()
        if opts.norm not in ("layer_norm", "rms_norm"):
            raise ValueError(f"unknown vision norm {opts.norm!r} (layer_norm, rms_norm)")

        def norm() -> nn.Module:
            return nn.LayerNorm(dim, eps=eps) if opts.norm == "layer_norm" else RMSNorm(dim, eps)

        self.heads = heads
        self.norm1 = norm()
        self.q_proj = nn.Linear(dim, dim, bias=opts.qkv_bias)
        self.k_proj = nn.Linear(dim, dim, bias=opts.qkv_bias)
        self.v_proj = nn.Linear(dim, dim, bias=opts.qkv_bias)
        self.q_norm = RMSNorm(dim, 1e-6) if opts.qk_norm else nn.Identity()  # over the full width (InternViT)
        self.k_norm = RMSNorm(dim, 1e-6) if opts.qk_norm else nn.Identity()
        self.out_proj = nn.Linear(dim, dim)
        self.norm2 = norm()
        self.fc1 = nn.Linear(dim, intermediate)
        self.fc2 = nn.Linear(intermediate, dim)
        self.act = activation(act)
        # the layer scales (InternViT's lambda_1 / lambda_2), per channel; absent: no multiply in the graph
        self.scale1 = nn.Parameter(torch.ones(dim)) if opts.layer_scale else None
        self.scale2 = nn.Parameter(torch.ones(dim)) if opts.layer_scale else None

    def forward(self, x, key_mask=None):  # x [tokens, dim]
        """key_mask [tokens], additive (0 for a real patch, a large negative value for padding): added to every
        query's scores per key, so padded patches are attended by none (tiles padded to one static patch count,
        NaFlex); None: no Add in the graph."""
        n, dim = x.shape
        h = self.heads
        d = dim // h
        y = self.norm1(x)
        q = self.q_norm(self.q_proj(y)).view(n, h, d).transpose(0, 1)  # [h, n, d]
        k = self.k_norm(self.k_proj(y)).view(n, h, d).permute(1, 2, 0)  # [h, d, n]
        v = self.v_proj(y).view(n, h, d).transpose(0, 1)  # [h, n, d]
        scores = torch.matmul(q, k) * (d**-0.5)  # [h, n, n]
        if key_mask is not None:
            scores = scores + key_mask[None, None, :]
        p = torch.softmax(scores, dim=-1)
        a = self.out_proj(torch.matmul(p, v).transpose(0, 1).reshape(n, dim))  # [n, dim]
        x = x + (a if self.scale1 is None else self.scale1 * a)
        m = self.fc2(self.act(self.fc1(self.norm2(x))))
        return x + (m if self.scale2 is None else self.scale2 * m)


def pixel_shuffle(x: torch.Tensor, side: int, scale: int) -> torch.Tensor:
    """[side*side, dim] -> [(side/scale)^2, dim*scale^2], exactly Idefics3Connector.pixel_shuffle (InternVL's v2
    pixel shuffle is the same map)."""
    n, dim = x.shape
    x = x.view(side, side // scale, dim * scale)  # [h, w/s, d*s]
    x = x.permute(1, 0, 2).reshape(side // scale, side // scale, dim * scale * scale)  # [w/s, h/s, d*s*s]
    x = x.permute(1, 0, 2)  # [h/s, w/s, d*s*s]
    return x.reshape(n // (scale * scale), dim * scale * scale)


def conv_as_matmul_weight(w: torch.Tensor) -> torch.Tensor:
    """Conv2d patch-embedding weight [out, c, p, p] -> Linear weight [out, c*p*p].

    The host unfolds a tile [c, H, W] into rows ordered (c, py, px) — runtime/media/image.py:unfold_patches.
    """
    return w.reshape(w.shape[0], -1)
