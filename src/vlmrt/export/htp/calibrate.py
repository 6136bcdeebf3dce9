"""Calibration of the HTP graphs: the float bundle run by the runtime over the calibration samples, each graph's
calls recorded (export/htp/bundle.py quantizes each graph on its own recorded inputs), and the KV rows' ranges that give
the uint8 cache its encodings.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import numpy as np

from ...format import manifest as mf
from ..cache_kinds import encoded_edges

RECORD_BYTES = 1 << 30  # the most bytes of sampled feeds a Recorder keeps (a 1B decoder's cache: ~70 MB a call)


class Recorder:
    """Wraps a session; keeps compact copies of the feeds of up to `limit` calls (reservoir sampling
    over all calls; fewer when they would pass `budget` bytes: random ones are dropped and the limit lowered)
    plus every call that starts a sequence (a step at slot < 4: the first tokens carry the
    LLM's largest activations, and a range that misses them clips the attention sink), KV caches cut
    to their used rows (the rest is zeros when read back). mask: the rows kinds' mask input, from which a call's
    slot is read (the cache slots it sees: the zero columns of its first row before the step's own)."""

    def __init__(self, session, kv_inputs: set[str], limit: int, mask: str = "attention_mask",
                 budget: int = RECORD_BYTES):
        self.session, self.kv_inputs, self.limit, self.mask = session, kv_inputs, limit, mask
        self.first: list[dict] = []
        self.sampled: list[dict] = []
        self.calls = 0
        self.rng = np.random.default_rng(0)
        self.budget, self.bytes = budget, 0

    def run(self, names, feeds):
        self.calls += 1
        used = slot_of(feeds[self.mask]) if self.mask in feeds else 0

        def item():
            return {k: (np.array(v[:used]), v.shape) if k in self.kv_inputs else (np.array(v), None) for k, v in feeds.items()}

        if self.mask in feeds and used < 4:
            self.first.append(item())
        else:
            slot = len(self.sampled) if len(self.sampled) < self.limit else int(self.rng.integers(0, self.calls))
            if slot == len(self.sampled) < self.limit:
                self.sampled.append(item())
                self.bytes += _nbytes(self.sampled[-1])
            elif slot < self.limit:
                self.bytes -= _nbytes(self.sampled[slot])
                self.sampled[slot] = item()
                self.bytes += _nbytes(self.sampled[slot])
            while len(self.sampled) > 1 and self.bytes > self.budget:
                self.bytes -= _nbytes(self.sampled.pop(int(self.rng.integers(0, len(self.sampled)))))
                self.limit = len(self.sampled)
        return self.session.run(names, feeds)

    @property
    def feeds(self) -> list[dict]:
        return self.first + self.sampled

    def reader(self):
        return list_reader(self.feeds, _unpacked)


def slot_of(mask: np.ndarray) -> int:
    """The first cache slot of a rows-kind step, from its additive mask [ar, ctx + ar]: the cache slots its first
    row sees (slots 0..slot-1 are visible, the rest hidden)."""
    ctx = mask.shape[1] - mask.shape[0]
    return int(np.count_nonzero(mask[0, :ctx] == 0))


def list_reader(items: list, feed):
    """An ORT CalibrationDataReader over items, each handed to the quantizer as feed(item) (a feeds dict)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(items)

        def get_next(self):
            item = next(self.it, None)
            return None if item is None else feed(item)

        def rewind(self):
            self.it = iter(items)

    return Reader()


def _unpacked(item: dict) -> dict:
    """A recorded call's feeds as the graph takes them: KV inputs, kept as their used rows, zero-padded back."""
    out = {}
    for k, (v, shape) in item.items():
        if shape is None:
            out[k] = v
        else:
            full = np.zeros(shape, v.dtype)
            full[: len(v)] = v
            out[k] = full
    return out


def _nbytes(item: dict) -> int:
    return sum(v.nbytes for v, _ in item.values())


def kv_ranges(rec: "RowsRecorder") -> dict[str, list[tuple[float, float]]]:
    """Per-layer (min, max) of the state rows a graph returned over its calibration calls, by encoding name (the K and
    V rows of the attention layers; the conv rows of the conv layers, where the decoder has any)."""
    return {name: list(r) for name, r in rec.ranges.items()}


def uint8_encoding(lo: float, hi: float) -> tuple[float, int]:
    lo, hi = min(lo, 0.0), max(hi, 0.0)  # zero must be exact (empty slots, padding)
    scale = max(hi - lo, 1e-8) / 255.0
    return float(np.float32(scale)), int(np.clip(round(-lo / scale), 0, 255))


class RowsRecorder(Recorder):
    """Also keeps the running per-layer (min, max) of the state rows every call returns (for the cache encodings: K
    and V per attention layer, the conv rows per conv layer of kv.layers; the rows themselves are not kept: at
    InternVL3.5-1B's shape they would be ~0.6 GB)."""

    def __init__(self, session, kv_inputs, limit, positions, budget: int = RECORD_BYTES, layers: list | None = None):
        """layers: the manifest's kv.layers (default: an attention layer per K/V pair of kv_inputs)."""
        super().__init__(session, kv_inputs, limit, positions, budget)
        if layers is None:
            layers = [mf.AttentionLayer("attention", 0, 0, "", "", "", "")] * (len(kv_inputs) // 2)
        self.layers = layers
        self.edges = encoded_edges(layers)  # (encoding name, its index, ...) per state output, in order
        self.ranges: dict[str, list[tuple[float, float]]] = {"key": [], "value": []}
        for name, _, _, _ in self.edges:
            self.ranges.setdefault(name, []).append((np.inf, -np.inf))

    def run(self, names, feeds):
        out = super().run(names, feeds)
        by_name = dict(zip(names, out))
        for name, i, _, fout in self.edges:  # (a layer kind without encodings, a recurrent layer's, has no edge)
            r = by_name[fout]
            lo, hi = self.ranges[name][i]
            self.ranges[name][i] = (min(lo, float(r.min())), max(hi, float(r.max())))
        return out


def calibrate(float_bundle: Path, samples, tokens: int, limit: int = 192):
    """Run the float bundle on samples; returns recorders for vision, prefill (hybrid) and decode (kv + generation)."""
    from ...runtime.bundle import Bundle
    from ...runtime.weights import release_freed_heap
    from ...runtime.vlm import VLM

    b = Bundle.open(float_bundle)
    m = b.manifest
    kv_in = {n for layer in m.kv.attention() for n in layer.inputs}  # (cut to their used rows; conv windows whole)
    pos = m.decoder.kind.mask_input  # (the float bundle's kind: rows_static)
    rec = {
        "vision": Recorder(b.sessions["vision"], set(), limit),
        "prefill": RowsRecorder(b.sessions["prefill"], kv_in, limit, pos, layers=m.kv.layers),
        "decode": RowsRecorder(b.sessions["decode"], kv_in, limit, pos, layers=m.kv.layers),
    }
    vlm = VLM(dataclasses.replace(b, sessions=rec))  # the runtime, its graph calls recorded
    fits, longer = {}, {}  # a sample longer than the context is no prompt this bundle can take: left out
    for image, prompt in samples:
        p = vlm.prompt(prompt, [] if image is None else [image])
        ids, x = p.ids, vlm.decoder_inputs(p)  # (once for both modes: the same vision calls; ~6 min at 1B)
        kind = "text" if image is None else "image"
        if len(ids) >= m.kv.max_context:
            longer[kind] = min(longer.get(kind, len(ids)), len(ids))
            continue
        fits[kind] = fits.get(kind, 0) + 1
        for mode in ("hybrid", "kv"):
            for _ in vlm.scheduler.generate(x.embeds.copy(), mode=mode, max_new_tokens=tokens, ignore_eos=True,
                                         positions=x.positions, rows=x.rows):
                pass
    for kind, n in longer.items():
        if not fits.get(kind):
            raise ValueError(f"no {kind} calibration sample fits the max context of {m.kv.max_context} tokens (the "
                             f"shortest is {n}); export with a larger --max-seq-len or --calibration with shorter ones")
    for r in rec.values():  # the float sessions (and their weights) are not needed past the calibration
        r.session = None
    del vlm, b
    gc.collect()  # (the runtime's objects hold one another)
    release_freed_heap()
    return rec
