"""The int8 dot product this CPU gives ORT's int8-compute kernels (MatMulNBits accuracy_level 4, MatMulInteger):
with AVX-512 VNNI / AVX-VNNI they sum u8 x s8 products in 32 bits; on AVX2 without VNNI in pairs of 16 bits, which
saturate, so the *a8* precisions are measurably less exact there. Accuracy floors measured on one kind of CPU say
which (session 11: Intel Xeon with VNNI; session 12: AMD EPYC with AVX2 only). Read from cpuid as this process sees
it (numpy's dispatch table, as MLAS dispatches), so that a run under benchmarks/avx2-only (an AVX2-only CPU's cpuid on
a CPU with more) takes the AVX2 floors; AVX-VNNI (no AVX-512), which numpy does not list, from /proc/cpuinfo."""

from __future__ import annotations

import ctypes
import platform

import numpy as np


def int8_vnni() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return True  # the floors were measured on x86; other CPUs' dot products are 32-bit (ARM's sdot)
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        features = {}
    if features.get("AVX512VNNI") and features.get("AVX512BW"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    if features and not features.get("AVX512F") and "avx512_vnni" in flags:
        return False  # cpuid hides AVX-512 from this process (benchmarks/avx2-only): MLAS runs its AVX2 kernels
    return "avx512_vnni" in flags or "avx_vnni" in flags


VNNI = int8_vnni()


class MultiRowRounding:
    """A decoder session whose calls of more than one logits row compute them a little differently from one-row
    calls, as ORT's int8-compute MatMulNBits does on a CPU without VNNI (its one-row and multi-row AVX2 kernels round
    apart: the real SmolLM2-135M w4a8 decoder's logits up to 0.57 apart, benchmarks/avx2-only) and its float path
    does on every CPU (GEMV vs GEMM): each logits row of such a call gets a fixed pattern added, the graph's argmax
    output following it. by_width: the pattern scaled by the call's rows, so that calls of different widths disagree
    among themselves too. The pattern is larger than a kernel's rounding so that greedy answers part for sure."""

    def __init__(self, session, scale: float, by_width: bool = False, logits: str = "logits",
                 argmax: str = "next_token"):
        self._s, self.by_width, self._logits, self._argmax = session, by_width, logits, argmax
        vocab = next(o.shape[-1] for o in session.get_outputs() if o.name == logits)
        self.pattern = (np.random.default_rng(43).standard_normal(vocab) * scale).astype(np.float32)
        self.calls = 0  # calls whose rows it changed

    def __getattr__(self, name):
        return getattr(self._s, name)

    def _apply(self, logits: np.ndarray, argmax: np.ndarray | None) -> None:
        rows = logits.shape[0]
        if rows > 1:
            logits += self.pattern * (rows if self.by_width else 1)
            if argmax is not None:
                argmax[...] = logits.argmax(-1)
            self.calls += 1

    def io_binding(self):
        return _Binding(self._s.io_binding())

    def run_with_iobinding(self, io, run_options=None):
        self._s.run_with_iobinding(io.io, run_options)
        self._apply(io.view(self._logits), io.view(self._argmax) if self._argmax in io.outputs else None)

    def run(self, names, feeds, run_options=None):
        names = names or [o.name for o in self._s.get_outputs()]
        out = self._s.run(names, feeds, run_options)
        if self._logits in names:
            argmax = out[names.index(self._argmax)] if self._argmax in names else None
            self._apply(out[names.index(self._logits)], argmax)
        return out


class _Binding:
    """An IOBinding that remembers its outputs' OrtValues (for MultiRowRounding to change them in place)."""

    def __init__(self, io):
        self.io, self.outputs = io, {}

    def __getattr__(self, name):
        return getattr(self.io, name)

    def bind_ortvalue_output(self, name, value):
        self.outputs[name] = value
        self.io.bind_ortvalue_output(name, value)

    def view(self, name) -> np.ndarray:
        v = self.outputs[name]
        dtype = np.dtype({"tensor(float)": np.float32, "tensor(int64)": np.int64}[v.data_type()])
        n = int(np.prod(v.shape()))
        memory = (ctypes.c_char * (n * dtype.itemsize)).from_address(v.data_ptr())
        return np.frombuffer(memory, dtype).reshape(v.shape())


def plant_multi_row_rounding(monkeypatch, scale: float = 0.5, by_width: bool = False) -> list[MultiRowRounding]:
    """Sessions created from here on (runtime/sessions.make_session) of a graph with logits are MultiRowRounding;
    returns the list they are added to."""
    from vlmrt.runtime import sessions

    made, make = [], sessions.make_session

    def planted(*args, **kw):
        s = make(*args, **kw)
        if any(o.name == "logits" for o in s.get_outputs()):
            s = MultiRowRounding(s, scale, by_width)
            made.append(s)
        return s

    monkeypatch.setattr(sessions, "make_session", planted)
    return made
