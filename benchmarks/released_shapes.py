"""Gemma 4 E2B and Qwen3.5 0.8B / 2B at their released shapes (random weights, reduced decoder depth), vlmrt beside
llama.cpp on the same checkpoint (issues 45 and 46, item 5).

    python -m benchmarks.released_shapes build  gemma4-e2b|qwen3_5-0.8b|qwen3_5-2b|qwen3_vl-2b --depth TEXT [--work DIR]
    python -m benchmarks.released_shapes export MODEL --depth TEXT [--quant w4a8]
    python -m benchmarks.released_shapes gguf   MODEL --depth TEXT --llama DIR --convert CONVERT_HF_TO_GGUF.PY [--qtype Q4_0]
    python -m benchmarks.released_shapes vlmrt  MODEL --depth TEXT [--quant w4a8]     # decode after 100/1000/4000, image TTFT, RSS
    python -m benchmarks.released_shapes llama  MODEL --depth TEXT --llama DIR [--qtype Q4_0]   # llama-bench + mtmd-cli
    python -m benchmarks.released_shapes table  gemma4-e2b --depth TEXT [--tokens 256]  # the token table's RSS, pread vs in RAM
    python -m benchmarks.released_shapes ov-export MODEL --depth TEXT --ov-python PY [--ov-weights int4]  # optimum-cli
    python -m benchmarks.released_shapes openvino  MODEL --depth TEXT --ov-python PY [--ov-weights int4]  # VLMPipeline

Checkpoints: the released text widths, heads, vocabularies and layer patterns (numbers below, from the hub configs),
TEXT decoder layers, the vision tower at its released depth; transformers' random init, saved in bf16 as released.
Gemma 4's tokenizer is a 262,144-entry byte-fallback BPE (special tokens, byte tokens, characters, unreachable
fillers: what llama.cpp's gemma4 vocabulary reader and vlmrt both take); Qwen3.5's is the real Qwen3 tokenizer
(151,665 entries) under the released 248,320-row embedding.

vlmrt: `vlmrt export --quant Q`; `vlmrt bench --gen-tokens 32` after 100 / 1000 / 4000 prompt tokens (TTFT, decode,
peak RSS; real prefills, one run each) and on the 1024×768 photo (image TTFT, peak RSS; two runs).
llama.cpp: `convert_hf_to_gguf.py --outtype f16`, `llama-quantize` to QTYPE, `--mmproj --outtype f16`;
`llama-bench -t 2 -p 512 -n 32 -d 0,1000,4000 -r 2 -o json` and `llama-mtmd-cli` on the photo (its image encode
and prefill, from its log; peak RSS from /usr/bin/time -v).
OpenVINO GenAI (a peer in its own venv, --ov-python or $VLMRT_OV_PYTHON: optimum-intel pins a transformers older than
vlmrt's): `optimum-cli export openvino --task image-text-to-text --weight-format int4` on the checkpoint with its
config.json as the hub spells it (ov_checkpoint), then VLMPipeline on the CPU, 2 threads
(benchmarks/openvino_genai_arm.py): decode after 100 / 1000 / 4000 prompt tokens, the photo's TTFT, peak RSS.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

POSITIONS = (100, 1000, 4000)  # prompt tokens before the decode figures

ROOT = Path(__file__).resolve().parents[1]

S, F = "sliding_attention", "full_attention"
# google/gemma-4-E2B(-it) config.json, text_config: 35 layers (every fifth full attention), the last 20 kv-shared
GEMMA4_E2B = dict(hidden_size=1536, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                  global_head_dim=512, sliding_window=512, hidden_size_per_layer_input=256, vocab_size=262144,
                  vocab_size_per_layer_input=262144, use_double_wide_mlp=True, attention_k_eq_v=False,
                  final_logit_softcapping=30.0, max_position_embeddings=131072, rms_norm_eps=1e-6,
                  hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                  rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                   F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                       "rope_theta": 1000000.0}})
GEMMA4_E2B_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                         num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3,
                         position_embedding_size=10240, standardize=False)
# Reduced depths keep the released kv-shared fraction (20 of 35 = 4 of 7): 7 layers = 3 own + 4 shared, each part
# with one full-attention layer (released: 3 of 15 own, 4 of 20 shared)
GEMMA4_LAYERS = {7: [S, S, F, S, S, S, F], 14: [S, S, S, S, S, F, S, S, S, S, F, S, S, F]}
GEMMA4_SHARED = {7: 4, 14: 8, 35: 20}

QWEN35_TEXT = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                   linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, vocab_size=248320, tie_word_embeddings=True, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [11, 11, 10],
                                    "mrope_interleaved": True, "partial_rotary_factor": 0.25})
SHAPES = {
    "gemma4-e2b": dict(family="gemma4", full_depth=35),
    # Qwen/Qwen3.5-0.8B and Qwen/Qwen3.5-2B config.json: 24 layers, every fourth full attention
    "qwen3_5-0.8b": dict(family="qwen3_5", full_depth=24,
                         text=dict(QWEN35_TEXT, hidden_size=1024, intermediate_size=3584),
                         vision=dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12,
                                     out_hidden_size=1024)),
    "qwen3_5-2b": dict(family="qwen3_5", full_depth=24,
                       text=dict(QWEN35_TEXT, hidden_size=2048, intermediate_size=6144),
                       vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                   out_hidden_size=2048)),
    # attention only, beside them: benchmarks/qwen_shapes.py's Qwen3-VL-2B (28 layers, ViT 24 blocks, vocab 151936)
    "qwen3_vl-2b": dict(family="qwen3_vl", full_depth=28),
}


def gemma4_tokenizer(out: Path, vocab_size: int) -> dict:
    """A Gemma-style byte-fallback BPE of exactly vocab_size entries; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures_gemma4 import CHAT_TEMPLATE, SPECIAL_TOKENS, AUDIO, BOA, BOI, BOS, EOA, EOI, END_TURN, IMAGE, PAD

    vocab = [*SPECIAL_TOKENS, "<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁",
             *(chr(c) for c in range(33, 127))]
    vocab += [f"▁w{i}" for i in range(vocab_size - len(vocab))]
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(ids[t]): {"content": t, **entry} for t in SPECIAL_TOKENS},
        "bos_token": BOS, "eos_token": END_TURN, "pad_token": PAD, "unk_token": "<unk>",
        "extra_special_tokens": {"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI, "audio_token": AUDIO,
                                 "boa_token": BOA, "eoa_token": EOA},
        "clean_up_tokenization_spaces": False, "model_max_length": 131072}, indent=1))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}) + "\n")
    return ids


