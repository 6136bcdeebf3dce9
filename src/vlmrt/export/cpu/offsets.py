"""4-bit weights with a float offset per block (`w4a16o`, `w4a8o`): GGUF Q4_1's rule on ORT's fast symmetric kernel.

Rule (per output column n, per block b of 32 rows along K — the blocks MatMulNBits uses):
    m = min(block), d = (max(block) - m) / 15, q = clamp(floor((w - m) / d + 1/2), 0, 15),  w ≈ d·q + m
(`q4_min_max`; llama.cpp's quantize_row_q4_1). Weights that were a Q4_1 GGUF (the real SmolLM2-135M decoder)
sit exactly on this grid: the rule gives them back without loss. For float-trained weights it is asymmetric
min/max round-to-nearest with a float (not integer) zero point: the 4-bit grid spans each block's own range.

The graph. MatMulNBits takes float zero points, but ORT 1.32's CPU kernel then runs 15-40x slower than the
symmetric one (docs/precisions.md), and integer zero points cannot hold -m/d (integral in 0.4 % of the real
decoder's blocks). So each projection is the symmetric kernel (zero point 8) plus the offsets' term:
    x·W = Σ_b x_b·(d_b(q_b − 8)) + Σ_b S_b(x)·c_b,   c_b = m_b + 8·d_b,  S_b(x) = Σ_{k in block b} x_k
The block sums S(x) come out of the same MatMulNBits as nb extra output columns whose weights are exactly 1
on their block and 0 elsewhere (scale 1, q 9 / 8: exact in 4 bits); a Split and one small Gemm
(S [M, nb] @ C [nb, N] + the symmetric part) finish it. With int8 compute (accuracy_level 4) S is the sum of
the int8-quantized activations the main term multiplies, so the result is exactly x̂·(d·q + m).

`w4a16og` / `w4a8og`: the same grid and graph, q (and each block's d, m) chosen by GPTQ on the calibration Hessian of
the weight's input instead of rounding to nearest (`gptq_min_max`, export/cpu/gptq.py's OFFSET grid): on weights
already on the grid (a Q4_1 GGUF's) every column rounds without error and GPTQ gives them back as the rule does (to
float rounding); on
float-trained weights it keeps x·W, not W, close.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .gptq import OFFSET, gptq
from .weight_matmuls import rewrite_weight_matmuls

BLOCK = 32


def q4_min_max(w_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N] -> q [N, nb, 32] uint8 (rows past K repeat the last row), d [N, nb], m [N, nb] (float32)."""
    k, n = w_kn.shape
    nb = -(-k // BLOCK)
    w = np.pad(np.asarray(w_kn, np.float32), ((0, nb * BLOCK - k), (0, 0)), mode="edge")
    b = np.ascontiguousarray(w.T).reshape(n, nb, BLOCK)  # [N, nb, 32]
    m = b.min(-1)
    d = ((b.max(-1) - m) / np.float32(15)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.floor((b - m[..., None]) * inv[..., None] + np.float32(0.5)), 0, 15).astype(np.uint8)
    return q, d, m


def dequantize(q: np.ndarray, d: np.ndarray, m: np.ndarray, k: int) -> np.ndarray:
    """q, d, m as q4_min_max returns them -> W [K, N] float32 (d·q + m)."""
    w = q.astype(np.float32) * d[..., None] + m[..., None]  # [N, nb, 32]
    return np.ascontiguousarray(w.reshape(len(w), -1)[:, :k].T)


def pack(q: np.ndarray) -> np.ndarray:
    """[N, nb, 32] values 0..15 -> MatMulNBits' B [N, nb, 16] uint8, the even element in the low nibble."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def offsets_matmul(name: str, x: str, y: str, q: np.ndarray, d: np.ndarray, m: np.ndarray, k: int,
                   accuracy_level: int | None, two_d: bool = True):
    """One constant-weight MatMul x[M, K] @ W[K, N], W given as q [N, nb, 32], d, m [N, nb] (q4_min_max's), ->
    (nodes, initializers) computing x·(d·q + m)."""
    n, nb = d.shape
    ones = np.full((nb, nb, BLOCK), 8, np.uint8)  # the block-sum columns: 1 = 1·(9 − 8) on their block, 0 elsewhere
    ones[np.arange(nb), np.arange(nb)] = 9
    blob = np.concatenate([pack(q), pack(ones)])  # [N + nb, nb, 16]
    scales = np.concatenate([d, np.ones((nb, nb), np.float32)]).reshape(-1)
    c = np.ascontiguousarray((m + 8 * d).T)  # [nb, N]
    inits = [numpy_helper.from_array(blob, f"{name}_Q4"), numpy_helper.from_array(scales, f"{name}_scales"),
             numpy_helper.from_array(c, f"{name}_offsets"),
             numpy_helper.from_array(np.array([n, nb], np.int64), f"{name}_offsets_sizes")]
    attrs = dict(K=k, N=n + nb, bits=4, block_size=BLOCK)
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    nodes = [
        helper.make_node("MatMulNBits", [x, f"{name}_Q4", f"{name}_scales"], [f"{name}_all"], name=f"{name}_Q4",
                         domain="com.microsoft", **attrs),  # [M, N + nb]
        helper.make_node("Split", [f"{name}_all", f"{name}_offsets_sizes"], [f"{name}_sym", f"{name}_sums"],
                         name=f"{name}_offsets_split", axis=-1),  # [M, N], [M, nb]
    ]
    if two_d:  # one op: sums @ C + sym
        nodes.append(helper.make_node("Gemm", [f"{name}_sums", f"{name}_offsets", f"{name}_sym"], [y], name=f"{name}_offsets_gemm"))
    else:
        nodes += [helper.make_node("MatMul", [f"{name}_sums", f"{name}_offsets"], [f"{name}_corr"], name=f"{name}_offsets_matmul"),
                  helper.make_node("Add", [f"{name}_sym", f"{name}_corr"], [y], name=f"{name}_offsets_add")]
    return nodes, inits


def gptq_min_max(w_kn: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q4_min_max's (q, d, m) with the q chosen by GPTQ on the Hessian h [K, K] of the weight's input (the grid of
    each block taken from the error-updated weights as GPTQ reaches it: gptq.OFFSET)."""
    q, d, z = gptq(w_kn, h, grid=OFFSET)
    return q, d, (-d * z).astype(np.float32)


def offset_nodes(model: onnx.ModelProto, accuracy_level: int | None, exclude: set[str], hessian=None) -> list:
    """model's nodes with every constant-weight MatMul not in exclude as offsets_matmul (whose initializers are
    appended to the graph; the caller sets the nodes and drops the weights no node reads: quantize.set_nodes), the
    blocks rounded to nearest (q4_min_max), or by GPTQ with hessian(weight name) -> H [K, K] (gptq_min_max)."""
    g = model.graph
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in [*g.input, *g.value_info, *g.output]}

    def rule(node, name, w):
        qdm = q4_min_max(w) if hessian is None else gptq_min_max(w, hessian(name))
        return offsets_matmul(node.name or node.output[0], node.input[0], node.output[0], *qdm, w.shape[0],
                              accuracy_level, two_d=ranks.get(node.input[0], 2) == 2)  # the exporter's Linear inputs are 2-D

    return rewrite_weight_matmuls(model, exclude, "w4a16o / w4a8o / w4a16og / w4a8og", rule)
