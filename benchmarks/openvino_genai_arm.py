"""OpenVINO GenAI's pipelines timed on an optimum-cli export, run in OpenVINO's own venv (a peer beside vlmrt and
llama.cpp, not a dependency: optimum-intel 2.2.0 pins transformers 5.5.4, vlmrt's exporters need 5.24). Imports
only openvino_genai, numpy and PIL; benchmarks/released_shapes.py (`openvino` step) and
benchmarks/long_prompts.py (`--openvino`) run it with that venv's python and read the JSON line it prints last.

    OV_PYTHON benchmarks/openvino_genai_arm.py text  IR_DIR --vlm|--llm --prompt-tokens 100,1000,4000 [--gen 32]
    OV_PYTHON benchmarks/openvino_genai_arm.py image IR_DIR --photo PNG [--gen 32] [--runs 2]

One pipeline per process, on the CPU with INFERENCE_NUM_THREADS (default 2, as llama.cpp's -t 2). `text`: for each
prompt length a prompt of that many tokens (single characters, which a merge-free byte-fallback BPE reads one token
each; other tokenizers: a word each, the count read back from the tokenizer), greedy, `ignore_eos`, --gen tokens;
no chat template; TTFT and the mean time per output token after the first (TPOT) from the pipeline's own perf
metrics. `image`: the photo as a [1, H, W, 3] uint8 tensor with a short prompt, --runs times; TTFT (the vision encoder, the prefill and the
first token) and the vision encode time. Peak RSS: this process's ru_maxrss at the end (what /usr/bin/time -v
reports for it).
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def pipeline(a):
    import openvino_genai as ov_genai

    props = {"INFERENCE_NUM_THREADS": a.threads}
    t = time.perf_counter()
    pipe = (ov_genai.VLMPipeline if a.kind == "vlm" else ov_genai.LLMPipeline)(a.ir, "CPU", **props)
    return pipe, time.perf_counter() - t


def config(pipe, gen: int):
    cfg = pipe.get_generation_config()
    cfg.max_new_tokens = gen
    cfg.min_new_tokens = gen
    cfg.ignore_eos = True
    cfg.do_sample = False
    return cfg


def prompt_of(tok, n: int) -> str:
    """A prompt that the pipeline's tokenizer reads as n tokens (without the chat template's own)."""
    for unit in ("a", " hello"):
        text = unit * n
        if len(tok.encode(text, add_special_tokens=False).input_ids.data[0]) == n:
            return text
    raise SystemExit(f"no {n}-token prompt for this tokenizer")


def metrics(res, wall: float) -> dict:
    pm = res.perf_metrics
    tpot = pm.get_tpot().mean
    out = {"input_tokens": pm.get_num_input_tokens(), "generated_tokens": pm.get_num_generated_tokens(),
           "ttft_ms": round(pm.get_ttft().mean, 1), "tpot_ms": round(tpot, 2),
           "decode_tok_s": round(1000 / tpot, 1) if tpot else None, "wall_s": round(wall, 2)}
    if hasattr(pm, "get_vision_encoding_duration"):  # VLM metrics
        out["vision_encode_ms"] = round(pm.get_vision_encoding_duration().mean, 1)
        out["prepare_embeddings_ms"] = round(pm.get_prepare_embeddings_duration().mean, 1)
    return out


def text(a) -> dict:
    pipe, load_s = pipeline(a)
    cfg = config(pipe, a.gen)
    cfg.apply_chat_template = False  # the prompt's tokens as counted (`vlmrt bench --prompt-tokens`, llama-bench -p)
    tok = pipe.get_tokenizer()
    pipe.generate("Hello.", generation_config=config(pipe, 4))  # warm-up (first inference compiles kernels)
    rows = []
    for n in [int(x) for x in a.prompt_tokens.split(",")]:
        prompt = prompt_of(tok, n)
        t = time.perf_counter()
        res = pipe.generate([prompt] if a.kind == "llm" else prompt, generation_config=cfg)  # (LLMPipeline: a list
        # gives DecodedResults, with perf_metrics; one string only the text)
        rows.append({"prompt_tokens": n, **metrics(res, time.perf_counter() - t)})
    return {"load_s": round(load_s, 2), "runs": rows}


def image(a) -> dict:
    import numpy as np
    import openvino as ov
    from PIL import Image

    pipe, load_s = pipeline(a)
    cfg = config(pipe, a.gen)
    img = ov.Tensor(np.asarray(Image.open(a.photo).convert("RGB"), dtype=np.uint8)[None])
    pipe.generate("Hello.", generation_config=config(pipe, 4))  # warm-up: text only, as vlmrt's bench and mtmd-cli
    rows = []
    for _ in range(a.runs):
        t = time.perf_counter()
        res = pipe.generate("Describe this image.", images=[img], generation_config=cfg)
        rows.append(metrics(res, time.perf_counter() - t))
    return {"load_s": round(load_s, 2), "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["text", "image"])
    ap.add_argument("ir")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--vlm", dest="kind", action="store_const", const="vlm")
    kind.add_argument("--llm", dest="kind", action="store_const", const="llm")
    ap.set_defaults(kind="vlm")
    ap.add_argument("--prompt-tokens", default="100,1000,4000")
    ap.add_argument("--photo")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import openvino_genai

    out = {"text": text, "image": image}[a.what](a)
    print(json.dumps({"openvino_genai": openvino_genai.__version__, "pipeline": a.kind, "threads": a.threads, **out,
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()
