"""The Qwen2.5-VL and Qwen3-VL vision towers as static graphs: every grid-dependent tensor is an input the host
computes (runtime/media/vision_inputs.py), so one graph padded to the patch budget serves every image size.

Qwen2.5-VL  forward(patches [N, c*t*p*p], cos, sin [N, head_dim], full_mask, window_mask [N, N]) -> embeds [N/4, out]
            patches come in window order (the host permutes merge blocks; tokens come out in that order and the host
            puts them back); blocks in fullatt_blocks attend under full_mask, the others under window_mask
            (transformers' Qwen2_5_VisionTransformerPretrainedModel)
Qwen3-VL    forward(patches, pos_index [N, 4] int64, pos_weight [N, 4], cos, sin, mask [N, N])
                -> embeds [N/4, out], deepstack_0..k [N/4, out] (one per DeepStack layer)
            (transformers' Qwen3VLVisionModel)

Module names are the checkpoint's under `visual.` / `model.visual.`, so loading is prefix removal; the Conv3d patch
embedding becomes a MatMul over the host's flattened patches (the processor's row order is the conv weight's).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import VisionModule, layers
from ..decoder import UnsupportedCheckpoint
from .config import VisionConfig


class PatchEmbed(nn.Module):
    """Conv3d(kernel = stride = (t, p, p)) over one patch per row == a Linear over the row (c, t, p, p)."""

    def __init__(self, v: VisionConfig, bias: bool):
        super().__init__()
        self.proj = nn.Linear(v.patch_dim, v.hidden, bias=bias)

    def forward(self, patches):  # [N, c*t*p*p] -> [N, hidden]
        return self.proj(patches)


# Queries per attention block: the graph attends QUERY_ROWS patches at a time over all keys, so the scores it holds
# are [heads, QUERY_ROWS, N], not [heads, N, N] (each row's softmax is its own: the same numbers). At the 4096-patch
# budget one [12, 4096, 4096] fp32 score tensor is 805 MB and ORT held two to three at once (the image run of the
# Qwen3.5-0.8B shape peaked at 2.5 GB); blocks of 256 rows hold 50 MB each (figures: docs/qwen-vl.md).
QUERY_ROWS = 256


class VisionAttention(nn.Module):
    """Fused qkv, 2-D rotary on q and k (in float32, as transformers), attention under an additive mask, in blocks
    of QUERY_ROWS queries."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = v.heads, v.head_dim
        self.qkv = nn.Linear(v.hidden, 3 * v.hidden)
        self.proj = nn.Linear(v.hidden, v.hidden)

    def forward(self, x, cos, sin, mask):  # x [N, hidden]; cos/sin [N, head_dim]; mask [N, N]
        n = x.shape[0]
        q, k, val = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # [N, heads, d] each
        q = layers.apply_rope(q.float(), cos, sin).to(x.dtype).transpose(0, 1)  # [heads, N, d]
        k = layers.apply_rope(k.float(), cos, sin).to(x.dtype).permute(1, 2, 0)  # [heads, d, N]
        val = val.transpose(0, 1)  # [heads, N, d]
        out = []
        for i in range(0, n, QUERY_ROWS):  # N is static in the graph: the blocks unroll
            p = torch.softmax(torch.matmul(q[:, i:i + QUERY_ROWS], k) * self.head_dim**-0.5 + mask[i:i + QUERY_ROWS],
                              dim=-1)
            out.append(torch.matmul(p, val))  # [heads, rows, d]
        o = torch.cat(out, dim=1) if len(out) > 1 else out[0]
        return self.proj(o.transpose(0, 1).reshape(n, -1))


class GatedMLP(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden, v.intermediate)
        self.up_proj = nn.Linear(v.hidden, v.intermediate)
        self.down_proj = nn.Linear(v.intermediate, v.hidden)
        self.act = layers.activation(v.act)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(v.hidden, v.intermediate)
        self.linear_fc2 = nn.Linear(v.intermediate, v.hidden)
        self.act = layers.activation(v.act)

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)); x + mlp(norm2(x)). Qwen2.5-VL: RMSNorm + gated MLP; Qwen3-VL: LayerNorm + plain MLP."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        if v.kind == "qwen2_5_vl":
            self.norm1, self.norm2, self.mlp = layers.RMSNorm(v.hidden, 1e-6), layers.RMSNorm(v.hidden, 1e-6), GatedMLP(v)
        else:
            self.norm1, self.norm2, self.mlp = nn.LayerNorm(v.hidden, eps=1e-6), nn.LayerNorm(v.hidden, eps=1e-6), PlainMLP(v)
        self.attn = VisionAttention(v)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class Qwen25Merger(nn.Module):
    """RMSNorm per patch, the merge block's patches side by side, Linear-GELU-Linear (Qwen2_5_VLPatchMerger)."""

    def __init__(self, v: VisionConfig):
        super().__init__()
        self.wide = v.hidden * v.merge_unit
        self.ln_q = layers.RMSNorm(v.hidden, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.wide, self.wide), nn.GELU(), nn.Linear(self.wide, v.out_hidden))

    def forward(self, x):  # [N, hidden] -> [N / merge², out_hidden]
        return self.mlp(self.ln_q(x).reshape(-1, self.wide))