def gemma4_layers(depth: int) -> list[str]:
    """The reduced depths' patterns (GEMMA4_LAYERS), or the released one: every fifth layer full attention."""
    return GEMMA4_LAYERS.get(depth) or [F if (i + 1) % 5 == 0 else S for i in range(depth)]


def stream_random_checkpoint(cfg, out: Path, seed: int = 0, block_bytes: int = 64 << 20) -> None:
    """model.safetensors (bf16, as released) and config.json of cfg's Gemma4ForConditionalGeneration as transformers'
    save_pretrained writes them, without the whole model in memory (the released E2B's ~5 B parameters need ~20 GB
    as one torch model in fp32, ~10 GB in bf16): the names and shapes from the model built on the meta device, each
    module's tensors made on the CPU in turn and initialized by transformers' own _init_weights, written, dropped;
    an embedding table (the per-layer one: 262,144 × 35 × 256) by its init's rule (normal, std initializer_range,
    the padding row zero) a block of rows at a time. Peak: a block or the largest module, not the model."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # the released dtype
    try:
        with torch.device("meta"):
            model = Gemma4ForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    seen, owner = set(), {}  # (a tied weight is saved once, under its first name: as save_pretrained does)
    for mname, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is None or (kind == "_buffers" and name in module._non_persistent_buffers_set) or id(t) in seen:
                    continue
                seen.add(id(t))
                owner[f"{mname}.{name}" if mname else name] = (module, name)
    names = sorted(owner)
    header, offset = {}, 0
    for n in names:
        t = getattr(*owner[n])
        size = t.numel() * 2
        header[n] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    std = cfg.initializer_range
    left = {}  # module -> how many of its saved tensors are not written yet
    for n in names:
        left[id(owner[n][0])] = left.get(id(owner[n][0]), 0) + 1
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for n in names:
            module, name = owner[n]
            t = getattr(module, name)
            if isinstance(module, torch.nn.Embedding) and t.numel() * 2 > block_bytes:
                rows = max(1, block_bytes // (4 * t.shape[1]))
                for r0 in range(0, t.shape[0], rows):
                    block = torch.empty(min(rows, t.shape[0] - r0), t.shape[1]).normal_(0.0, std)
                    if module.padding_idx is not None and r0 <= module.padding_idx < r0 + len(block):
                        block[module.padding_idx - r0] = 0
                    f.write(block.to(torch.bfloat16).view(torch.uint16).numpy().tobytes())
                continue
            if t.is_meta:  # the module's own tensors on the CPU, initialized as transformers does
                module.to_empty(device="cpu", recurse=False)
                model._init_weights(module)
            f.write(getattr(module, name).detach().to(torch.bfloat16).contiguous().view(torch.uint16).numpy().tobytes())
            left[id(module)] -= 1
            if not left[id(module)]:
                module.to_empty(device="meta", recurse=False)  # written: dropped
    model.config.dtype = torch.bfloat16
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)


def build_gemma4(out: Path, depth: int) -> None:
    from transformers import Gemma4Config, GenerationConfig

    from fixtures_gemma4 import BOI, BOS, EOI, END_TURN, IMAGE, PAD

    ids = gemma4_tokenizer(out, GEMMA4_E2B["vocab_size"])
    text = dict(GEMMA4_E2B, num_hidden_layers=depth, layer_types=gemma4_layers(depth),
                num_kv_shared_layers=GEMMA4_SHARED[depth], pad_token_id=ids[PAD],
                eos_token_id=ids[END_TURN], bos_token_id=ids[BOS])
    cfg = Gemma4Config(text_config=text, vision_config=GEMMA4_E2B_VISION, image_token_id=ids[IMAGE],
                       boi_token_id=ids[BOI], eoi_token_id=ids[EOI])
    stream_random_checkpoint(cfg, out)
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[END_TURN], pad_token_id=ids[PAD],
                     do_sample=False).save_pretrained(out)
    # google/gemma-4-E2B processor: 280 soft tokens an image, 16 px patches pooled 3×3, pixels in [0, 1]
    pre = {"image_processor_type": "Gemma4ImageProcessor", "processor_class": "Gemma4Processor", "patch_size": 16,
           "max_soft_tokens": 280, "pooling_kernel_size": 3, "do_resize": True, "resample": 3, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": False, "image_mean": [0.0] * 3, "image_std": [1.0] * 3}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1) + "\n")
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}) + "\n")


def build_qwen3_5(out: Path, name: str, depth: int) -> None:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from fixtures_qwen import write_processor_files

    s = SHAPES[name]
    tok = ROOT / "tests/assets/qwen3-tokenizer"
    (out / "tokenizer.json").write_bytes(gzip.decompress((tok / "tokenizer.json.gz").read_bytes()))
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    text = dict(s["text"], num_hidden_layers=depth, eos_token_id=151645, bos_token_id=None,
                layer_types=[F if (i + 1) % 4 == 0 else "linear_attention" for i in range(depth)])
    vision = dict(s["vision"], patch_size=16, num_position_embeddings=2304, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen3_5Config(vision_config=vision, text_config=text, image_token_id=151655, video_token_id=151656,
                        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3_5ForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(out)
    # Qwen3.5's processor as Qwen3-VL's (size {shortest_edge 65536, longest_edge 16777216}): the photo is 768 tokens
    write_processor_files("qwen3_vl", out, 64, 16384)


def photo(work: Path) -> Path:
    from PIL import Image

    path = work / "photo-1024x768.png"
    if not path.exists():
        Image.open(ROOT / "tests/assets/chelsea.png").convert("RGB").resize((1024, 768), Image.LANCZOS).save(path)
    return path


def cli(*args: str, capture: bool = False) -> str:
    p = subprocess.run([sys.executable, "-m", "vlmrt.cli", *args], check=True, text=True,
                       capture_output=capture)
    return p.stdout if capture else ""


def vlmrt_arm(a, work: Path) -> dict:
    """`vlmrt bench` after 100 / 1000 / 4000 prompt tokens (real prefills: a windowed cache cannot be set to a
    length by hand), then on the photo; each its own process (cold load, its peak RSS)."""
    bundle = work / a.quant

    def bench(*args: str) -> dict:
        return json.loads(cli("bench", str(bundle), *args, "--gen-tokens", "32", "--json",
                              capture=True).strip().splitlines()[-1])

    out = {"text": {p: bench("--prompt-tokens", str(p), "--runs", "1") for p in POSITIONS}}
    n = {"gemma4": 280, "qwen3_5": 768, "qwen3_vl": 768}[SHAPES[a.model]["family"]] + 24
    out["image"] = bench("--image", str(photo(work.parent)), "--prompt-tokens", str(n), "--runs", "2")
    return out


def llama_arm(a, work: Path) -> dict:
    env = {**os.environ, "LD_LIBRARY_PATH": a.llama}
    text, mmproj = work / f"text.{a.qtype}.gguf", work / "mmproj.f16.gguf"
    p = subprocess.run([f"{a.llama}/llama-bench", "-m", str(text), "-t", "2", "-p", "512", "-n", "32",
                        "-d", ",".join(["0", *map(str, POSITIONS[1:])]), "-r", "2", "-o", "json"],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"llama-bench failed ({p.returncode}): {p.stderr[-2000:]}")
    bench = [{k: r[k] for k in ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts")} for r in json.loads(p.stdout)]
    runs = []
    for _ in range(2):
        p = subprocess.run(["/usr/bin/time", "-v", f"{a.llama}/llama-mtmd-cli", "-m", str(text), "--mmproj",
                            str(mmproj), "--image", str(photo(work.parent)), "-p", "Describe this image.", "-n", "32",
                            "-t", "2", "-c", "4096", "--temp", "0", "--ignore-eos", "--no-warmup"],
                           capture_output=True, text=True, env=env)
        log = p.stdout + p.stderr
        if p.returncode:
            raise SystemExit(f"llama-mtmd-cli failed ({p.returncode}): {log[-2000:]}")
        enc = [float(x) for x in re.findall(r"(?:image slice encoded|batch encoding done) in (\d+) ms", log)]  # (mtmd-cli 0c1e570: the latter)
        dec = [float(x) for x in re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", log)]
        pe = re.search(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens", log)
        ev = re.search(r"\seval time =\s+([\d.]+) ms /\s+(\d+) runs", log)
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
        runs.append({"image_encode_ms": sum(enc), "image_prefill_ms": sum(dec),
                     "text_prompt_eval_ms": float(pe.group(1)) if pe else None,
                     "decode_ms": float(ev.group(1)) if ev else None, "decode_runs": int(ev.group(2)) if ev else None,
                     "peak_rss_mb": int(rss.group(1)) / 1024 if rss else None, "log_tail": log[-1500:]})
    return {"llama_bench": bench, "mtmd": runs}


def ov_python(a) -> str:
    if not a.ov_python:
        raise SystemExit("the openvino steps need OpenVINO's own venv: --ov-python PYTHON or VLMRT_OV_PYTHON "
                         "(python3.11 -m venv DIR; DIR/bin/pip install openvino-genai 'optimum-intel[openvino]')")
    return a.ov_python


# transformers 5.24 saves Gemma 4's vision rope as rope_type "axial" (its name for the hub's "default": the same
# inv_freq over head_dim // 2, H-H-W-W); transformers 5.5.4 (optimum-intel 2.2.0's pin) knows only "default" there
# (KeyError 'axial'). Full layers' head_dim: 5.24 writes it into per_layer_config, 5.5.4 reads global_head_dim.
def ov_checkpoint(ckpt: Path, out: Path) -> Path:
    """ckpt's files linked into out with config.json as the hub spells it (what transformers 5.5.4 reads)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((ckpt / "config.json").read_text())
    rope = cfg["vision_config"]["rope_parameters"]
    if rope.get("rope_type") == "axial":
        rope["rope_type"] = "default"
    text = cfg["text_config"]
    full = {v["head_dim"] for v in (text.get("per_layer_config") or {}).values() if "head_dim" in v}
    if full:
        text["global_head_dim"] = full.pop()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def ov_export(a, work: Path) -> dict:
    """optimum-cli export openvino --task image-text-to-text --weight-format Q (optimum-intel's defaults else)."""
    src = ov_checkpoint(work / "ckpt", work / "ckpt-ov")
    cmd = [str(Path(ov_python(a)).parent / "optimum-cli"), "export", "openvino", "--model", str(src), "--task",
           "image-text-to-text", "--weight-format", a.ov_weights, str(work / f"ov-{a.ov_weights}")]
    t = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    log = p.stdout + p.stderr
    if p.returncode:
        raise SystemExit(f"optimum-cli export failed ({p.returncode}): {log[-3000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    return {"command": " ".join(cmd[1:]), "export_s": round(time.perf_counter() - t, 1),
            "peak_rss_mb": round(int(rss.group(1)) / 1024) if rss else None, "log_tail": log[-1500:],
            "ir_mb": {f.name: round(f.stat().st_size / 2**20, 1) for f in sorted((work / f"ov-{a.ov_weights}").glob("*.bin"))}}


