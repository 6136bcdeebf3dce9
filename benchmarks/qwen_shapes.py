"""Qwen2.5-VL-3B-shaped and Qwen3-VL-2B-shaped bundles at reduced depth, timed on a 1024×768 photo (issue 30 item 6).

    python -m benchmarks.qwen_shapes qwen2_5_vl|qwen3_vl --depth TEXT,VISION [--work DIR] [--no-run] [--runs 2]
        [--attention gqa|portable]
        [--llama-server BIN --gguf TEXT.gguf --mmproj MMPROJ.gguf]

Builds a checkpoint with the released widths, heads, vocabulary (151936, the real Qwen3 tokenizer) and processor
settings (min/max_pixels as released, so the export picks the default 4096-patch budget), transformers' random init,
TEXT decoder layers and VISION ViT blocks; exports it `--quant w4a8`, writes the photo (tests/assets/chelsea.png
resized to 1024×768) and prints `vlmrt bench --json` on it. Two depths give per-layer slopes to extrapolate full depth
(decode and prefill scale with decoder layers, the vision graph with ViT blocks).

With --llama-server, the same photo goes instead to llama.cpp's server (mtmd) on GGUFs converted from the same
checkpoint: --runs streamed OpenAI chat requests (the photo as a data URI, prompt cache off, EOS ignored); TTFT is
the first content chunk, decode and prompt rates are the server's own `timings`; vision = that TTFT minus the TTFT of a
text prompt of as many tokens (scaled to the same count).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

V = 151936
# (config classes, vision config, text config, processor (min_blocks, max_blocks) of patch×merge squares, full depth)
SHAPES = {
    # Qwen/Qwen2.5-VL-3B-Instruct: min_pixels 3136, max_pixels 12845056 (28 px blocks)
    "qwen2_5_vl": dict(
        vision=dict(hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048, window_size=112,
                    patch_size=14),
        text=dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
        blocks=(4, 16384), full=(36, 32)),
    # Qwen/Qwen3-VL-2B-Instruct: size {shortest_edge 65536, longest_edge 16777216} (32 px blocks)
    "qwen3_vl": dict(
        vision=dict(hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                    num_position_embeddings=2304, patch_size=16),
        text=dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True}),
        blocks=(64, 16384), full=(28, 24)),
}


def build(kind: str, out: Path, text_layers: int, vision_layers: int) -> None:
    import torch
    from fixtures_qwen import write_processor_files

    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model
        # released: full attention on blocks 7, 15, 23, 31 of 32 (both kinds are one masked attention in the graph)
        extra = {"fullatt_block_indexes": [vision_layers - 1]}
    else:
        from transformers import Qwen3VLConfig as Config, Qwen3VLForConditionalGeneration as Model
        # released: DeepStack from ViT blocks 5, 11, 17 of 24 into decoder layers 0-2
        extra = {"deepstack_visual_indexes": [0, 1, 2]}  # three mergers at every depth (VISION >= 3)
    s = SHAPES[kind]
    out.mkdir(parents=True, exist_ok=True)
    cfg = Config(vision_config={**s["vision"], "depth": vision_layers, **extra},
                 text_config={**s["text"], "num_hidden_layers": text_layers, "vocab_size": V, "tie_word_embeddings": True,
                              "eos_token_id": 151645},
                 image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
                 tie_word_embeddings=True)
    torch.manual_seed(0)
    Model(cfg).eval().save_pretrained(out)
    tok = ROOT / "tests/assets/qwen3-tokenizer"
    (out / "tokenizer.json").write_bytes(gzip.decompress((tok / "tokenizer.json.gz").read_bytes()))
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    write_processor_files(kind, out, *s["blocks"])


def photo(path: Path) -> Path:
    from PIL import Image

    if not path.exists():
        Image.open(ROOT / "tests/assets/chelsea.png").convert("RGB").resize((1024, 768), Image.LANCZOS).save(path)
    return path


FILLER = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. "


def llama_request(port: int, image: Path | None, gen_tokens: int, text: str = "Describe this image.") -> dict:
    """One streamed chat request; TTFT at the first content chunk, the server's timings from its last chunk."""
    parts = [{"type": "text", "text": text}]
    if image:
        url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    body = {"messages": [{"role": "user", "content": parts}],
            "max_tokens": gen_tokens, "temperature": 0, "stream": True, "ignore_eos": True, "cache_prompt": False}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r, ttft, timings = c.getresponse(), None, None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        timings = ev.get("timings") or timings
        if ttft is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
            ttft = time.perf_counter() - t0
    c.close()
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "prompt_tokens": timings["prompt_n"],
            "prompt_tokens_per_s": timings["prompt_per_second"], "decode_tokens": timings["predicted_n"],
            "decode_tokens_per_s": timings["predicted_per_second"]}