class Qwen3Merger(nn.Module):
    """LayerNorm per patch (or, DeepStack's, over the merged row), Linear-GELU-Linear (Qwen3VLVisionPatchMerger)."""

    def __init__(self, v: VisionConfig, post_shuffle_norm: bool):
        super().__init__()
        self.wide, self.post = v.hidden * v.merge_unit, post_shuffle_norm
        self.norm = nn.LayerNorm(self.wide if post_shuffle_norm else v.hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.wide, self.wide)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.wide, v.out_hidden)

    def forward(self, x):  # [N, hidden] -> [N / merge², out_hidden]
        x = self.norm(x.reshape(-1, self.wide)) if self.post else self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen25Vision(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.fullatt = set(v.fullatt_blocks)
        self.patch_embed = PatchEmbed(v, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = Qwen25Merger(v)

    def forward(self, patches, cos, sin, full_mask, window_mask):
        x = self.patch_embed(patches)  # [N, hidden], window order
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_mask if i in self.fullatt else window_mask)
        return self.merger(x)  # [N / merge², out_hidden], window order


class Qwen3Vision(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.deepstack = list(v.deepstack_layers)
        self.patch_embed = PatchEmbed(v, bias=True)
        self.pos_embed = nn.Embedding(v.position_side**2, v.hidden)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = Qwen3Merger(v, post_shuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3Merger(v, post_shuffle_norm=True) for _ in self.deepstack)

    def forward(self, patches, pos_index, pos_weight, cos, sin, mask):
        pos = (self.pos_embed(pos_index) * pos_weight[:, :, None]).sum(1)  # [N, hidden]: the table interpolated
        x = self.patch_embed(patches) + pos
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in self.deepstack:
                features.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return (self.merger(x), *features)  # [N / merge², out_hidden] each


def input_names(v: VisionConfig) -> list[str]:
    """The vision graph's inputs, in forward's order (runtime/media/vision_inputs.py build_feeds makes them)."""
    if v.kind == "qwen2_5_vl":
        return ["patches", "rotary_cos", "rotary_sin", "full_mask", "window_mask"]
    return ["patches", "pos_index", "pos_weight", "rotary_cos", "rotary_sin", "attention_mask"]


def output_names(v: VisionConfig) -> list[str]:
    return ["embeds", *[f"deepstack_{i}" for i in range(len(v.deepstack_layers))]]


def host_inputs(v: VisionConfig) -> tuple[list[str], dict]:
    """(the host ops of runtime/media/vision_inputs.py this tower takes, their parameters): what the manifest records."""
    ops = ["rotary_2d", "window_order"] if v.kind == "qwen2_5_vl" else ["rotary_2d", "interpolated_positions"]
    params = {"head_dim": v.head_dim, "theta": v.theta, "merge": v.merge}
    params.update({"window": v.window, "patch": v.patch} if v.kind == "qwen2_5_vl" else {"position_side": v.position_side})
    return ops, params


def example_inputs(v: VisionConfig, rows: int, mask_value: float) -> tuple[torch.Tensor, ...]:
    """Inputs of the graph's shapes for a budget of `rows` patches (what the exporter traces with): one merge block's
    worth of zero patches, padded as the runtime pads."""
    import numpy as np

    from ...runtime.media import vision_inputs

    grid = (1, v.merge, v.merge)
    ops, params = host_inputs(v)
    f = vision_inputs.build_feeds(np.zeros((v.merge_unit, v.patch_dim), np.float32), grid, ops, params, rows,
                                  mask_value)
    return tuple(torch.from_numpy(f.feeds[n]) for n in input_names(v))


def build(v: VisionConfig) -> nn.Module:
    return Qwen25Vision(v) if v.kind == "qwen2_5_vl" else Qwen3Vision(v)


def vision_prefix(tensors) -> str:
    """Where the tower's weights are: `visual.` (Qwen2.5-VL's hub layout) or `model.visual.` (Qwen3-VL's, and
    transformers 5's own)."""
    for prefix in ("model.visual.", "visual."):
        if any(n.startswith(prefix) for n in tensors):
            return prefix
    raise UnsupportedCheckpoint("checkpoint has no vision tower weights (visual.* or model.visual.*)")


def load(v: VisionConfig, tensors: dict[str, torch.Tensor], take) -> nn.Module:
    """The vision tower from the checkpoint; take(name) fetches one tensor and records it as used."""
    prefix = vision_prefix(tensors)
    sd = {n[len(prefix):]: take(n) for n in tensors if n.startswith(prefix)}
    conv = sd["patch_embed.proj.weight"]  # [hidden, c, t, p, p]
    if tuple(conv.shape[1:]) != (v.in_channels, v.temporal_patch, v.patch, v.patch):
        raise UnsupportedCheckpoint(f"patch embedding {list(conv.shape)} does not match the config's patches")
    sd["patch_embed.proj.weight"] = conv.reshape(conv.shape[0], -1)
    tower = build(v)
    result = tower.load_state_dict(sd, strict=False)
    if result.missing_keys:
        raise UnsupportedCheckpoint(f"checkpoint is missing weight {prefix}{result.missing_keys[0]}")
    if result.unexpected_keys:
        raise UnsupportedCheckpoint(f"checkpoint has vision weights the config does not describe, e.g. "
                                    f"{prefix}{result.unexpected_keys[0]}")
    return tower.eval()


class StaticTower(nn.Module, VisionModule):
    """The tower as the exporter takes it: forward(*inputs in input_names' order) -> embeds, *DeepStack features;
    `example_inputs(rows, patch_dim)` its inputs by role for a budget of `rows` patches (families.vision_examples), `row_outputs`
    its outputs after the embeddings (families.vision_row_outputs: the decoder's row input)."""

    def __init__(self, tower: nn.Module, v: VisionConfig):
        super().__init__()
        self.tower, self.v = tower, v
        self.row_outputs = output_names(v)[1:]

    def forward(self, *inputs):
        return self.tower(*inputs)

    def example_inputs(self, rows: int, patch_dim: int) -> dict[str, torch.Tensor]:
        """(patch_dim: the host's; this tower's patch rows have their own width, temporal patches included)"""
        return dict(zip(input_names(self.v), example_inputs(self.v, rows, float(np.finfo(np.float32).min))))
