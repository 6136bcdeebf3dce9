"""The windowed cache (runtime/decode/windowed_state.py, manifest WindowedAttentionLayer) against ORT's own
GroupQueryAttention with sliding_window_cache, one node (window 3, capacity 6: an eviction frees 4 rows every 4
slots): the layout formula (manifest.resident) is the op's, the eager reference (families/gqa.py) is the op, and every
rewind the state offers (restorable: the buffers as they are, or a snapshot) continues as a fresh run does, as does a
step kept in part where keeps() says so; a rewind it cannot make exactly is not offered. Guards: a state that took an
inexact rewind as exact (first slots compared wrongly, a snapshot missing) attends over evicted or shifted rows and
the outputs part from the fresh run's here.

Each test runs twice: the float cache, and the 8-bit one (`--kv-cache int8`: the node with kv_cache_bit_width 8 and
per-channel scales, the state's buffers, staging and snapshots int8). ORT 1.32 takes the quantized cache with
sliding_window_cache; its windowed int8 rows are the by-slot int8 node's rows byte for byte, so every rewind of the int8
state continues exactly as a fresh int8 run (the windowed state on main refused an int8 buffer)."""

import numpy as np
import pytest

from vlmrt.format.manifest import CacheQuant, KVSpec, WindowedAttentionLayer, resident
from vlmrt.runtime.decode.kv_cache import HEADS, KVCache

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

W, C, D, HEADS_Q, N = 3, 6, 16, 2, 40
# the 8-bit cache's scales: per channel, about the keys' / values' range after RoPE over 127 (rows are N(0, 1))
QUANT = CacheQuant(bits=8, key="per_channel", value="per_channel", key_scale=[0.03] * D, value_scale=[0.025] * D,
                   headroom=1.25, calibration_rows=N)
LAYERS = {bits: WindowedAttentionLayer("windowed_attention", 1, D, "past_key_0", "past_value_0", "present_key_0",
                                       "present_value_0", QUANT if bits else None, window=W, capacity=C)
          for bits in (0, 8)}


