"""The recurrent state kind (runtime/decode/recurrent_state.py) through the real KVCache, no graph: a step's state is
copied in whole, a kept prefix restores the snapshot taken there (and only slots with one are offered), a rewind to a
slot without one leaves nothing offered past the snapshots, the most recent KEEP are kept, a batch's rows are views of
one array each, and a cache of attention layers only keeps every prefix by slot as before."""

from __future__ import annotations

import numpy as np
import pytest

from vlmrt.format.manifest import AttentionLayer, KVSpec, RecurrentLayer
from vlmrt.runtime.decode import recurrent_state
from vlmrt.runtime.decode.kv_cache import HEADS, KVCache

ATTN = AttentionLayer("attention", 1, 16, "past_key_0", "past_value_0", "present_key_0", "present_value_0")
REC = RecurrentLayer("recurrent", width=3, channels=8, heads=2, key_dim=4, value_dim=3, conv_input="past_conv_1",
                     state_input="past_state_1", conv_output="present_conv_1", state_output="present_state_1")


def spec(*layers) -> KVSpec:
    return KVSpec(max_context=64, dtype="float32", layers=list(layers))


def step(cache: KVCache, n: int, value: float) -> None:
    """A step of n rows whose state out is all `value` (and whose K/V rows the graph would have written)."""
    staged = cache.staging(n)
    for s in staged:
        s[...] = value
    cache.store(staged, n, np.zeros((1, n), np.int64))


def arrays(cache: KVCache) -> list[np.ndarray]:
    return cache.states["recurrent"].arrays


def test_snapshots_restore_a_kept_prefix():
    c = KVCache(spec(ATTN, REC), HEADS)
    assert not c.drops_rows and KVCache(spec(ATTN), HEADS).drops_rows
    step(c, 8, 1.0)
    c.checkpoint()  # at 8
    step(c, 8, 2.0)
    c.checkpoint()  # at 16
    step(c, 3, 3.0)
    assert c.restorable(19) == 19 and c.restorable(18) == 16 and c.restorable(18, 8) == 16 and c.restorable(15) == 8
    assert c.restorable(7) == 0
    c.rewind(8)
    assert all((a == 1.0).all() for a in arrays(c)) and c.length == 8
    assert c.restorable(20) == 8  # the snapshot at 16 is gone with the rows past 8
    c.rewind(0)
    assert all((a == 0).all() for a in arrays(c)) and c.restorable(8) == 0


def test_a_rewind_without_a_snapshot_is_never_offered():
    c = KVCache(spec(REC), HEADS)
    step(c, 4, 1.0)
    c.checkpoint()
    step(c, 4, 2.0)
    c.rewind(6)  # (a batch's idle row at a full cache: no snapshot at 6)
    assert c.restorable(6) == 4 and c.restorable(64) == 4
    c.rewind(4)
    assert all((a == 1.0).all() for a in arrays(c))


def test_the_most_recent_snapshots_are_kept(monkeypatch):
    monkeypatch.setattr(recurrent_state, "KEEP", 2)
    c = KVCache(spec(REC), HEADS)
    for v in range(1, 5):
        step(c, 2, float(v))
        c.checkpoint()
    assert sorted(c.states["recurrent"].snapshots) == [6, 8]
    assert c.restorable(5) == 0 and c.costs()["snapshots"] == 4


def test_a_batch_rows_are_one_array_each():
    s = spec(ATTN, REC)
    blocks = KVCache.batch_blocks(s, 3)
    rows = [KVCache(s, HEADS, blocks=KVCache.rows_of(blocks, b)) for b in range(3)]
    step(rows[1], 1, 5.0)
    conv, state = blocks[-2], blocks[-1]
    assert conv.shape == (3, 3, 8) and state.shape == (3, 2, 4, 3)
    assert (state[1] == 5.0).all() and (state[0] == 0).all() and (state[2] == 0).all()
    assert (conv[1] == 5.0).all() and (conv[[0, 2]] == 0).all()


@pytest.mark.parametrize("n", [0, 5])
def test_attention_only_caches_keep_every_prefix(n):
    c = KVCache(spec(ATTN), HEADS)
    step(c, 9, 1.0)
    c.checkpoint()  # (nothing to snapshot)
    assert c.restorable(n) == n and c.costs() == {}
