"""4-bit GPTQ with integer zero points on ORT's fast MatMulNBits kernel (`w4a16g`, `w4a8g`).

Rule (per output column n, per block b of 32 rows along K — MatMulNBits' blocks), asymmetric with an integer
zero point, as ORT's own asymmetric RTN: lo = min(block, 0), hi = max(block, 0), d = (hi − lo) / 15,
z = round(−lo / d) in 0..15, w ≈ d·(q − z) with q in 0..15. MatMulNBits takes z as its uint8 zero points:
measured as fast as the symmetric kernel (docs/precisions.md), unlike float zero points (40-70x slower).

The weights: GPTQ (Frantar et al. 2022), column by column along K with the inverse Hessian of the layer's
inputs, H = Σ xᵀx over calibration activations (`hessians`): each column is rounded to the block's grid and its
error spread over the columns not yet rounded, so that x·W, not W, stays close. The block's (d, z) are taken from
the error-updated weights when GPTQ reaches the block. Dampening 1 % of mean(diag H), lazy batches of 128.

The grid is a parameter: `ZERO_POINT` (the rule above) or `OFFSET` (GGUF Q4_1's min/max grid with a float zero
point, z = −min/d: the block-offset precisions calibrated, `w4a16og` / `w4a8og`, export/cpu/offsets.py). On weights
that already sit on the OFFSET grid (a Q4_1 GGUF's) every column rounds without error, nothing is spread, and GPTQ
gives them back as round-to-nearest does (to float rounding: max |Δ| 7e-7 on a random grid matrix).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .weight_matmuls import rewrite_weight_matmuls

BLOCK = 32
DAMP = 0.01


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)


class Grid(NamedTuple):
    fit: Callable  # wb [N, 32] -> d [N], z [N] (float32): the block's grid d·(q − z), q in 0..15
    round: Callable  # (w [N], d [N], z [N]) -> q [N] in 0..15, the nearest grid point


def _zero_point_fit(wb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """z integral in 0..15: the block's asymmetric grid with 0 on it."""
    lo = np.minimum(wb.min(1), 0)
    hi = np.maximum(wb.max(1), 0)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    z = np.clip(np.rint(-lo / np.where(d > 0, d, 1)), 0, 15).astype(np.float32)
    return d, z


def _offset_fit(wb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1's grid: m = min, d = (max − m)/15, as the float z = −m/d (the offset m = −d·z). A constant block gets
    d = |m| (1 if m = 0), so that its q = 0 gives back m."""
    lo, hi = wb.min(1), wb.max(1)
    d = np.where(hi > lo, (hi - lo) / np.float32(15), np.where(lo != 0, np.abs(lo), 1)).astype(np.float32)
    return d, (-lo / d).astype(np.float32)


ZERO_POINT = Grid(_zero_point_fit, lambda w, d, z: np.clip(np.rint(w * _inverse(d)) + z, 0, 15))
OFFSET = Grid(_offset_fit, lambda w, d, z: np.clip(np.floor(w * _inverse(d) + z + np.float32(0.5)), 0, 15))


def gptq(w_kn: np.ndarray, h: np.ndarray | None, batch: int = 128,
         grid: Grid = ZERO_POINT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [K, N], h [K, K] (None: round to nearest) -> q [N, nb, 32] uint8, d [N, nb], z [N, nb] (float32)."""
    k, n = w_kn.shape
    nb = -(-k // BLOCK)
    w = np.ascontiguousarray(np.pad(np.asarray(w_kn, np.float32), ((0, nb * BLOCK - k), (0, 0)), mode="edge").T)  # [N, Kp]
    kp = nb * BLOCK
    if h is None:
        u = np.eye(kp, dtype=np.float32)  # no error feedback
    else:
        hh = np.zeros((kp, kp))
        hh[:k, :k] = h
        dead = np.diag(hh) == 0  # inputs that never fire (and the padding): their weights do not matter
        hh[dead, dead] = 1
        w[:, dead] = 0
        hh[np.diag_indices(kp)] += DAMP * np.mean(np.diag(hh))
        u = np.linalg.cholesky(np.linalg.inv(hh)).T.astype(np.float32)  # upper: inv(H) = uᵀu
    q = np.zeros((n, kp), np.uint8)
    d = np.zeros((n, nb), np.float32)
    z = np.zeros((n, nb), np.float32)
    for i1 in range(0, kp, batch):
        i2 = min(i1 + batch, kp)
        w1 = w[:, i1:i2].copy()
        err = np.zeros_like(w1)
        for j in range(i2 - i1):
            c = i1 + j
            if c % BLOCK == 0:
                d[:, c // BLOCK], z[:, c // BLOCK] = grid.fit(w1[:, j:j + BLOCK])
            qc = grid.round(w1[:, j], d[:, c // BLOCK], z[:, c // BLOCK])
            q[:, c] = qc
            e = (w1[:, j] - d[:, c // BLOCK] * (qc - z[:, c // BLOCK])) / u[c, c]
            w1[:, j:] -= np.outer(e, u[c, i1 + j:i2])
            err[:, j] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return q.reshape(n, nb, BLOCK), d, z


def dequantize(q: np.ndarray, d: np.ndarray, z: np.ndarray, k: int) -> np.ndarray:
    """q, d, z as gptq returns them -> W [K, N] float32 (d·(q − z))."""
    w = (q.astype(np.float32) - z[..., None]) * d[..., None]  # [N, nb, 32]
    return np.ascontiguousarray(w.reshape(len(w), -1)[:, :k].T)


def pack(q: np.ndarray) -> np.ndarray:
    """[..., 2m] values 0..15 -> [..., m] uint8, the even element in the low nibble (MatMulNBits' B and zero points)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def zp_matmul(name: str, x: str, y: str, w_kn: np.ndarray, h: np.ndarray | None, accuracy_level: int | None):
    """One constant-weight MatMul x[M, K] @ W[K, N] -> (node, initializers): MatMulNBits with uint8 zero points."""
    k, n = w_kn.shape
    q, d, z = gptq(w_kn, h)
    nb = q.shape[1]
    zq = np.pad(z.astype(np.uint8), ((0, 0), (0, nb % 2)))  # [N, nb rounded up to even]
    inits = [numpy_helper.from_array(pack(q), f"{name}_Q4"), numpy_helper.from_array(d.reshape(-1), f"{name}_scales"),
             numpy_helper.from_array(pack(zq).reshape(-1), f"{name}_zero_points")]
    attrs = dict(K=k, N=n, bits=4, block_size=BLOCK)
    if accuracy_level is not None:
        attrs["accuracy_level"] = accuracy_level
    node = helper.make_node("MatMulNBits", [x, *(i.name for i in inits)], [y], name=f"{name}_Q4", domain="com.microsoft",
                            **attrs)
    return node, inits


def gptq_nodes(model: onnx.ModelProto, hessian, accuracy_level: int | None, exclude: set[str]) -> list:
    """model's nodes with every constant-weight MatMul not in exclude as zp_matmul; hessian(weight name) -> H [K, K]
    of that MatMul's input, or None (round to nearest). The new initializers are appended to the graph; the caller
    sets the nodes and drops the weights no node reads (quantize.set_nodes)."""

    def rule(node, name, w):
        new, new_inits = zp_matmul(node.name or node.output[0], node.input[0], node.output[0], w, hessian(name),
                                   accuracy_level)
        return [new], new_inits

    return rewrite_weight_matmuls(model, exclude, "w4a16g / w4a8g", rule)
