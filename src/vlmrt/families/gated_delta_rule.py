"""The gated delta rule over one static block of rows in plain ops (Mul, Add, Sub, Exp, ReduceSum), for graphs that
cannot have ORT's LinearAttention node (the QNN EP has no such op: the HTP target's static graphs), and the causal
conv's window taken at a block's last real row. A static graph pads a prompt's last block; `valid` [T] (1: a real row,
0: padding, a prefix of ones) keeps the padding out of the state: a padded row has beta 0 (it writes nothing) and
decay 0 in log space (it keeps the state as it is), so the state after the block is the state after its last real row.

The block is its T rows' recurrent steps, unrolled (transformers' torch_recurrent_gated_delta_rule, each q/k head
serving heads / q_heads consecutive value heads): S <- exp(g) S; S <- S + k (beta (v - k^T S)); o = (q / sqrt(dk))^T S,
each product a broadcast Mul and a ReduceSum, never a MatMul of two activations: the HTP (QNN 2.7.0's simulator,
v79) computes such a MatMul with its second input at ~8 bits (a 0/1 selection times 16-bit rows of range 2.6: 0.014
off, 1e-4 as Mul + ReduceSum, 4e-4 with the operands swapped), and the chunked (WY) form, all such MatMuls (with
(I + L)^-1 as (I - L)(I + L^2)(I + L^4)...), had the simulator's greedy ids part from the CPU EP's from the first token
(docs/qwen-vl.md#qwen35)."""

from __future__ import annotations

import torch


def gated_delta_block(q, k, v, state, g, beta, valid, q_heads: int, heads: int):
    """q, k [T, q_heads * dk] (l2-normalized), v [T, heads * dv], state [heads, dk, dv], g (log decay, <= 0) and beta
    [T, heads], valid [T] -> (out [T, heads * dv], the state after the last real row), in float32."""
    outs, s = [], state.float()
    for i in range(q.shape[0]):
        o, s = _step(q[i], k[i], v[i], s, g[i], beta[i], valid[i], q_heads, heads)
        outs.append(o)
    return torch.stack(outs), s


def _step(q, k, v, state, g, beta, valid, q_heads: int, heads: int):
    """One row: q, k [q_heads * dk], v [heads * dv], state [heads, dk, dv], g and beta [heads], valid [] -> (out
    [heads * dv], the state after it)."""
    dk, dv = state.shape[-2], state.shape[-1]
    rep = heads // q_heads
    qh = q.float().reshape(q_heads, 1, dk).expand(q_heads, rep, dk).reshape(heads, dk, 1) * dk**-0.5
    kh = k.float().reshape(q_heads, 1, dk).expand(q_heads, rep, dk).reshape(heads, dk, 1)
    s = state * torch.exp(g.float() * valid).reshape(heads, 1, 1)  # (padding: exp(0), the state kept)
    delta = (v.float().reshape(heads, dv) - (s * kh).sum(1)) * (beta.float() * valid)[:, None]  # [heads, dv]
    s = s + kh * delta[:, None, :]
    return (s * qh).sum(1).reshape(heads * dv), s


def window_at_last_row(seq, valid, width: int):
    """The last `width` rows of seq [width + T, C] (a conv window, then the block's T rows) up to the block's last real
    row: rows n .. n + width - 1 for n real rows (valid [T], a prefix of ones), as a one-hot [width, width + T]
    selection (built from valid by slices: static shapes) applied as a broadcast product and a sum (not a MatMul:
    the module doc)."""
    held = torch.cat([torch.ones(width, dtype=valid.dtype), valid])  # [width + T]: 1 up to the last real row
    last = held - torch.cat([held[1:], torch.zeros(1, dtype=valid.dtype)])  # one-hot at index n + width - 1
    pad = torch.zeros(width, dtype=valid.dtype)
    # row j of the window is seq[n + j]: the one-hot moved back by width - 1 - j
    sel = torch.stack([torch.cat([last[width - 1 - j:], pad[:width - 1 - j]]) for j in range(width)])
    return (sel.to(seq.dtype)[:, :, None] * seq[None]).sum(1)
