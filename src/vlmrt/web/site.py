"""The static site of `vlmrt web`: a chat page, the JavaScript runtime (static/), its dependencies (onnxruntime-web,
@huggingface/tokenizers, @huggingface/jinja, pinned in package-lock.json and installed by `scripts/setup` into
node_modules/ next to this file) and the bundle's files, in one folder any static file server can serve.

    OUT/index.html            the chat page (window.vlmrt.ask for tests and embedding pages)
    OUT/vlmrt/*.js            the runtime: the manifest executed as runtime/vlm.py executes it
    OUT/vlmrt/vendor/         onnxruntime-web's WASM build, the tokenizer and the Jinja renderer, with their licences
    OUT/bundle/               manifest.json and the files it lists
    OUT/_headers              the COOP / COEP headers for hosts that read such a file (Netlify, Cloudflare Pages)

The folder is written whole or not at all (vlmrt.format.staging). A bundle the browser cannot run exactly is refused
before anything is written (browser_problem, the twin of static/decoder.js browserProblem).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..format.manifest import Manifest, load
from ..format.staging import publish, staged

HERE = Path(__file__).parent
# what the browser runtime implements (static/decoder.js decoderPlan: its own code per kind): the decoder kinds
# (manifest.DECODER_KINDS) and the cache layer kinds (manifest.CACHE_LAYER_KINDS) it runs
BROWSER_DECODER_KINDS = ("gqa_in_place", "rows_dynamic", "rows_static")
# (static/windowed.js: Gemma 4's three; static/recurrent.js: Qwen3.5's)
BROWSER_CACHE_KINDS = ("attention", "windowed_attention", "sliding_attention", "shared_kv", "recurrent")
BROWSER_POSITION_OPS = ("slots", "mrope")  # static/positions.js POSITION_OPS
STATIC = HERE / "static"
RUNTIME_FILES = ("vlmrt.js", "app.js", "decoder.js", "files.js", "image.js", "resample.js", "npy.js", "prompt.js",
                 "sampler.js", "stop_strings.js", "logprobs.js", "windowed.js", "spans.js", "image_pooled.js", "table.js",
                 "positions.js", "recurrent.js", "image_native.js")
# (package, file in the package, name under vendor/): the WASM-only build of onnxruntime-web ("onnxruntime-web/wasm":
# the default JSEP build refuses 8-bit MatMulNBits and returns GroupQueryAttention caches of another length)
VENDOR = (
    ("onnxruntime-web", "dist/ort.wasm.min.mjs", "ort/ort.wasm.min.mjs"),
    ("onnxruntime-web", "dist/ort-wasm-simd-threaded.mjs", "ort/ort-wasm-simd-threaded.mjs"),
    ("onnxruntime-web", "dist/ort-wasm-simd-threaded.wasm", "ort/ort-wasm-simd-threaded.wasm"),
    ("@huggingface/tokenizers", "dist/tokenizers.min.mjs", "tokenizers.min.mjs"),
    ("@huggingface/jinja", "dist/index.js", "jinja.js"),
)
# vlmrt web --webgpu: onnxruntime-web's WebGPU build too (the page's ?ep=webgpu; docs/browser.md#webgpu)
VENDOR_WEBGPU = (
    ("onnxruntime-web", "dist/ort.webgpu.min.mjs", "ort/ort.webgpu.min.mjs"),
    ("onnxruntime-web", "dist/ort-wasm-simd-threaded.asyncify.mjs", "ort/ort-wasm-simd-threaded.asyncify.mjs"),
    ("onnxruntime-web", "dist/ort-wasm-simd-threaded.asyncify.wasm", "ort/ort-wasm-simd-threaded.asyncify.wasm"),
)
HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
           "Cross-Origin-Resource-Policy": "same-origin"}
BROWSER_EXPORT = ("re-export it for the browser: vlmrt export CHECKPOINT OUT (the CPU target, --dtype fp32, "
                  "--quant fp32, w8a16 or w4a16)")


class WebError(ValueError):
    """One readable line for the CLI."""


def node_modules() -> Path:
    """Where the JavaScript dependencies are installed: $VLMRT_WEB_MODULES, else node_modules/ next to this file."""
    return Path(os.environ.get("VLMRT_WEB_MODULES") or HERE / "node_modules")


def browser_problem(m: Manifest) -> str | None:
    """What the browser runtime cannot run exactly, as one line naming what to export instead (None: it can).
    Keep in step with static/decoder.js browserProblem, which refuses the same bundles in a page."""
    if m.target.get("name", "cpu") != "cpu":
        return f"this bundle is for the {m.target['name']} target, which a browser cannot run; {BROWSER_EXPORT}"
    for name, g in m.graphs.items():
        if g.file is None:
            return f"graph {name} has no ONNX file (only a compiled context); {BROWSER_EXPORT}"
        head = str(g.weights.get("lm_head", ""))
        if "a8" in g.precision or "a8" in head:
            what = g.precision if "a8" in g.precision else f"{g.precision} (lm head {head})"
            return (f"graph {name} is {what}: onnxruntime-web computes int8-activation MatMulNBits in float, so its "
                    f"answers would not be vlmrt run's; {BROWSER_EXPORT}")
        for t in [*g.inputs, *g.outputs]:
            if t.dtype == "float16":
                return (f"graph {name} has float16 I/O ({t.name}), which the browser runtime does not feed; re-export "
                        f"it with vlmrt export CHECKPOINT OUT --dtype fp32 (weights may stay fp16, 8 or 4 bit: --quant)")
    if m.kv.dtype != "float32" or m.kv.encodings:
        return f"this bundle's KV cache is {m.kv.dtype} (quantized); {BROWSER_EXPORT}"
    quant = next((layer.quant for layer in m.kv.attention() if layer.quant), None)
    if quant:
        return (f"this bundle's KV cache is {quant.dtype} ({quant.bits}-bit, --kv-cache), which the browser runtime "
                f"does not keep (it keeps a float cache); {BROWSER_EXPORT}, --kv-cache fp32")
    kind = m.decoder.kind
    if kind.name not in BROWSER_DECODER_KINDS:
        return f"this vlmrt has no decoder kind {kind.name!r}; upgrade vlmrt"
    if kind.parts().hidden_output:
        return f"this bundle's lm head is its own graph (an NPU export); {BROWSER_EXPORT}"
    if m.decoder.positions.op not in BROWSER_POSITION_OPS:
        return f"this vlmrt has no positions op {m.decoder.positions.op!r}; upgrade vlmrt"
    other = next((layer.kind for layer in m.kv.layers if layer.kind not in BROWSER_CACHE_KINDS), None)
    if other:
        return f"this bundle has {other} cache layers, which the browser runtime does not keep yet; use vlmrt run"
    return None


def npm_ci() -> str:
    """The command that installs the browser runtime's packages from package-lock.json (scripts/setup runs it)."""
    return f"npm ci --prefix {HERE} --no-audit --no-fund --ignore-scripts"


