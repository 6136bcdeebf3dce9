"""`vlmrt web`: the static site answers in headless Chromium (onnxruntime-web, WASM, 2 threads) with the token ids of
the Python runtime (`vlmrt run`) on the demo model's easy-VQA questions and on tiny SmolVLM / InternVL bundles
with tiled images; it asks nothing of any other origin and no /v1 API; a reload reads the bundle from Cache
Storage; the command refuses what the browser cannot run in one line; the server sends the isolation headers."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ASSETS
from family_cases import FAMILIES
from web_browser import browser, need_browser, served

from vlmrt import cli
from vlmrt.runtime.vlm import VLM
from vlmrt.format import manifest as mf
from vlmrt.web.site import WebError, browser_problem, write_site

QUESTIONS = 13  # the demo's stratified easy-VQA subset: one question per answer (as `vlmrt eval --dataset --limit 13`)


def _uri(path: Path) -> str:
    kind = "jpeg" if path.suffix == ".jpg" else "png"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def _ask(page, **request) -> dict:
    return page.evaluate("r => window.vlmrt.ask(r)", request)


def _open(ctx, url: str):
    """A page of the site with its model loaded; the requests it made are in page.requests."""
    page = ctx.new_page()
    page.requests = []
    page.on("request", lambda r: page.requests.append(r.url))
    page.goto(url + "/?threads=2")
    page.wait_for_function("window.vlmrt !== undefined")
    page.loaded = page.evaluate("window.vlmrt.ready.then(v => ({bytes: v.bytes, threads: v.threads, "
                                "loadMs: v.loadMs, isolated: crossOriginIsolated}))")
    return page


@pytest.fixture(scope="module")
def demo_site(demo_model, tmp_path_factory):
    need_browser()
    root, bundle = demo_model
    return bundle, write_site(bundle, tmp_path_factory.mktemp("web") / "site")


def test_demo_answers_are_vlmrt_runs(demo_site, tmp_path):
    from vlmrt.demo import easyvqa_data as ev

    bundle, site = demo_site
    vlm = VLM.load(bundle)
    rows = ev.select("test", QUESTIONS)
    with served(site) as url, browser(tmp_path / "profile") as ctx:
        page = _open(ctx, url)
        assert page.loaded["isolated"] and page.loaded["threads"] == 2  # COOP / COEP: WASM threads
        assert page.loaded["bytes"]["fromNetwork"] == page.loaded["bytes"]["total"] > 500e6
        for question, _, image_id in rows:
            image = ev.image_path("test", image_id)
            want = vlm(question, image, max_new_tokens=8)
            got = _ask(page, images=[_uri(image)], prompt=question, maxNewTokens=8)
            assert (got["tokenIds"], got["text"]) == (want.token_ids, want.text), question
            assert got["promptIds"] == want.prompt_ids
        # text only, kv mode, a stop string: the same as the Python runtime's
        want = vlm("What is 2+2? Answer in words.", None, max_new_tokens=12)
        assert _ask(page, prompt="What is 2+2? Answer in words.", maxNewTokens=12)["tokenIds"] == want.token_ids
        question, _, image_id = rows[0]
        image = ev.image_path("test", image_id)
        want = vlm(question, image, max_new_tokens=8, mode="kv", stop=["e"], ignore_eos=True)
        got = _ask(page, images=[_uri(image)], prompt=question, maxNewTokens=8, mode="kv", stop=["e"], ignoreEos=True)
        assert (got["tokenIds"], got["text"], got["stats"]["stopReason"]) == (want.token_ids, want.text,
                                                                              want.stats.stop_reason)
        sampled = _ask(page, images=[_uri(image)], prompt=question, maxNewTokens=6, temperature=0.8, topK=20, topP=0.9,
                       seed=3, ignoreEos=True)
        assert len(sampled["tokenIds"]) == 6 and sampled["stats"]["stopReason"] == "length"
        again = _ask(page, images=[_uri(image)], prompt=question, maxNewTokens=6, temperature=0.8, topK=20,
                     topP=0.9, seed=3, ignoreEos=True)
        assert again["tokenIds"] == sampled["tokenIds"]  # seeded
        # the page itself: a question typed in streams its answer
        page.fill("#prompt", "What is 2+2? Answer in words.")
        page.press("#prompt", "Enter")
        page.wait_for_function("document.getElementById('rate').textContent.includes('tokens/s')", timeout=120_000)
        page.wait_for_function("document.getElementById('send').disabled === false", timeout=120_000)
        shown = page.eval_on_selector_all(".turn.assistant span", "e => e.map(x => x.textContent)")
        answer = vlm("What is 2+2? Answer in words.", None, max_new_tokens=256)
        assert shown == [answer.text]
        n = len(answer.token_ids)  # the status line: "N tokens, first after S s[, R tokens/s] (prompt ...; stop: ...)"
        status = page.text_content("#rate")
        assert status.startswith(f"{n} token{'' if n == 1 else 's'}, first after ") and "stop: " in status, status
        # nothing but the site itself: no CDN, no API
        assert page.requests and all(u.startswith(url + "/") or u.startswith("data:") for u in page.requests)
        assert not any("/v1" in u for u in page.requests)

        reloaded = _open(ctx, url)  # Cache Storage: a reload downloads none of the bundle again
        assert reloaded.loaded["bytes"]["fromNetwork"] == 0
        got = _ask(reloaded, images=[_uri(image)], prompt=question, maxNewTokens=8)
        assert got["tokenIds"] == vlm(question, image, max_new_tokens=8).token_ids
        assert not any(u.endswith(".data") or u.endswith(".npy") for u in reloaded.requests)


# logprobs, page vs Python: 4.6e-6 at most measured (onnxruntime-web's WASM logits vs native ORT's, float64 vs float32
# sums) on the tiny SmolVLM and InternVL bundles, both modes, Zen 4
LOGPROB_GAP = 5e-5

# registered families whose bundles the browser runtime refuses, and why (web/site.py browser_problem)
BROWSER_REFUSES = {"lfm2_vl": "conv cache layers", "qwen_vl": "rope positions (mrope, 3 rows)",
                   "gemma4": "windowed_attention cache layers"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_bundles_answer_as_python(family, tmp_path_factory, tmp_path):
    """Every registered family's first tiny case (tests/family_cases.py): tiled images (resized, cut, a global tile /
    thumbnail) through the vision graph, spliced, prefill + decode, in both modes; the answers' logprobs (top 3) those
    of VLM.generate(logprobs=3) (fail on 9ee29fd: the page had none)."""
    need_browser()
    pytest.importorskip("torch")
    fc = FAMILIES[family]
    ex = fc.exported(fc.cases[0], tmp_path_factory)
    problem = browser_problem(mf.load(ex.bundle))
    if problem:  # a family the browser runtime does not run yet (LFM2-VL's conv layers, Qwen-VL's M-RoPE) is refused in one line
        assert family in BROWSER_REFUSES and BROWSER_REFUSES[family] in problem, problem
        with pytest.raises(WebError, match=re.escape(BROWSER_REFUSES[family])):
            write_site(ex.bundle, tmp_path / "site")
        return
    site = write_site(ex.bundle, tmp_path / "site")
    vlm = VLM.load(ex.bundle)
    with served(site) as url, browser(tmp_path / "profile") as ctx:
        page = _open(ctx, url)
        for image in (ASSETS / "chelsea.png", ASSETS / "page.png"):
            for mode in ("hybrid", "kv"):
                want = vlm("Describe the image.", image, max_new_tokens=8, ignore_eos=True, mode=mode, logprobs=3)
                assert want.stats.image_tiles > 1
                got = _ask(page, images=[_uri(image)], prompt="Describe the image.", maxNewTokens=8, ignoreEos=True,
                           mode=mode, logprobs=3)
                assert got["promptIds"] == want.prompt_ids
                assert got["tokenIds"] == want.token_ids, (image.name, mode)
                # logprobs (static/logprobs.js): the same rows' log_softmax, top 3 best first
                assert [[t["id"] for t in e["top"]] for e in got["logprobs"]] == [[t.id for t in e.top]
                                                                                   for e in want.logprobs]
                # (a token holding part of a character: U+FFFD in the page, its bytes as \\xNN in Python)
                assert [g["token"] for g, w in zip(got["logprobs"], want.logprobs) if "\ufffd" not in g["token"]] == \
                    [w.token for w in want.logprobs if "\\x" not in w.token]
                gap = max(abs(a - b) for g, w in zip(got["logprobs"], want.logprobs)
                          for a, b in zip([g["logprob"]] + [t["logprob"] for t in g["top"]],
                                          [w.logprob] + [t.logprob for t in w.top]))
                assert gap < LOGPROB_GAP, (image.name, mode, gap)


def test_a_tied_w4a16o_bundle_reads_its_head_rows_from_the_embedding_table(tmp_path_factory, tmp_path):
    """A tied head's re-scored int8 rows live in embed.npy (export/graphs.share_weights' known tensors): the browser
    hands that file to onnxruntime-web as external data like any data file, and answers as Python does."""
    need_browser()
    pytest.importorskip("torch")
    from conftest import CASES, exported
    from vlmrt.export.pipeline import export

    ex = exported(CASES[1], tmp_path_factory)  # tied head
    b = export(str(ex.ckpt), tmp_path_factory.mktemp("w4a16o") / "b", prefill_ar=ex.case.prefill_ar,
               max_seq_len=ex.case.max_seq_len, quant="w4a16o", progress=False)
    assert "embed.npy" in mf.load(b).graphs["decode"].data_files
    site = write_site(b, tmp_path / "site")
    want = VLM.load(b)("Describe the image.", ASSETS / "chelsea.png", max_new_tokens=8, ignore_eos=True)
    with served(site) as url, browser(tmp_path / "profile") as ctx:
        got = _ask(_open(ctx, url), images=[_uri(ASSETS / "chelsea.png")], prompt="Describe the image.", maxNewTokens=8,
                   ignoreEos=True)
    assert got["tokenIds"] == want.token_ids


# ------------------------------------------------------------------------------------------ the command line

def _refused(capsys, *argv) -> str:
    rc = cli.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("vlmrt: error: "), err
    return err[0]


def _linked_copy(bundle: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in bundle.iterdir():
        if f.is_file() and f.name != "manifest.json":
            (dst / f.name).hardlink_to(f)
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("edit, says", [
    (lambda m: m["graphs"]["decode"].update(precision="w4a8"), "graph decode is w4a8: onnxruntime-web computes"),
    (lambda m: m["target"].update(name="htp"), "this bundle is for the htp target"),
    (lambda m: m["graphs"]["vision"]["inputs"][0].update(dtype="float16"), "graph vision has float16 I/O"),
])
def test_refuses_what_the_browser_cannot_run_exactly(default_bundle, tmp_path, capsys, edit, says):
    bundle = _linked_copy(default_bundle.bundle, tmp_path / "b", edit)
    line = _refused(capsys, "web", str(bundle), "--out", str(tmp_path / "site"))
    assert says in line and "vlmrt export" in line
    assert not (tmp_path / "site").exists() and list(tmp_path.iterdir()) == [bundle]  # nothing half-written


def test_command_errors_are_one_line(default_bundle, tmp_path, capsys, monkeypatch):
    bundle = default_bundle.bundle
    out = tmp_path / "site"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "exists; use --force" in _refused(capsys, "web", str(bundle), "--out", str(out))
    assert (out / "keep.txt").read_text() == "mine"
    assert "not a vlmrt bundle" in _refused(capsys, "web", str(tmp_path), "--out", str(tmp_path / "x"))
    monkeypatch.setenv("VLMRT_WEB_MODULES", str(tmp_path / "none"))
    assert "npm ci" in _refused(capsys, "web", str(bundle), "--out", str(tmp_path / "y"))
    assert not (tmp_path / "y").exists()
    monkeypatch.delenv("VLMRT_WEB_MODULES")
    assert cli.main(["web", str(bundle), "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "bundle" / "manifest.json").is_file()
    assert (out / "_headers").read_text().count("Cross-Origin-") == 3


def test_missing_packages_are_one_line_before_the_default_models_build(tmp_path, monkeypatch, capsys):
    """A tree without node_modules (the web package's files copied, its node_modules not): `vlmrt web` on the default
    model says in one line the command that installs the packages, before the default model's first-use build
    (~1.5 min) and with nothing written."""
    from vlmrt.demo import default_model
    from vlmrt.web import site

    web = tmp_path / "web"
    web.mkdir()
    for f in ("package.json", "package-lock.json"):
        (web / f).write_bytes((site.HERE / f).read_bytes())
    monkeypatch.setattr(site, "HERE", web)
    monkeypatch.delenv("VLMRT_WEB_MODULES", raising=False)
    monkeypatch.setenv("VLMRT_CACHE", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(default_model, "ensure_bundle", lambda progress=True: built.append(1) or 1 / 0)
    line = _refused(capsys, "web", "--out", str(tmp_path / "site"))
    assert line == (f"vlmrt: error: vlmrt web needs the browser runtime's JavaScript packages "
                    f"(onnxruntime-web/dist/ort.wasm.min.mjs is missing under {web / 'node_modules'}): install them "
                    f"with: npm ci --prefix {web} --no-audit --no-fund --ignore-scripts")
    assert built == [] and sorted(p.name for p in tmp_path.iterdir()) == ["web"]
    # $VLMRT_WEB_MODULES naming a folder without them: the same command, and the variable named
    monkeypatch.setenv("VLMRT_WEB_MODULES", str(tmp_path / "elsewhere"))
    line = _refused(capsys, "web", "--out", str(tmp_path / "site"), "--webgpu")
    assert line.endswith(f"install them with: npm ci --prefix {web} --no-audit --no-fund --ignore-scripts (and unset "
                         f"$VLMRT_WEB_MODULES, which names that folder)") and built == []


def _get(url: str):
    """(status, headers (case-insensitive), body)"""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, b""


def test_serve_sends_isolation_headers_and_only_the_folder(default_bundle, tmp_path):
    """`vlmrt web --serve` in a subprocess: 127.0.0.1, COOP / COEP, module and WASM types, no listing, no escape."""
    env_path = str(Path(__file__).resolve().parents[1] / "src")
    site = tmp_path / "site"
    (tmp_path / "secret.txt").write_text("no")
    proc = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "web", str(default_bundle.bundle), "--out", str(site),
                             "--serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": env_path})
    try:
        assert proc.stdout.readline().strip() == str(site)
        line = proc.stderr.readline()
        assert "serving" in line and "http://127.0.0.1:" in line
        url = line.split("at ")[1].split()[0].rstrip("/")
        status, headers, body = _get(url + "/")
        assert status == 200 and b"vlmrt" in body
        assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
        assert headers["Cross-Origin-Embedder-Policy"] == "require-corp"
        assert _get(url + "/vlmrt/vendor/ort/ort-wasm-simd-threaded.wasm")[1]["Content-Type"] == "application/wasm"
        assert _get(url + "/vlmrt/vlmrt.js")[1]["Content-Type"].startswith("text/javascript")
        assert _get(url + "/vlmrt/")[0] == 404  # no listing
        assert _get(url + "/../secret.txt")[0] == 404 and _get(url + "/%2e%2e/secret.txt")[0] == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_a_taken_port(default_bundle, tmp_path, capsys):
    from vlmrt.web.server import make_server

    srv = make_server(tmp_path, 0)
    try:
        port = srv.server_address[1]
        line = _refused(capsys, "web", str(default_bundle.bundle), "--out", str(tmp_path / "site"), "--serve", "--port",
                        str(port))
        assert f"cannot listen on 127.0.0.1:{port}" in line and not (tmp_path / "site").exists()
    finally:
        srv.server_close()


def test_without_bundle_the_demo_model(demo_model, tmp_path, monkeypatch, capsys):
    """`vlmrt web --out DIR` takes the offline demo model from the cache (built there on first use)."""
    root, bundle = demo_model
    monkeypatch.setenv("VLMRT_CACHE", str(root))
    assert cli.main(["web", "--out", str(tmp_path / "site")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "site")
    assert (tmp_path / "site" / "bundle" / "manifest.json").read_bytes() == (bundle / "manifest.json").read_bytes()


def test_a_response_format_is_refused_in_one_line(default_bundle, tmp_path):
    """The browser runtime has no grammar engine (llguidance is a native library): VLM.chat's responseFormat other
    than text is refused with one line before anything runs (run in Node on the site's own module); so is a logprobs
    count outside 0..20."""
    import shutil

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    site = write_site(default_bundle.bundle, tmp_path / "site")
    js = f"""import {{ VLM }} from "{site.as_posix()}/vlmrt/vlmrt.js";
const v = Object.create(VLM.prototype);
for (const rf of [{{type: "json_object"}}, {{type: "json_schema", json_schema: {{schema: {{}}}}}}, {{type: "text"}}]) {{
  try {{ await v.chat([{{role: "user", content: "hi"}}], {{responseFormat: rf}}); console.log("answered"); }}
  catch (e) {{ console.log(e.message.split("\\n").length + " " + e.message); }}
}}
for (const n of [21, -1, 1.5, "3"]) {{
  try {{ await v.chat([{{role: "user", content: "hi"}}], {{logprobs: n}}); console.log("answered"); }}
  catch (e) {{ console.log(e.message.split("\\n").length + " " + e.message); }}
}}"""
    p = subprocess.run(["node", "--input-type=module", "-e", js], capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 7, p.stderr
    assert all(ln.startswith("1 responseFormat: structured output") and "llguidance" in ln for ln in lines[:2])
    assert "responseFormat" not in lines[2]  # text: what it does anyway
    assert [ln.split(" (")[0] for ln in lines[3:]] == ["1 logprobs must be null or an integer from 0 to 20"] * 4


def test_logprobs_in_javascript_are_the_runtimes():
    """static/logprobs.js (Node): a row's log_softmax at the token and its top ids, best first with ties by the lower
    id, are runtime/decode/logprobs.py's (float64 there, float32 sums here: 1e-5)."""
    import shutil

    import numpy as np

    from vlmrt.runtime.decode.logprobs import token_logprobs
    from web_browser import STATIC

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    rng = np.random.default_rng(1)
    rows = [(rng.standard_normal(5000) * 4).astype(np.float32), np.round(rng.standard_normal(300) * 2).astype(np.float32)]
    rows[0][[11, 40]] = rows[0].max() + 1  # a tie at the top
    js = f"""import {{ tokenLogprob }} from "{(STATIC / 'logprobs.js').as_posix()}";
const rows = {json.dumps([r.tolist() for r in rows])};
console.log(JSON.stringify(rows.map((r, i) => tokenLogprob(Float32Array.from(r), 7 + i, [20, 5][i]))));"""
    p = subprocess.run(["node", "--input-type=module", "-e", js], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for got, row, top in zip(json.loads(p.stdout), rows, (20, 5)):
        want = token_logprobs(row, got["id"], top=top)
        assert [t["id"] for t in got["top"]] == [t.id for t in want.top]
        assert max(abs(a - b) for a, b in zip([got["logprob"]] + [t["logprob"] for t in got["top"]],
                                                [want.logprob] + [t.logprob for t in want.top])) < 1e-5
