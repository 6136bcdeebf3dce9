"""Imported by the llama.cpp runners before llama_cpp's Llama: with VLMRT_LLAMA_NO_REPACK=1 every model loads
without llama.cpp's extra buffer types — what llama.cpp's own `--no-repack` option does (use_extra_bufts = false):
no AMX and no repacked weight layouts. compare_gguf.needs_no_repack() sets it when a default build dies on this
CPU (a VM that reports AMX but faults on its tile instructions: SIGILL in the first matmul)."""
import os

if os.environ.get("VLMRT_LLAMA_NO_REPACK") == "1":
    import llama_cpp.llama_cpp as _c

    _default = _c.llama_model_default_params

    def _params():
        p = _default()
        p.use_extra_bufts = False
        return p

    _c.llama_model_default_params = _params
