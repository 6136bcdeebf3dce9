"""`vlmrt web` on a Gemma 4 bundle: the site answers in headless Chromium (onnxruntime-web, WASM) with `vlmrt run`'s
greedy ids. The bundle is the tiny test checkpoint with bidirectional image attention (tests/fixtures_gemma4.py,
use_bidirectional_attention "vision", prefill blocks of 32: family_cases.gemma4_bidirectional_exported), so one site
holds everything Gemma 4 adds to the browser runtime: sliding-window and kv-shared cache layers (static/windowed.js),
the span input with prompt blocks that never split an image (spans.js), the pooled_aspect tiling and pooled_positions
tile inputs (image_pooled.js), rows hidden + layers × per_layer wide read by HTTP Range requests (table.js "ranged",
served 206 by vlmrt web's server). The causal export of the same weights is test_web.py's gemma4 case (the whole
table, logprobs)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from web_browser import browser, need_browser, served

PROMPT = "Describe the picture."


def _uri(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image(size, seed) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8))


def test_gemma4_site_answers_as_vlmrt_run(tmp_path_factory, tmp_path):
    """A wide image alone (kv mode: the image one step) and a wide + a tall one (hybrid: a block of 32 would end inside
    the second image, so the block stops before it): 16 greedy ids and the prompt ids equal VLM.chat's, the table
    read by Range rows, never fetched whole; the sliding layers in window-sized buffers, past their capacity. (On main
    f2d6421 `vlmrt web` refused the bundle: sliding_attention cache layers, the span input.)"""
    need_browser()
    pytest.importorskip("torch")
    from family_cases import gemma4_bidirectional_exported

    _answers_as_python(gemma4_bidirectional_exported(tmp_path_factory)[1], tmp_path)


def _answers_as_python(bundle, tmp_path):
    from vlmrt.format import manifest as mf
    from vlmrt.runtime.vlm import VLM
    from vlmrt.web.site import write_site

    m = mf.load(bundle)
    assert m.decoder.span_input and {layer.kind for layer in m.kv.layers} == {"attention", "windowed_attention",
                                                                               "shared_kv"}
    capacity = max(layer.capacity for layer in m.kv.layers if layer.kind == "windowed_attention")
    site = write_site(bundle, tmp_path / "site")
    wide, tall = _image((37, 90), 0), _image((120, 41), 1)
    vlm = VLM.load(bundle)
    with served(site) as url, browser(tmp_path / "profile") as ctx:
        page = ctx.new_page()
        ranges = []
        page.on("request", lambda r: ranges.append(r.headers.get("range")) if r.url.endswith("/embed.npy") else None)
        page.goto(url + "/?threads=2&table=ranged")
        page.wait_for_function("window.vlmrt !== undefined")
        loaded = page.evaluate("window.vlmrt.ready.then(v => ({mode: v.table.mode, total: v.bytes.total}))")
        table = m.decoder.embedding_file
        assert loaded == {"mode": "ranged", "total": sum(f["bytes"] for n, f in m.files.items() if n != table)}
        for images, mode in (([wide], "kv"), ([wide, tall], "hybrid")):
            parts = [{"type": "image_url", "image_url": {"url": _uri(im)}} for im in images]
            msgs = [{"role": "user", "content": parts + [{"type": "text", "text": PROMPT}]}]
            vlm.reset()
            "".join(vlm.chat(msgs, mode=mode, max_new_tokens=16, ignore_eos=True))
            want = vlm.result
            got = page.evaluate("r => window.vlmrt.ask(r)", {"images": [p["image_url"]["url"] for p in parts],
                                                             "prompt": PROMPT, "maxNewTokens": 16, "ignoreEos": True,
                                                             "mode": mode})
            assert got["promptIds"] == want.prompt_ids, mode
            assert got["tokenIds"] == want.token_ids, mode
            assert len(want.prompt_ids) + 16 > capacity  # the graph evicted sliding rows (the page keeps none itself)
            if len(images) == 2:  # (a plain block of 32 would end inside the second image)
                at = [i for i, t in enumerate(want.prompt_ids) if t == m.special_tokens.image_token_id]
                assert 31 in at and 32 in at and at[0] < 32
        stats = page.evaluate("window.vlmrt.ready.then(v => ({requests: v.table.requests, bytes: v.table.bytesRead}))")
    row = m.decoder.hidden_size * 4  # (float32 rows)
    assert ranges and all(r and r.startswith("bytes=") for r in ranges)  # never the whole file
    assert stats["requests"] == len(ranges) - 1 and stats["bytes"] == stats["requests"] * row  # (+ the header's)


def _node(js: str) -> str:
    import shutil
    import subprocess

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    p = subprocess.run(["node", "--input-type=module", "-e", js], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_span_blocks_in_javascript_are_the_runtimes():
    """static/spans.js (Node): each row's span and every block end, on random image layouts, block sizes and starts,
    are runtime/decode/spans.py's prompt_spans / block_end."""
    import json

    from web_browser import STATIC
    from vlmrt.runtime.decode.spans import block_end, prompt_spans

    rng = np.random.default_rng(0)
    cases = []
    for _ in range(40):
        n = int(rng.integers(1, 60))
        is_image = rng.random(n) < rng.choice([0.0, 0.3, 0.8])
        cases.append([is_image.tolist(), int(rng.integers(1, 12))])
    js = f"""import {{ promptSpans, blockEnd }} from "{(STATIC / 'spans.js').as_posix()}";
const out = {json.dumps(cases)}.map(([img, ar]) => {{
  const s = promptSpans(img), ends = [];
  for (let b = 0; b < img.length; b++) ends.push(blockEnd(s, b, ar, img.length));
  return [Array.from(s, Number), ends];
}});
console.log(JSON.stringify(out));"""
    for (is_image, ar), (spans, ends) in zip(cases, json.loads(_node(js))):
        want = prompt_spans(np.array(is_image, bool))
        assert spans == want.tolist()
        assert ends == [block_end(want, b, ar, len(is_image)) for b in range(len(is_image))]


