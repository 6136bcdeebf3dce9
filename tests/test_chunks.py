"""The typed prompt (runtime/prompt/chunks.py): the one splice, the prefix cache's row keys, token vs position counts."""

import numpy as np
import pytest

from vlmrt.runtime.prompt.chunks import ImageChunk, Prompt, TextChunk


def image(ids, key, embeds=None):
    rows = np.flatnonzero(np.asarray(ids) == 9)
    return ImageChunk(key, (0, 0, 1), embeds=embeds, ids=ids, rows=rows)


def test_splice_puts_each_images_rows_over_its_slots_in_order():
    table = np.arange(40, dtype=np.float32).reshape(20, 2)
    a = -np.arange(4, dtype=np.float32).reshape(2, 2) - 1
    b = -np.arange(2, dtype=np.float32).reshape(1, 2) - 100
    p = Prompt([TextChunk([1]), image([5, 9, 9, 5], "a", a), TextChunk([2, 3]), image([9, 6], "b", b), TextChunk([4])])
    assert p.ids == [1, 5, 9, 9, 5, 2, 3, 9, 6, 4] and p.n_tokens == 10
    e = p.splice(table[p.ids])
    assert (e[[2, 3]] == a).all() and (e[7] == b[0]).all()
    keep = [0, 1, 4, 5, 6, 8, 9]
    assert (e[keep] == table[np.asarray(p.ids)[keep]]).all()
    # from a kept prefix on: only the rows at or after start, the first image's partly
    e3 = p.splice(table[p.ids[3:]], 3)
    assert e3.shape == (7, 2) and (e3[0] == a[1]).all() and (e3[4] == b[0]).all() and (e3[1] == table[5]).all()
    assert [c.key for c in p.needs_rows(4)] == ["b"] and [c.key for c in p.needs_rows(3)] == ["a", "b"]


def test_splice_refuses_missing_or_short_embeddings():
    table = np.zeros((20, 2), np.float32)
    p = Prompt([TextChunk([1]), image([9, 9], "a", np.zeros((1, 2), np.float32))])
    with pytest.raises(ValueError, match="2 image-token slots but 1 embeddings"):
        p.splice(table[p.ids])
    q = Prompt([TextChunk([1]), image([9, 9], "a")])
    with pytest.raises(ValueError, match="no embeddings"):
        q.splice(table[q.ids])
    q.splice(table[q.ids[3:]], 3)  # wholly in the kept prefix: not needed


def test_keys_name_image_rows_by_image_and_row():
    p = Prompt([TextChunk([1, 2]), image([5, 9, 9], ("d", None)), TextChunk([3])])
    assert p.keys() == [1, 2, 5, (("d", None), 0), (("d", None), 1), 3]


def test_token_count_and_position_count_are_apart():
    p = Prompt([TextChunk([1, 2]), image([9, 9, 9], "a"), TextChunk([3])])
    assert p.n_tokens == 6
    q = Prompt([TextChunk([1]), image([9, 9, 9, 9], "a")])
    assert q.n_tokens == 5 and q.offsets == [0, 1]
