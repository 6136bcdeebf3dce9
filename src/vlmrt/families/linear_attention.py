"""ORT's com.microsoft LinearAttention (update_rule gated_delta) as a torch op, so that a Gated DeltaNet layer's
recurrence exports as one node (export/linear_attention_onnx.py maps it; ORT 1.32 has a CPU kernel).

    out, present = torch.ops.vlmrt.linear_attention(
        q [B, T, q_heads*dk] (l2-normalized), k [B, T, q_heads*dk] (l2-normalized), v [B, T, heads*dv],
        past [B, heads, dk, dv], decay [B, T, heads] (log space, <= 0), beta [B, T, heads], q_heads, heads)
    -> out [B, T, heads*dv], present [B, heads, dk, dv]

The gated delta rule token by token (transformers' torch_recurrent_gated_delta_rule, models/qwen3_5): each q/k head
serves heads / q_heads consecutive value heads; S <- exp(g) S; S <- S + k (beta (v - k^T S)); o = (q / sqrt(dk))^T S.
ORT computes the same (measured against transformers' recurrent form: outputs 1e-7 apart, the state bit for bit on
one token). The eager version below is its reference (the float reference, the GPTQ calibration).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("vlmrt::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor, q_heads: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, _ = q.shape
    dk, dv = past.shape[-2], past.shape[-1]
    rep = heads // q_heads
    qh = q.view(b, t, q_heads, dk).repeat_interleave(rep, 2).float() * dk**-0.5  # [B, T, heads, dk]
    kh = k.view(b, t, q_heads, dk).repeat_interleave(rep, 2).float()
    vh = v.view(b, t, heads, dv).float()
    s = past.float()
    out = []
    for i in range(t):
        s = s * decay[:, i].float().exp()[..., None, None]
        mem = (s * kh[:, i, :, :, None]).sum(-2)  # [B, heads, dv]
        delta = (vh[:, i] - mem) * beta[:, i].float()[..., None]
        s = s + kh[:, i, :, :, None] * delta[:, :, None, :]
        out.append((s * qh[:, i, :, :, None]).sum(-2))
    return torch.stack(out, 1).reshape(b, t, heads * dv).to(q.dtype), s.to(past.dtype)


@linear_attention.register_fake
def _(q, k, v, past, decay, beta, q_heads, heads):
    return q.new_empty(v.shape), torch.empty_like(past)
