"""llama.cpp's side of benchmarks/cold_start.py: one whole process that answers a prompt as `vlmrt run` does —
import llama-cpp-python, load the GGUF, apply its chat template, then exactly N greedy tokens (EOS ignored) —
and prints the answer. The caller times the process and reads its peak RSS.

    python llama_cold.py GGUF THREADS N_CTX TOKENS PROMPT
"""
import sys

import numpy as np
import llama_no_repack  # noqa: F401 (VLMRT_LLAMA_NO_REPACK)
from llama_cpp import Llama

gguf, threads, n_ctx, n_gen, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
# the GGUF's own chat template (SmolLM2's ChatML), rendered as llama-cpp-python renders it for chat completions
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402

fmt = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>", bos_token="")
text = fmt(messages=[{"role": "user", "content": prompt}]).prompt
ids = llm.tokenize(text.encode(), add_bos=False, special=True)
llm.eval(ids)
out = []
for _ in range(n_gen):
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out.append(tok)
    if len(out) < n_gen:
        llm.eval([tok])
sys.stdout.write(llm.detokenize(out).decode("utf-8", "replace") + "\n")
