"""`vlmrt export`: a Hugging Face checkpoint (folder or hub id) to a bundle folder (vlmrt.export.pipeline)."""

from __future__ import annotations

import importlib


def add_parser(sub) -> None:
    e = sub.add_parser("export", help="export a Hugging Face checkpoint (folder or hub id) to a bundle")
    e.add_argument("src", help="checkpoint folder or hub id (e.g. HuggingFaceTB/SmolVLM-256M-Instruct)")
    e.add_argument("out", help="bundle folder to write")
    e.add_argument("--prefill-ar", type=int, default=None,
                   help="tokens per prefill graph call (default: 128 for the one-graph CPU decoder, which takes any "
                        "block up to it, at no bundle-size cost; 32 where the prefill graph has a fixed AR (--target htp, "
                        "--context-step 0, prefill and decode at different precisions), whose last block is padded to it)")
    e.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache size = max context in tokens (default: the family's, e.g. 1024 for SmolVLM, "
                        "room for the default max tiles for InternVL)")
    e.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="graph I/O and KV cache type (default fp32)")
    e.add_argument("--quant", default=None,
                   help="weight precision: fp32|fp16|w8a16|w4a16|w8a8|w4a8|w4a16m|w4a8m|w4a16o|w4a8o|w4a16og|w4a8og|w4a16g|w4a8g for all graphs (4-bit ones keep the "
                        "vision graph at 8 bits; the m ones also keep each layer's v_proj and down_proj at 8 bits, as Q4_K_M; the o "
                        "ones are 4-bit with a float offset per block, GGUF Q4_1's rule, their lm head 4-bit with its top logits "
                        "re-scored from 8-bit rows, lm_head=w4a8r / w4a16r; the og ones the same with the 4-bit values chosen by GPTQ on "
                        "calibration prompts, minutes more to export; the g ones GPTQ with integer zero points, at w4a8's speed). "
                        "The CPU 4-bit to use: w4a8og (on the real SmolLM2-135M "
                        "decoder top-1 0.96 / KL 0.02 against fp32, within 0.4 point of fp32 on the float-trained easy-VQA model, "
                        "at ~1.15x w4a8's decode step; w4a8: ~0.7, KL ~0.4), w4a8o for a quick export; w4a16o / w4a16og "
                        "for --lookahead (float activations). Or per graph, e.g. "
                        "vision=fp16,prefill=fp16,decode=w4a16,lm_head=w8a16 (default: --dtype). --target htp: fp16 (the HTP's "
                        "float path), w8a16, w4a16 (int4 block-wise) or w4a16o (int4 block-wise with Q4_1 block offsets), default "
                        "w8a16; 4-bit ones keep the vision graph and the lm head at 8 bits; head=PREC makes the lm head a "
                        "graph of its own at PREC (e.g. vision=fp16,prefill=fp16,decode=w4a16o,head=w8a16), the default (w8a16) for an "
                        "untied head under a per-graph spec without lm_head= and without --lookahead-ar")
    e.add_argument("--target", choices=["cpu", "htp"], default="cpu",
                   help="htp: static graphs for the Qualcomm NPU (QDQ with 16-bit activations or fp16, per --quant; uint8 KV "
                        "cache), compiled into QNN context binaries")
    e.add_argument("--calibration", default=None,
                   help="HTP calibration set: a folder of images (+ optional prompts.txt, one prompt per line); "
                        "default: vlmrt's sample images and its calibration prompts (apart from `vlmrt eval`'s). "
                        "With --kv-cache int8/int4 the CPU cache's scales come from its prompts (as text)")
    e.add_argument("--kv-cache", choices=["fp32", "int8", "int4"], default="fp32",
                   help="the CPU decoder's KV cache: fp32, or int8 / int4 stored by ORT's GroupQueryAttention "
                        "(K and V per channel, scales calibrated at export; docs/performance.md: Long prompts). "
                        "Default fp32 (int8 holds 4x less at long contexts, but ORT prefills over it at half the "
                        "speed); int4 is for measurement (its top-1 falls to ~0.7)")
    e.add_argument("--table", default=None, metavar="FORM",
                   help="the token table's stored form (embed.npy, read per row on the host): float32, float16, int8 (a "
                        "scale per row), int8g64 (a scale per 64 values), int4g32 / int4g64 (4-bit, a scale per 32 / 64 "
                        "values), or split E+P where a row also carries per-layer columns (Gemma 4): the embedding "
                        "columns in E (float16 / float32), the per-layer ones in P (int4g32, int4g64, int8g64), one "
                        "read a row; default: int8 under weight-only precisions, float16+int4g32 there for rows with "
                        "per-layer columns, else the graphs' float type (docs/bundle-format.md)")
    e.add_argument("--soc-model", default=None,
                   help="HTP: the Snapdragon the context binaries are compiled for: SM8850, SM8750, SM8650, SM8550, SC8380XP "
                        "or a QNN soc model id (default SM8750 = Snapdragon 8 Elite, htp_arch 79)")
    e.add_argument("--htp-arch", default=None, help="HTP: Hexagon arch (e.g. 73, 75, 79) when --soc-model is not given or not known")
    e.add_argument("--keep-qdq", action="store_true",
                   help="HTP: also keep the QDQ ONNX graphs (the CPU EP runs only those; the QNN EP would compile them at load)")
    e.add_argument("--htp-shared-context", action="store_true",
                   help="HTP: prefill and decode in one context binary (one copy of the decoder weights on the device); "
                        "unverified: the x86-64 simulator cannot load it (docs/npu-deploy.md)")
    e.add_argument("--lookahead-ar", type=int, default=0, metavar="K",
                   help="HTP: also a lookahead verify graph of K tokens (the decode graph at AR = K, every row's logits), "
                        "which `run --lookahead` (up to K-1 drafts) uses; default 0: none")
    e.add_argument("--context-step", type=int, default=None,
                   help="CPU decoder graphs take any cache length and each step reads the cache prefix it needs, "
                        "rounded up to this many slots (default 64; 0 = static graphs over the whole cache, as "
                        "--target htp uses)")
    e.add_argument("--attention", choices=["gqa", "portable"], default=None,
                   help="gqa: the CPU decoder's attention as ORT's GroupQueryAttention, which updates the KV cache in "
                        "place (the default for the one-graph CPU decoder when head_dim is a multiple of 16); portable: "
                        "the graph's own attention ops and host-written KV rows (what static and HTP graphs use)")
    e.add_argument("--max-patches", type=int, default=None,
                   help="native-resolution bundles (Qwen2.5-VL, Qwen3-VL): the vision graph's patch budget (its static "
                        "rows; an image the processor would make larger is resized to fit; 4 patches = 1 image token). "
                        "Default: 4096, or the processor's own max_pixels when smaller; the export says which")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.add_argument("--quiet", action="store_true", help="no progress display")
    e.set_defaults(fn=run)


def _check_export_extra() -> None:
    """An install without the export extra (`pip install vlmrt`: the runtime alone) is told so in one line."""
    try:
        for name in ("onnx", "onnxscript", "safetensors", "torch"):
            importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"vlmrt export needs the export extra ({e.name} is not installed): "
                         "pip install 'vlmrt[export]'") from None


def run(a) -> int:
    _check_export_extra()
    from ..export.pipeline import export

    calibration = None
    if a.calibration:
        from ..eval.samples import calibration_set

        calibration = calibration_set(a.calibration)
    out = export(a.src, a.out, prefill_ar=a.prefill_ar, max_seq_len=a.max_seq_len, dtype=a.dtype, quant=a.quant,
                 target=a.target, calibration=calibration, soc_model=a.soc_model,
                 htp_arch=a.htp_arch, keep_qdq=a.keep_qdq, shared_context=a.htp_shared_context,
                 context_step=a.context_step, attention=a.attention, lookahead_ar=a.lookahead_ar, force=a.force,
                 max_patches=a.max_patches, kv_cache=a.kv_cache, table=a.table, progress=not a.quiet)
    print(out)
    return 0