@pytest.mark.parametrize("how", ["whole", "ranged"])
def test_table_rows_in_javascript_are_the_runtimes(tmp_path, how):
    """static/table.js (Node; ranged: HTTP Range requests to vlmrt web's server, a grouped table's scale rows too):
    float32, float16, int8 (+ a scale per row), the grouped forms int8g64 / int4g32 / int4g64 (+ float16 scales
    per group; a row of 75 values: a shorter last group, an odd last nibble) and the split forms float16+int4g32 /
    float32+int8g64 / float16+int4g64 (40 embedding columns, 35 per-layer ones: an odd last nibble; float32+int8g64's
    scales start at an odd byte of the row) give the runtime's float32 rows bit for bit (TokenEmbedding.embed
    over the bundle's readers: runtime/bundle.py _token_table); an id out of range is refused in one line. (float16
    tables: Gemma 4's under the weight-only precisions; on main f2d6421 the page copied their raw bits; the grouped
    forms: on main ef8b8dc the page refused their uint8 codes / read no groups; the split forms: on main 27f8984 the
    page refused embedding_dtype "parts".)"""
    import json
    from types import SimpleNamespace

    from web_browser import STATIC
    from vlmrt.format.manifest import TablePart
    from vlmrt.runtime import table_rows
    from vlmrt.runtime.bundle import _token_table
    from vlmrt.runtime.decode.embedding import TokenEmbedding

    rng = np.random.default_rng(1)
    width = 75
    rows = (rng.standard_normal((50, width)) * np.r_[np.full(40, 3.0), np.full(width - 40, 0.02)]).astype(np.float32)
    forms = {"f32": "float32", "f16": "float16", "i8": "int8", "i8g64": "int8g64", "i4g32": "int4g32", "i4g64": "int4g64",
             "f16+i4g32": "float16+int4g32", "f32+i8g64": "float32+int8g64", "f16+i4g64": "float16+int4g64"}
    manifests, parts = {}, {}
    for name, form in forms.items():
        parts[name] = table_rows.parts_of(form, 40, width) if table_rows.split_of(form) else None
        if parts[name]:
            codes, scales = table_rows.pack(rows, parts[name]), None
        else:
            codes, scales = table_rows.quantize(rows * (300 if form == "float16" else 1), form)
        np.save(tmp_path / f"{name}.npy", codes)
        if scales is not None:
            np.save(tmp_path / f"{name}_scale.npy", scales)
        dtype, group = table_rows.manifest_of(form)
        manifests[name] = {"embedding_file": f"{name}.npy", "embedding_scale_file": f"{name}_scale.npy" if scales is not None else None,
                           "embedding_dtype": dtype, "embedding_group": group, "hidden_size": width, "vocab_size": 50,
                           "embedding_parts": parts[name] and [{"columns": c, "dtype": table_rows.manifest_of(f)[0],
                                                                "group": table_rows.FORMS[f][1] or None} for f, c in parts[name]]}
    ids = [3, 49, 0, 3, 17]
    with served(tmp_path) as url:
        js = f"""import {{ openTable }} from "{(STATIC / 'table.js').as_posix()}";
import fs from "fs";
const out = {{}};
for (const [name, decoder] of Object.entries({json.dumps(manifests)})) {{
  const m = {{decoder, files: {{}}}};
  for (const f of [decoder.embedding_file, decoder.embedding_scale_file].filter(Boolean)) m.files[f] = {{bytes: fs.statSync("{tmp_path.as_posix()}/" + f).size}};
  const files = {{base: "{url}/", get: async (f) => new Uint8Array(fs.readFileSync("{tmp_path.as_posix()}/" + f)),
                 leaveOut() {{}}}};
  const t = await openTable(files, m, "{how}");
  out[name] = [t.mode, Array.from(await t.rows({json.dumps(ids)}))];
  try {{ await t.rows([50]); }} catch (e) {{ out[name].push(e.message); }}
}}
console.log(JSON.stringify(out));"""
        got = json.loads(_node(js))
    for name, form in forms.items():
        spec = dict(manifests[name], embedding_parts=parts[name] and [TablePart(**p) for p in manifests[name]["embedding_parts"]])
        table, scale = _token_table(tmp_path, SimpleNamespace(**spec))
        want = TokenEmbedding(table, scale, np.float32).embed(ids).ravel()
        mode, js_rows, err = got[name]
        assert mode == how and np.array_equal(np.array(js_rows, np.float32), want), name
        assert err == "token id 50 out of range 0..49"
        if parts[name]:  # the split forms' rows: each part's codec, from the file's bytes
            split = table_rows.split_of(form)
            data = np.load(tmp_path / f"{name}.npy")[ids]
            assert np.array_equal(want.reshape(len(ids), width), table_rows.unpack(data, parts[name]))
            assert np.array_equal(want.reshape(len(ids), width)[:, 40:], table_rows.dequantize(
                *table_rows.quantize(rows[ids, 40:], split[1]), split[1], width - 40))
        elif scale is None and form != "float32":  # the grouped forms' rows: the codec's, from the files
            codes = np.load(tmp_path / f"{name}.npy")
            scales = np.load(tmp_path / f"{name}_scale.npy") if manifests[name]["embedding_scale_file"] else None
            assert np.array_equal(want.reshape(len(ids), width), table_rows.dequantize(codes[ids], None if scales is None
                                                                                       else scales[ids], form, width))