def _session(windowed: bool, bits: int = 0):
    from onnx import TensorProto as TP, helper, numpy_helper

    f = TP.FLOAT
    c = TP.INT8 if bits else f
    ins = [helper.make_tensor_value_info(n, t, s) for n, t, s in [
        ("q", f, [1, None, HEADS_Q * D]), ("k", f, [1, None, D]), ("v", f, [1, None, D]),
        ("past_key_0", c, [1, 1, None, D]), ("past_value_0", c, [1, 1, None, D]), ("seqlens_k", TP.INT32, [1]),
        ("total", TP.INT32, []), ("cos", f, [64, D // 2]), ("sin", f, [64, D // 2]), ("pos", TP.INT64, [1, None])]]
    attrs = dict(num_heads=HEADS_Q, kv_num_heads=1, do_rotary=1, local_window_size=W, scale=1.0)
    if windowed:
        attrs["sliding_window_cache"] = 1
    names, inits = [i.name for i in ins], []
    if bits:  # inputs 10, 11 (attention_bias, head_sink) none; 12, 13 the scales
        attrs.update(kv_cache_bit_width=8, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
        inits = [numpy_helper.from_array(np.asarray(s, np.float32).reshape(1, 1, D), n)
                 for n, s in (("k_scale", QUANT.key_scale), ("v_scale", QUANT.value_scale))]
        names += ["", "", "k_scale", "v_scale"]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key_0", "present_value_0"],
                            domain="com.microsoft", **attrs)
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in (("out", f), ("present_key_0", c),
                                                                   ("present_value_0", c))]
    m = helper.make_model(helper.make_graph([node], "gqa", ins, outs, inits),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


RNG = np.random.default_rng(3)
Q = RNG.standard_normal((1, N, HEADS_Q * D)).astype(np.float32)
K = RNG.standard_normal((1, N, D)).astype(np.float32)
V = RNG.standard_normal((1, N, D)).astype(np.float32)
_F = np.arange(64)[:, None] * 0.3 / (1 + np.arange(D // 2))[None, :]
COS, SIN = np.cos(_F).astype(np.float32), np.sin(_F).astype(np.float32)


def _feeds(a: int, b: int, past_k, past_v) -> dict:
    return dict(q=Q[:, a:b], k=K[:, a:b], v=V[:, a:b], past_key_0=past_k, past_value_0=past_v,
                seqlens_k=np.array([b - 1], np.int32), total=np.array(b, np.int32), cos=COS, sin=SIN,
                pos=np.arange(a, b)[None])


@pytest.fixture(scope="module", params=[0, 8], ids=["fp32", "int8"])
def ops(request):
    """(the windowed node, the by-slot node's outputs and present keys over all N rows, the cache's bits)."""
    bits = request.param
    win, full = _session(True, bits), _session(False, bits)
    z = np.zeros((1, 1, N, D), np.int8 if bits else np.float32)
    out, pk, _ = full.run(None, _feeds(0, N, z, z.copy()))
    return win, out[0], pk[0, 0], bits


class Driver:
    """A KVCache of one windowed layer stepped through the windowed node (the step's present into the staging,
    KVCache.store: what a bound step and CacheRow do)."""

    def __init__(self, win, bits: int = 0):
        self.win = win
        self.cache = KVCache(KVSpec(max_context=64, dtype="float32", layers=[LAYERS[bits]]), HEADS)
        assert self.cache.inputs()[0][1].dtype == (np.int8 if bits else np.float32)

    def call(self, ar: int):
        """One call over the next ar rows, not stored: (its outputs, the staging)."""
        c = self.cache
        a = c.length
        past = dict((name, buf) for name, buf, _ in c.inputs())
        out, pk, pv = self.win.run(None, _feeds(a, a + ar, past["past_key_0"], past["past_value_0"]))
        staged = c.staging(ar)
        c.take(staged, {"present_key_0": pk, "present_value_0": pv}, a, ar)
        return out[0], staged

    def step(self, ar: int, keep: int | None = None) -> np.ndarray:
        """A call over ar rows, its first `keep` (default all) stored; returns their outputs."""
        keep = ar if keep is None else keep
        a = self.cache.length
        out, staged = self.call(ar)
        self.cache.store(staged, keep, np.arange(a, a + ar)[None])
        return out[:keep]


def test_layout_formula_and_eager_reference_are_the_ops(ops):
    """After each step (blocks of 1..7 rows, larger than the capacity's slack too) rows [0, L(T)) of the op's present
    hold slots T - L(T) .. T - 1 (the by-slot node's keys there: in the int8 cache byte for byte); the eager reference
    gives the float op's outputs and present rows; the int8 rows are the float rows within half a scale step."""
    import torch

    from vlmrt.families import gqa

    win, ref_out, ref_keys, bits = ops
    if bits:  # the float by-slot node's keys: what the int8 rows hold, quantized
        z = np.zeros((1, 1, N, D), np.float32)
        float_keys = _session(False).run(None, _feeds(0, N, z, z.copy()))[1][0, 0]
        step = np.asarray(QUANT.key_scale, np.float32)
    pk = np.zeros((1, 1, C, D), ref_keys.dtype)
    pv = pk.copy()
    t, sizes = 0, [1, 3, 7, 2, 5, 1, 1, 4, 6, 3, 7]
    for s in sizes:
        f = _feeds(t, t + s, pk, pv)
        out, nk, nv = win.run(None, f)
        t += s
        n = resident(t, C, W)
        np.testing.assert_allclose(nk[0, 0, :n], ref_keys[t - n : t], rtol=0, atol=1e-5)
        np.testing.assert_allclose(out[0], ref_out[t - s : t], rtol=0, atol=1e-5)
        if bits:
            assert nk.dtype == np.int8
            err = np.abs(nk[0, 0, :n] * step - float_keys[t - n : t])
            assert (err <= step / 2 + 1e-5).all(), float(err.max())
        else:
            e = gqa.group_query_attention(*(torch.from_numpy(np.asarray(f[x])) for x in
                                            ("q", "k", "v", "past_key_0", "past_value_0", "seqlens_k", "total", "cos",
                                             "sin", "pos")), HEADS_Q, 1, W, 1.0, None, C)
            np.testing.assert_allclose(e[0].numpy(), out, rtol=0, atol=1e-5)
            np.testing.assert_allclose(e[1].numpy()[0, 0, :n], nk[0, 0, :n], rtol=0, atol=1e-5)
        pk, pv = nk, nv
    assert t == sum(sizes) and t > 4 * C


def test_every_offered_rewind_continues_as_a_fresh_run(ops):
    """A prompt in blocks of 4 (a checkpoint at each block end, as CacheRow.block takes them) and 12 decode steps;
    then for every n restorable offers, the rows from n on run again give the fresh run's outputs. Offered: each
    n whose first slot the buffers still share (a move of the length) and the block ends whose copies are kept;
    nothing else (the rest would need evicted rows)."""
    win, ref_out, _, bits = ops
    d = Driver(win, bits)
    for _ in range(5):  # 20 prompt slots
        d.step(4)
        d.cache.checkpoint()
    for _ in range(12):
        d.step(1)
    end = d.cache.length
    state = d.cache.states["windowed_attention"]
    assert state.costs["snapshots"] >= 2
    offered = {n for n in range(end + 1) if d.cache.restorable(n) == n}
    shared = {n for n in range(end + 1) if LAYERS[bits].first(n) == LAYERS[bits].first(end)}
    # the buffers' counts, the last two block ends (KEEP copies; the prompt's end survives the decode steps) and 0;
    # block end 4's copy was dropped: not offered
    assert offered >= shared | {0, 16, 20} and 4 not in offered
    assert offered != set(range(end + 1))  # (some counts need rows no copy holds)
    for n in sorted(offered, reverse=True):
        d2 = Driver(win, bits)
        for _ in range(5):
            d2.step(4)
            d2.cache.checkpoint()
        for _ in range(12):
            d2.step(1)
        restores = d2.cache.costs()["restores"]
        d2.cache.rewind(n)
        assert d2.cache.costs()["restores"] == restores + (n not in shared and n > 0)
        got = np.concatenate([d2.step(min(3, end - m)) for m in range(n, end, 3)]) if n < end else None
        if got is not None:
            np.testing.assert_allclose(got, ref_out[n:end], rtol=0, atol=1e-5, err_msg=f"rewind to {n}")


def test_a_step_kept_in_part_where_keeps_says(ops):
    """Verify-like calls of 4 rows at every slot 8..24, keeping 1..4 of them: kept alone where keeps() holds (no
    eviction between the kept rows' end and the call's), else the kept rows run again from the state before the
    call (what CacheRow.verify does); either way the next rows continue as the fresh run's."""
    win, ref_out, _, bits = ops
    stored_alone = replays = 0
    for pos in range(8, 25):
        for keep in range(1, 5):
            d = Driver(win, bits)
            d.step(pos)
            if d.cache.keeps(keep, 4):
                d.step(4, keep)
                stored_alone += keep < 4
            else:
                d.call(4)  # (its rows dropped: the buffers still hold the state before it)
                d.step(keep)
                replays += 1
            got = d.step(3)
            np.testing.assert_allclose(got, ref_out[pos + keep : pos + keep + 3], rtol=0, atol=1e-5)
    assert stored_alone > 0 and replays > 0
    with pytest.raises(ValueError, match="cannot be kept in part"):
        d = Driver(win, bits)
        d.step(C - 1)  # slot 5: a call of 4 evicts at slot 7, so keeping 1 (slot 6) would read the moved rows
        out, staged = d.call(4)
        d.cache.store(staged, 1, np.arange(C - 1, C + 3)[None])