def ov_arm(a, work: Path) -> dict:
    """benchmarks/openvino_genai_arm.py in OpenVINO's venv: VLMPipeline, text (decode after 100 / 1000 / 4000 prompt
    tokens) and the photo, each in its own process (its peak RSS)."""
    ir, arm = work / f"ov-{a.ov_weights}", str(ROOT / "benchmarks/openvino_genai_arm.py")
    if not (ir / "openvino_language_model.xml").is_file():
        raise SystemExit(f"no OpenVINO export at {ir}: run the ov-export step first")
    out = {"weights": a.ov_weights, "ov_python": ov_python(a)}
    for what, extra in (("text", ["--prompt-tokens", ",".join(map(str, POSITIONS))]),
                        ("image", ["--photo", str(photo(work.parent))])):
        p = subprocess.run([ov_python(a), arm, what, str(ir), "--vlm", "--threads", "2", *extra],
                           capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"openvino_genai_arm {what} failed ({p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
        out[what] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def table_rss(a, work: Path) -> dict:
    """_table's three ways, each in a fresh process."""
    out = {}
    for how in ("pread", "mmap", "in_ram"):
        p = subprocess.run([sys.executable, "-m", "benchmarks.released_shapes", "_table", str(work / a.quant), how,
                            str(a.tokens)], check=True, capture_output=True, text=True, cwd=ROOT)
        out[how] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _table(bundle: str, how: str, tokens: int) -> None:
    """RSS of a loaded bundle, then after embedding `tokens` distinct random token ids (a prompt's rows) and decoding
    32 tokens, its token table read as vlmrt reads it (pread), through np.load's memory map, or np.load'ed whole."""
    import numpy as np

    from vlmrt.runtime.vlm import VLM

    vlm = VLM.load(Path(bundle))
    loaded = _rss_mb()
    m = json.loads((Path(bundle) / "manifest.json").read_text())
    path = Path(bundle) / m["decoder"]["embedding_file"]
    emb = vlm.scheduler.embedding
    if how != "pread":
        from benchmarks.gemma4_table_rows import ArrayRows
        from vlmrt.runtime.table_rows import PartRows

        arr = np.load(path, mmap_mode="r" if how == "mmap" else None)
        if isinstance(emb.table, PartRows):  # a split table's rows of bytes, dequantized as the runtime does
            emb.table.data = ArrayRows(arr.view(np.ndarray))
        else:
            emb.table = arr.view(np.ndarray) if how == "mmap" else arr
            emb._row = emb.table.__getitem__
            emb._read_row = None
        assert not emb.int8_rows, "int8 rows read with pread only"
    after_load = _rss_mb()
    rng = np.random.default_rng(0)
    vocab = emb.vocab
    t = time.perf_counter()
    vlm.scheduler.embed(rng.choice(np.arange(300, vocab), tokens, replace=False).tolist())
    for _ in vlm.generate("Describe the weather today.", max_new_tokens=32, ignore_eos=True):
        pass
    print(json.dumps({"how": how, "table_mb": round(path.stat().st_size / 2**20, 1),
                      "table_shape": list(emb.table.shape), "table_dtype": str(emb.table.dtype),
                      "rss_loaded_mb": round(loaded, 1), "rss_with_table_mb": round(after_load, 1),
                      "rss_after_mb": round(_rss_mb(), 1), "rows_read": tokens + len(vlm.result.prompt_ids) + len(vlm.result.token_ids),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "s": round(time.perf_counter() - t, 2)}))


def _merges(convert: str, src: str, dst: str) -> None:
    sys.path.insert(0, str(Path(convert).parent / "gguf-py"))
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(dst, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents(),
                             endianess=reader.endianess)
    merges = MetadataDetails(gguf.GGUFValueType.ARRAY, ["▁ w"], sub_type=gguf.GGUFValueType.STRING)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.MERGES: merges}, [])


