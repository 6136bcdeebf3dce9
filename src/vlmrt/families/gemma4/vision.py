"""Gemma 4's vision tower and its embedder as one static graph over a patch budget (transformers 5.24
modeling_gemma4.py Gemma4VisionModel + Gemma4MultimodalEmbedder are the reference).

The host (as transformers' Gemma4ImageProcessor) resizes an image at its aspect ratio to sides that are multiples of
pooling_kernel × patch_size within max_soft_tokens × kernel² patches, cuts it into patch rows (channels last in a
row, rescaled to [0, 1]), and pads the rows to the budget (max_soft_tokens × kernel²) with zero rows at position
(-1, -1). The graph takes

    patches [budget, 3·p²], positions [budget, 2] int64 (x, y; -1 for a padding row)

and returns the image-token rows [budget / kernel², text hidden + layers × per_layer]: the image's n soft tokens
first (the pooling kernels in row order; the host keeps n = the image's patches / kernel²), each the embedder's
projection of the pooled tower output, with the pad token's per-layer rows beside it (what the decoder's token rows
carry at an image token: families/gemma4/language.py).

Inside: 2·(x − 0.5) through the patch projection plus the x and y position embeddings (zero on padding rows); layers
of bidirectional attention over the valid rows (padding keys masked; q/k RMSNorm, v norm without weight, scale 1,
2-D axial RoPE: the first half of each head rotates by x, the second by y), sandwich norms, a gated MLP (optionally
clipped linears); the padding rows zeroed, each kernel² block of the grid averaged (a one-hot pooling matrix built
from the positions), × sqrt(vision hidden), optionally standardized; RMSNorm without weight, the projection.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import VisionModule
from .language import Gemma4RMSNorm, _act


class ClippedLinear(nn.Module):
    """transformers' Gemma4ClippableLinear: a bias-free linear, its input and output clamped where the checkpoint
    clips (use_clipped_linears; the bounds are checkpoint buffers)."""

    def __init__(self, n_in: int, n_out: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.tensor(0.0))

    def forward(self, x):
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = self.linear(x)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class VisionLayer(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        h, heads, d, eps, clip = v["hidden_size"], v["num_attention_heads"], v["head_dim"], v["rms_norm_eps"], \
            v.get("use_clipped_linears", False)
        kvh = v.get("num_key_value_heads", heads)
        self.heads, self.kv_heads, self.head_dim = heads, kvh, d
        self.q_proj = ClippedLinear(h, heads * d, clip)
        self.k_proj = ClippedLinear(h, kvh * d, clip)
        self.v_proj = ClippedLinear(h, kvh * d, clip)
        self.o_proj = ClippedLinear(heads * d, h, clip)
        self.q_norm = Gemma4RMSNorm(d, eps)
        self.k_norm = Gemma4RMSNorm(d, eps)
        self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)
        self.gate_proj = ClippedLinear(h, v["intermediate_size"], clip)
        self.up_proj = ClippedLinear(h, v["intermediate_size"], clip)
        self.down_proj = ClippedLinear(v["intermediate_size"], h, clip)
        self.act = _act(v.get("hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)

    def attend(self, x, cos, sin, mask):
        n, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        half = d // 2
        q = self.q_norm(self.q_proj(x).view(n, h, d))
        k = self.k_norm(self.k_proj(x).view(n, kvh, d))
        v = self.v_norm(self.v_proj(x).view(n, kvh, d))
        # 2-D axial RoPE: channels [0, d/2) rotate by x, [d/2, d) by y, each half rotate-half within itself
        q = torch.cat([_rotate(q[..., :half], cos[0], sin[0]), _rotate(q[..., half:], cos[1], sin[1])], -1)
        k = torch.cat([_rotate(k[..., :half], cos[0], sin[0]), _rotate(k[..., half:], cos[1], sin[1])], -1)
        k = k.repeat_interleave(h // kvh, 1)
        v = v.repeat_interleave(h // kvh, 1)
        scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) + mask  # [h, n, n], scale 1
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1).reshape(n, h * d)
        return self.o_proj(out)

    def forward(self, x, cos, sin, mask):
        x = x + self.post_attention_layernorm(self.attend(self.input_layernorm(x), cos, sin, mask))
        y = self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y)))


class Gemma4Vision(nn.Module, VisionModule):
    """The tower + embedder (module doc); forward(patches [budget, 3·p²], positions [budget, 2] int64) ->
    [budget / kernel², text hidden + per-layer width]."""

    def __init__(self, v: dict, text_hidden: int, per_layer_pad: torch.Tensor, budget: int):
        super().__init__()
        h, p = v["hidden_size"], v["patch_size"]
        self.kernel = int(v.get("pooling_kernel_size", 3))
        self.budget, self.hidden = budget, h
        self.input_proj = nn.Linear(3 * p * p, h, bias=False)
        self.position_embedding_table = nn.Parameter(torch.zeros(2, int(v.get("position_embedding_size", 10240)), h))
        self.layers = nn.ModuleList(VisionLayer(v) for _ in range(v["num_hidden_layers"]))
        self.standardize = bool(v.get("standardize", False))
        if self.standardize:
            self.register_buffer("std_bias", torch.zeros(h))
            self.register_buffer("std_scale", torch.ones(h))
        self.embedding_pre_projection_norm = Gemma4RMSNorm(h, v["rms_norm_eps"], with_scale=False)
        self.embedding_projection = nn.Linear(h, text_hidden, bias=False)
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", 100.0))
        spatial = v["head_dim"] // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial),
                             persistent=False)
        self.register_buffer("per_layer_pad", per_layer_pad, persistent=False)  # [L·P] (empty: no per-layer rows)

    def example_inputs(self, rows: int, patch_dim: int) -> dict:
        return {"patches": torch.zeros(self.budget, patch_dim), "positions": torch.full((self.budget, 2), -1)}

    def forward(self, patches, positions):
        padding = (positions == -1).all(-1)  # [budget]
        pos = positions.clamp(min=0)
        x = self.input_proj(2 * (patches - 0.5))
        emb = self.position_embedding_table[0][pos[:, 0]] + self.position_embedding_table[1][pos[:, 1]]
        x = x + torch.where(padding[:, None], 0.0, emb)
        freqs = positions.float()[:, :, None] * self.inv_freq  # [budget, 2 (x, y), d/4]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, :, None, :].unbind(1)  # each [budget, 1, d/2]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, :, None, :].unbind(1)
        mask = torch.where(padding, torch.finfo(x.dtype).min, 0.0)[None, None, :]  # keys: padding masked
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = x.masked_fill(padding[:, None], 0.0)
        k = self.kernel
        length = self.budget // (k * k)
        max_x = pos[:, 0].max() + 1
        cells = torch.div(pos, k, rounding_mode="floor")
        index = cells[:, 0] + torch.div(max_x, k, rounding_mode="floor") * cells[:, 1]  # [budget]
        weights = (index[:, None] == torch.arange(length)[None, :]).float() / (k * k)  # [budget, length]
        pooled = weights.transpose(0, 1) @ x.float() * self.hidden ** 0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        out = self.embedding_projection(self.embedding_pre_projection_norm(pooled.to(x.dtype)))  # (fp16 graphs)
        if self.per_layer_pad.numel():
            out = torch.cat([out, self.per_layer_pad[None].expand(length, -1)], dim=1)
        return out


def load(v: dict, take, prefix: str, text_hidden: int, per_layer_pad: torch.Tensor, budget: int) -> Gemma4Vision:
    """The tower from the checkpoint's tensors (`model.vision_tower.`, the embedder `model.embed_vision.`)."""
    tower = Gemma4Vision(v, text_hidden, per_layer_pad, budget)
    sd = {"input_proj.weight": take(prefix + "vision_tower.patch_embedder.input_proj.weight"),
          "position_embedding_table": take(prefix + "vision_tower.patch_embedder.position_embedding_table"),
          "embedding_projection.weight": take(prefix + "embed_vision.embedding_projection.weight")}
    if tower.standardize:
        sd["std_bias"] = take(prefix + "vision_tower.std_bias")
        sd["std_scale"] = take(prefix + "vision_tower.std_scale")
    for i, layer in enumerate(tower.layers):
        src = f"{prefix}vision_tower.encoder.layers.{i}."
        for name in layer.state_dict():
            theirs = name
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                theirs = theirs.replace(f"{proj}.", f"self_attn.{proj}.", 1) if theirs.startswith(proj) else theirs
            for norm in ("q_norm", "k_norm"):
                theirs = f"self_attn.{theirs}" if theirs.startswith(norm) else theirs
            for proj in ("gate_proj", "up_proj", "down_proj"):
                theirs = f"mlp.{theirs}" if theirs.startswith(proj) else theirs
            sd[f"layers.{i}.{name}"] = take(src + theirs)
    tower.load_state_dict(sd, strict=True)
    return tower.eval()