def vendor_sources(webgpu: bool = False) -> list[tuple[Path, str]]:
    """(file under node_modules, name under vendor/) of the packages the site ships; a WebError naming the command
    that installs them where one is missing."""
    root = node_modules()
    files = VENDOR + (VENDOR_WEBGPU if webgpu else ())
    missing = [f"{pkg}/{f}" for pkg, f, _ in files if not (root / pkg / f).is_file()]
    if missing:
        also = " (and unset $VLMRT_WEB_MODULES, which names that folder)" if os.environ.get("VLMRT_WEB_MODULES") else ""
        raise WebError(f"vlmrt web needs the browser runtime's JavaScript packages ({missing[0]} is missing under "
                       f"{root}): install them with: {npm_ci()}{also}")
    return [(root / pkg / f, name) for pkg, f, name in files]


def _licences(root: Path) -> str:
    lines = ["# Vendored JavaScript packages (installed by npm ci from package-lock.json)", ""]
    for pkg in dict.fromkeys(p for p, _, _ in VENDOR):
        meta = json.loads((root / pkg / "package.json").read_text())
        lines.append(f"- {pkg} {meta.get('version')} ({meta.get('license')}): {meta.get('homepage') or ''}")
    return "\n".join(lines) + "\n"


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A bundle file: a hard link where src and dst share a file system (a 500 MB bundle is not copied twice; bundle
    files are never written after export), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_site(bundle: str | Path, out: str | Path, force: bool = False, webgpu: bool = False) -> Path:
    """Write the static site for the bundle folder into out (replaced with force); webgpu: with onnxruntime-web's
    WebGPU build as well (27 MB more). Returns out."""
    bundle, out = Path(bundle), Path(out)
    m = load(bundle, verify=True)  # (a BundleError names what is wrong)
    problem = browser_problem(m)
    if problem:
        raise WebError(problem)
    if out.resolve() == bundle.resolve() or bundle.resolve().is_relative_to(out.resolve()):
        raise WebError(f"--out {out} would replace the bundle itself; choose another folder")
    if out.exists() and not force:
        if not out.is_dir() or any(out.iterdir()):
            raise WebError(f"{out} exists; use --force to replace it")
    sources = vendor_sources(webgpu)
    with staged(out, "web") as work:
        shutil.copyfile(STATIC / "index.html", work / "index.html")
        for name in RUNTIME_FILES:
            _copy(STATIC / name, work / "vlmrt" / name)
        for src, name in sources:
            _copy(src, work / "vlmrt" / "vendor" / name)
        root = node_modules()
        for pkg in dict.fromkeys(p for p, _, _ in VENDOR):
            if (root / pkg / "LICENSE").is_file():
                shutil.copyfile(root / pkg / "LICENSE", work / "vlmrt" / "vendor" / f"LICENSE.{re.sub(r'[^A-Za-z0-9.-]', '_', pkg)}")
        (work / "vlmrt" / "vendor" / "PACKAGES.md").write_text(_licences(root))
        (work / "bundle").mkdir()
        shutil.copyfile(bundle / "manifest.json", work / "bundle" / "manifest.json")
        for name in m.files:
            _link_or_copy(bundle / name, work / "bundle" / name)
        (work / "_headers").write_text("/*\n" + "".join(f"  {k}: {v}\n" for k, v in HEADERS.items()))
        publish(work, out)
    return out