def main() -> None:
    if sys.argv[1:2] == ["_merges"]:
        _merges(*sys.argv[2:5])
        return
    if sys.argv[1:2] == ["_table"]:
        _table(*sys.argv[2:4], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["build", "export", "gguf", "vlmrt", "llama", "table", "ov-export", "openvino"])
    ap.add_argument("model", choices=sorted(SHAPES))
    ap.add_argument("--depth", type=int, required=True)
    ap.add_argument("--work", default="/tmp/vlmrt-released")
    ap.add_argument("--quant", default="w4a8")
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--llama", default=None, help="folder of llama.cpp's binaries")
    ap.add_argument("--convert", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ov-python", default=os.environ.get("VLMRT_OV_PYTHON"),
                    help="python of a venv with openvino-genai and optimum-intel (default: $VLMRT_OV_PYTHON)")
    ap.add_argument("--ov-weights", default="int4", help="optimum-cli's --weight-format (int4, int8)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import torchvision_ops

    torchvision_ops.declare()  # transformers imports torchvision where it is installed (tests/torchvision_ops.py)
    work = Path(a.work) / f"{a.model}-d{a.depth}"
    ckpt = work / "ckpt"
    if a.step == "build":
        ckpt.mkdir(parents=True, exist_ok=True)
        family = SHAPES[a.model]["family"]
        if family == "gemma4":
            build_gemma4(ckpt, a.depth)
        elif family == "qwen3_5":
            build_qwen3_5(ckpt, a.model, a.depth)
        else:
            from benchmarks.qwen_shapes import build

            build("qwen3_vl", ckpt, a.depth, 24)
    elif a.step == "export":
        t = time.perf_counter()
        cli("export", str(ckpt), str(work / a.quant), "--quant", a.quant, "--max-seq-len", "4608", "--force")
        print(json.dumps({"export_s": round(time.perf_counter() - t, 1),
                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
    elif a.step == "gguf":
        # the converter under tests/torchvision_ops.py's declaration (transformers imports torchvision where it is
        # installed), its own gguf-py first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(a.convert).parent), str(Path(a.convert).parent / "gguf-py"),
                                                            str(ROOT / "tests")])}
        run = ["-c", "import runpy, sys, torchvision_ops; torchvision_ops.declare(); sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')", a.convert, str(ckpt), "--outtype", "f16"]
        f16 = work / "text.f16.gguf"
        if not f16.exists():
            # (a transformers-built Qwen3.5 has no multi-token-prediction block: --no-mtp)
            mtp = ["--no-mtp"] if SHAPES[a.model]["family"] == "qwen3_5" else []
            subprocess.run([sys.executable, *run, *mtp, "--outfile", str(f16)], check=True, env=env)
        if not (work / "mmproj.f16.gguf").exists():
            subprocess.run([sys.executable, *run, "--mmproj", "--outfile", str(work / "mmproj.f16.gguf")], check=True,
                           env=env)
        gemma = SHAPES[a.model]["family"] == "gemma4"
        out = work / (f"text.{a.qtype}.nomerges.gguf" if gemma else f"text.{a.qtype}.gguf")
        subprocess.run([f"{a.llama}/llama-quantize", str(f16), str(out), a.qtype], check=True,
                       env={**os.environ, "LD_LIBRARY_PATH": a.llama})
        if gemma:  # llama.cpp's gemma4 vocabulary needs tokenizer merges; this tokenizer has none: one, no tensor changed
            subprocess.run([sys.executable, "-m", "benchmarks.released_shapes", "_merges", a.convert, str(out),
                            str(work / f"text.{a.qtype}.gguf")], check=True, cwd=ROOT)
    elif a.step == "ov-export":
        print(json.dumps(ov_export(a, work)))
    else:
        r = {"vlmrt": vlmrt_arm, "llama": llama_arm, "table": table_rss, "openvino": ov_arm}[a.step](a, work)
        res = {"model": a.model, "depth": a.depth, "full_depth": SHAPES[a.model]["full_depth"], "step": a.step,
               "quant": {"llama": a.qtype, "openvino": a.ov_weights}.get(a.step, a.quant), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "loadavg": Path("/proc/loadavg").read_text().split()[:3], **r}
        print(json.dumps(res))


if __name__ == "__main__":
    main()
