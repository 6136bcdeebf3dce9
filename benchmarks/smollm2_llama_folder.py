"""The decoder of a `python -m vlmrt.demo.smollm2` checkpoint as a Hugging Face LlamaForCausalLM folder: what
optimum-cli's text-generation export (OpenVINO GenAI's LLMPipeline, benchmarks/long_prompts.py --openvino) takes.

    python -m benchmarks.smollm2_llama_folder CKPT OUT

The same weights vlmrt's bundles of CKPT hold (the real SmolLM2-135M-Instruct, with SmolVLM's 128 added rows):
`model.text_model.*` renamed `model.*` (the tied head stays tied), config.json the checkpoint's text_config as
LlamaForCausalLM's, the tokenizer files and generation_config.json copied. Nothing else is read or changed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def write(ckpt: Path, out: Path) -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    prefix = "model.text_model."
    with safe_open(str(ckpt / "model.safetensors"), "np") as f:
        tensors = {"model." + k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    if not tensors:
        raise SystemExit(f"{ckpt}: no {prefix}* tensors (not a vlmrt.demo.smollm2 checkpoint)")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    text = {**cfg["text_config"], "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(text, indent=1) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, out / name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    write(Path(sys.argv[1]), Path(sys.argv[2]))