def test_server_answers_single_ranges(tmp_path, monkeypatch):
    """vlmrt web's server (web/server.py): a single byte range is a 206 with its bytes and Content-Range; an open end
    runs to the file's end; a range past the end a 416; a range over RANGE_BYTES, or another form, the whole file
    (200); nothing outside the folder. A page whose server answers a row's Range request with 200 is refused in one
    line (table.js), not fed the wrong bytes."""
    import urllib.error
    import urllib.request

    from web_browser import STATIC
    from vlmrt.web import server

    data = bytes(range(256)) * 40
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "t.npy").write_bytes(data)
    (tmp_path / "secret.txt").write_text("no")

    def get(url, rng):
        req = urllib.request.Request(url, headers={"Range": rng} if rng else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.headers.get("Content-Range"), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Range"), b""

    with served(tmp_path / "site") as url:
        assert get(url + "/t.npy", "bytes=10-19") == (206, f"bytes 10-19/{len(data)}", data[10:20])
        assert get(url + "/t.npy", "bytes=10200-") == (206, f"bytes 10200-10239/{len(data)}", data[10200:])
        assert get(url + "/t.npy", "bytes=20000-20010")[:2] == (416, f"bytes */{len(data)}")
        assert get(url + "/t.npy", "bytes=0-1,5-6") == (200, None, data)
        assert get(url + "/../secret.txt", "bytes=0-1")[0] == 404
        monkeypatch.setattr(server, "RANGE_BYTES", 4)
        assert get(url + "/t.npy", "bytes=0-9") == (200, None, data)
        js = f"""import {{ openTable }} from "{(STATIC / 'table.js').as_posix()}";
const m = {{decoder: {{embedding_file: "t.npy", embedding_scale_file: null}}, files: {{"t.npy": {{bytes: {len(data)}}}}}}};
try {{ await openTable({{base: "{url}/", leaveOut() {{}}}}, m, "ranged"); }} catch (e) {{ console.log(e.message); }}"""
        line = _node(js).strip()
    assert "\n" not in line and "with HTTP 200, not 206" in line and "needs a server that takes Range requests" in line
