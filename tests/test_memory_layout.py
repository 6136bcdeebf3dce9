"""Where the runtime's memory goes, held to what docs/performance.md#memory measured: the KV cache's pages become
resident only where rows are written (no huge pages), the LM head's weight is prepacked first (ORT prepacks in
node order; packed last, its original was mapped on top of every packed copy at the load's peak), and the
MatMulNBits scales that ORT keeps after packing are unmapped once the session is built."""

import mmap
import sys

import numpy as np
import onnx
import pytest

from vlmrt.format.manifest import KVSpec, attention_layers
from vlmrt.runtime.decode.kv_cache import KVCache, zeroed

from test_quant import bundle


def _resident_pages(arr: np.ndarray) -> int:
    """Pages of arr resident in this process (/proc/self/pagemap's present bit)."""
    first, last = arr.ctypes.data // mmap.PAGESIZE, (arr.ctypes.data + arr.nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int((entries >> np.uint64(63)).sum())


def test_zeroed_is_zeros():
    a = zeroed((3, 2, 5), np.float16)
    assert a.dtype == np.float16 and a.shape == (3, 2, 5) and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[1, 1, 4] = 2
    assert a.sum() == 2
    assert zeroed((0, 4), np.float32).shape == (0, 4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_kv_cache_pages_only_where_written():
    """A 32 MB cache with one row written per buffer holds a page per buffer, not the 2 MB huge page around each
    row (numpy advises huge pages for its arrays of 4 MB or more: a 16-token prompt then made 42 of a 45 MB cache
    resident)."""
    spec = KVSpec(max_context=1 << 14, dtype="float32", layers=attention_layers(4, 2, 32))
    cache = KVCache(spec)
    assert cache.data.nbytes == 32 << 20
    assert _resident_pages(cache.data) <= 1
    cache.data[:, :, 0] = 1  # slot 0 of every buffer ([layers, 2, max_context, dim])
    assert _resident_pages(cache.data) <= 2 * 2 * len(spec.layers)  # one page per buffer (two at a boundary)


def test_lm_head_is_prepacked_first(tmp_path_factory):
    """The CPU decoder's node list starts with its largest MatMulNBits (the LM head), which still computes last
    (test_quant / test_host_step run the graph: ORT orders execution topologically)."""
    b = bundle("w4a8", tmp_path_factory)
    g = onnx.load(str(b / "decoder.onnx"), load_external_data=False).graph
    sizes = {i.name: int(np.prod(i.dims)) for i in g.initializer}
    nbits = [n for n in g.node if n.op_type == "MatMulNBits"]
    assert g.node[0].op_type == "MatMulNBits"
    assert sizes[g.node[0].input[1]] == max(sizes[n.input[1]] for n in nbits)
    assert g.node[0].output[0] == "logits"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_load_only_weights_unmapped_after_load(tmp_path_factory, tmp_path):
    """The MatMulNBits scales (GraphSpec.load_only_weights) are mapped by the runtime, one weight per mapping, and
    none of their pages is resident once the session is built, nor after generating (ORT's kernel computes from its
    packed copy). Answers and logits equal those of the same bundle with ORT mapping them itself."""
    import json
    import shutil

    from vlmrt.runtime.vlm import VLM

    b = bundle("w4a8", tmp_path_factory)
    vlm = VLM.load(b, verify=False)
    g = vlm.manifest.graphs["decode"]
    graph = onnx.load(str(b / g.file), load_external_data=False).graph
    external = {i.name for i in graph.initializer if onnx.external_data_helper.uses_external_data(i)}
    scales = {n.input[2] for n in graph.node if n.op_type == "MatMulNBits"} & external
    assert g.load_only_weights and {w["name"] for w in g.load_only_weights} == scales
    own = list(vlm.bundle.shared.own.values())
    assert len(own) == len(scales)
    pages = lambda: sum(_resident_pages(np.frombuffer(m, np.uint8)) for m in own)  # noqa: E731
    assert pages() == 0
    r = vlm("Describe the picture in detail.", None, max_new_tokens=12, ignore_eos=True)
    assert pages() == 0
    plain = tmp_path / "plain"
    shutil.copytree(b, plain)
    m = json.loads((plain / "manifest.json").read_text())
    for spec in m["graphs"].values():
        spec["load_only_weights"] = []
    (plain / "manifest.json").write_text(json.dumps(m))
    other = VLM.load(plain, verify=False)
    assert not other.bundle.shared.own
    assert other("Describe the picture in detail.", None, max_new_tokens=12, ignore_eos=True).token_ids == r.token_ids
    ids = vlm.prompt("hello").ids
    np.testing.assert_array_equal(vlm.row.prefill(vlm.scheduler.embed(ids), "hybrid"),
                                  other.row.prefill(other.scheduler.embed(ids), "hybrid"))


def test_scale_pages_dropped_while_the_session_builds(tmp_path):
    """SharedWeights.dropping unmaps the load-only weights' pages while the block still runs (the session build,
    during which ORT reads each node's scales once and never again), not only at its end: pages read inside the
    block do not stay resident, and the values read back afterwards are the file's."""
    import time
    from pathlib import Path

    from vlmrt.runtime.weights import SharedWeights

    data = np.arange(256 * 1024, dtype=np.float32)  # 1 MB: 256 pages
    (tmp_path / "w.data").write_bytes(data.tobytes())
    w = {"name": "s", "file": "w.data", "offset": 0, "length": data.nbytes, "dtype": "float32", "shape": [data.size]}
    shared = SharedWeights(Path(tmp_path))
    shared.initializers(None, [w], own=True)
    mapped = np.frombuffer(next(iter(shared.own.values())), np.float32)
    with shared.dropping([w], every_s=0.002):
        assert float(mapped.sum()) == float(data.sum())  # every page read (resident now)
        deadline = time.monotonic() + 5
        while _resident_pages(mapped) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _resident_pages(mapped) == 0  # dropped while the block runs
    assert _resident_pages(mapped) == 0
    np.testing.assert_array_equal(mapped, data)


def test_prompt_rows_are_made_a_block_at_a_time(default_bundle):
    """A request's prompt embeddings are made one prefill block at a time (runtime/prompt/prompt_rows.py), never the
    whole prompt's at once: at 4000 tokens of SmolLM2 those float rows were 9.2 MB resident beside the KV cache at
    the prefill's end, the process's peak (docs/performance.md, "Memory at 4000 tokens"). Each block's rows are bit
    for bit the whole splice's (two images' rows, blocks cutting through them), so the answer is unchanged."""
    from PIL import Image

    from vlmrt.runtime.prompt.prompt_rows import PromptRows
    from vlmrt.runtime.vlm import VLM

    vlm = VLM.load(default_bundle.bundle, verify=False)
    images = [Image.new("RGB", (40, 30), (200, 30, 30)), Image.new("RGB", (30, 40), (30, 30, 200))]
    p = vlm.prompt("describe both " * 12, images)
    whole = vlm.embed_prompt(p)
    rows = PromptRows(p, vlm.scheduler.embed, 0)
    assert rows.shape == whole.shape and rows.dtype == whole.dtype
    for b in range(0, p.n_tokens, 7):  # (7: blocks that start and end inside the images' rows)
        assert np.array_equal(rows[b:b + 7], whole[b:b + 7])
    start = p.images()[1][0] + 3  # from inside the second image (a kept prefix before it)
    assert np.array_equal(PromptRows(p, vlm.scheduler.embed, start)[0:10], vlm.embed_prompt(p, start)[0:10])

    sizes, embed = [], vlm.scheduler.embed
    vlm.scheduler.embed = lambda ids: (sizes.append(len(ids)), embed(ids))[1]
    ar = vlm.row.blocks("hybrid")
    r = vlm("describe both " * 12, images=images[:1], max_new_tokens=2, ignore_eos=True)
    assert r.stats.prompt_tokens > 2 * ar  # several blocks
    assert sizes and max(sizes) <= ar, f"prompt rows embedded {max(sizes)} at once, more than a block ({ar})"


def test_a_row_outlives_its_vlm(tmp_path_factory):
    """A static bundle's prefill and decode graphs read their weights from one shared memory map (SharedWeights): a
    CacheRow kept after its VLM is dropped still runs, the same logits (the sessions keep the mapped weights alive;
    before, the map closed with the Bundle and the next call read unmapped memory: a segfault, rc -11)."""
    import subprocess

    from conftest import CASES, exported

    case = next(c for c in CASES if c.static)
    bundle = exported(case, tmp_path_factory).bundle
    code = f"""
import gc, numpy as np
from vlmrt.runtime.vlm import VLM
vlm = VLM.load({str(bundle)!r})
assert len(vlm.bundle.shared.values) > 0  # (the graphs' weights come from the shared map)
rows = (np.ones((5, vlm.row.dec.hidden_size)) * 0.1).astype(np.float32)
want = vlm.row.prefill(rows, "hybrid").copy()
vlm.reset()
row = VLM.load({str(bundle)!r}).row
gc.collect()
print(np.array_equal(row.prefill(rows, "hybrid"), want))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["True"], (r.returncode, r.stderr[-2000:])