def llama(a, image: Path, port: int = 8431) -> dict:
    cmd = [a.llama_server, "-m", a.gguf, "--mmproj", a.mmproj, "-t", "2", "-c", "4096", "--host", "127.0.0.1",
           "--port", str(port), "--no-repack", "-np", "1"]
    log = Path(a.gguf).with_suffix(".server.log")
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"llama-server exited with {server.returncode}: {' '.join(cmd)}")
            time.sleep(0.5)
        runs = [llama_request(port, image, a.gen_tokens) for _ in range(a.runs)]
        # the server's timings hold the image's encoding inside prompt eval: a text prompt of as many tokens,
        # timed the same way, is the prefill part (vision ≈ the TTFT difference)
        words = (FILLER * (runs[0]["prompt_tokens"] // 4)).split()
        text = llama_request(port, None, 2, " ".join(words[: runs[0]["prompt_tokens"] - 24]))
        fix = runs[0]["prompt_tokens"] / text["prompt_tokens"]
    finally:
        server.terminate()
        server.wait()
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return {"runs": runs, "text_prompt": text, "ttft_s": ttft, "vision_s": ttft - text["ttft_s"] * fix,
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=sorted(SHAPES))
    ap.add_argument("--depth", required=True, help="TEXT,VISION layers")
    ap.add_argument("--work", default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default: the image's tokens + 24")
    ap.add_argument("--no-run", action="store_true", help="build and export only")
    ap.add_argument("--attention", choices=["gqa", "portable"], default="gqa",
                    help="the decoder's export --attention (gqa: kind gqa_in_place, the default; portable: rows_dynamic)")
    ap.add_argument("--llama-server", default=None, help="time llama.cpp's server on --gguf/--mmproj instead")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--mmproj", default=None)
    a = ap.parse_args()
    import torchvision_ops

    torchvision_ops.declare()  # transformers imports torchvision where it is installed (tests/torchvision_ops.py)
    text, vision = (int(x) for x in a.depth.split(","))
    work = Path(a.work or f"/tmp/vlmrt-qwen-{a.kind}-{text}-{vision}")
    if a.llama_server:
        img = photo(work.parent / "qwen-photo-1024x768.png")
        print(json.dumps({"kind": a.kind, "depth": [text, vision], "llama_server": llama(a, img)}))
        return
    ckpt, bundle = work / "ckpt", work / ("w4a8" if a.attention == "gqa" else f"w4a8-{a.attention}")
    if not (ckpt / "config.json").exists():
        build(a.kind, ckpt, text, vision)
    if not (bundle / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "vlmrt.cli", "export", str(ckpt), str(bundle), "--quant", "w4a8",
                        "--max-seq-len", "2048", "--attention", a.attention, "--force"], check=True)
    img = photo(work.parent / "qwen-photo-1024x768.png")
    if a.no_run:
        return
    # 1024×768 at 14 px: 54×74 patches → 999 tokens; at 16 px: 48×64 → 768 tokens
    n = a.prompt_tokens or (999 if a.kind == "qwen2_5_vl" else 768) + 24
    p = subprocess.run([sys.executable, "-m", "vlmrt.cli", "bench", str(bundle), "--image", str(img), "--prompt-tokens",
                        str(n), "--gen-tokens", str(a.gen_tokens), "--runs", str(a.runs), "--json"],
                       check=True, capture_output=True, text=True)
    print(json.dumps({"kind": a.kind, "depth": [text, vision], "attention": a.attention, **json.loads(p.stdout.strip().splitlines()[-1])}))


if __name__ == "__main__":
    main()
