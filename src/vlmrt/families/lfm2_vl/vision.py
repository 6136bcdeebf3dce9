"""LFM2-VL's vision graph: SigLIP2 NaFlex tower + pixel-unshuffle projector, one static graph for tiles of any size.

Mirrors transformers' Siglip2VisionModel (embeddings, encoder of vit.ViTLayer with its key mask, post_layernorm; no
pooling head) and
Lfm2VlMultiModalProjector (pixel unshuffle × f, LayerNorm, Linear, GELU, Linear). The graph takes max_patches rows
whatever the tile's size; the host (runtime/media/naflex.py) orders them token-major, pads them and gives the position
table's resize weights and the key mask, so nothing in the graph depends on the tile's size:

    forward(patches [P, p*p*3], position_weights [P, side²], key_mask [P]) -> [P / f², text_hidden]
"""

from __future__ import annotations

import torch
from torch import nn

from .. import VisionModule
from ..layers import activation
from ..vit import ViTLayer
from .config import Lfm2VlConfig


class Projector(nn.Module):
    """Lfm2VlMultiModalProjector after the unshuffle: [tokens, f² · vision_hidden] -> [tokens, text_hidden]."""

    def __init__(self, cfg: Lfm2VlConfig):
        super().__init__()
        width = cfg.vision.hidden * cfg.downsample_factor**2
        self.layer_norm = nn.LayerNorm(width) if cfg.projector_layernorm else nn.Identity()  # eps 1e-5 (torch's)
        self.linear_1 = nn.Linear(width, cfg.projector_hidden, bias=cfg.projector_bias)
        self.act = activation(cfg.projector_act)
        self.linear_2 = nn.Linear(cfg.projector_hidden, cfg.text.hidden, bias=cfg.projector_bias)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class NaFlexVision(nn.Module, VisionModule):
    """One tile's padded, token-major patch rows -> its image-token embeddings (and garbage rows after them, from
    the padding, which the host drops)."""

    def __init__(self, cfg: Lfm2VlConfig):
        super().__init__()
        v = cfg.vision
        self.factor = cfg.downsample_factor
        self.max_patches, self.side = cfg.max_patches, v.position_side
        self.patch_embedding = nn.Linear(3 * v.patch_size**2, v.hidden)  # a Linear in SigLIP2 too: rows (py, px, c)
        self.position_embedding = nn.Parameter(torch.zeros(v.position_side**2, v.hidden))  # the learned side² table
        # SigLIP's options (LayerNorm, q/k/v biases); forward takes the key mask
        self.layers = nn.ModuleList(ViTLayer(v.hidden, v.heads, v.intermediate, v.eps, v.act) for _ in range(v.layers))
        self.post_layernorm = nn.LayerNorm(v.hidden, eps=v.eps)
        self.projector = Projector(cfg)

    def extra_inputs(self) -> dict[str, tuple[int, ...]]:
        """The graph's inputs after the patch rows, by role (families.VisionModule; runtime/media/tile_inputs.py
        naflex_rows makes them)."""
        return {"position_weights": (self.max_patches, self.side**2), "key_mask": (self.max_patches,)}

    def forward(self, patches, position_weights, key_mask):
        # patches [P, p*p*3]; position_weights [P, side²]; key_mask [P]
        x = self.patch_embedding(patches) + torch.matmul(position_weights, self.position_embedding)  # [P, hidden]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = self.post_layernorm(x)
        n, dim = x.shape
        x = x.reshape(n // self.factor**2, self.factor**2 * dim)  # the unshuffle: rows are token-major (host)
        return self.projector(x)  # [P / f², text_hidden]
