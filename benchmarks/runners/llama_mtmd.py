"""llama.cpp's multimodal path (libmtmd through llama-cpp-python's MTMDChatHandler): one image + a question,
then M tokens with EOS suppressed. Prints one JSON line; libmtmd's own timings go to stderr (verbose), where
compare.py reads the vision-encode time per slice.

    python llama_mtmd.py TEXT_GGUF MMPROJ_GGUF IMAGE THREADS GEN_TOKENS PROMPT
"""
import base64
import json
import mimetypes
import resource
import sys
import time

import llama_no_repack  # noqa: F401 (VLMRT_LLAMA_NO_REPACK)
from llama_cpp import Llama
from llama_cpp.llama_chat_format import MTMDChatHandler

# SmolVLM's chat template (its processor's), over the handler's content parts: an image part arrives as a text
# part holding libmtmd's media marker. (The text GGUF carries the SmolLM2 string template, which cannot take parts.)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


class SmolVLMHandler(MTMDChatHandler):
    def _get_chat_template(self, llama_model):
        return SMOLVLM_TEMPLATE


gguf, mmproj, image, threads, n_gen, prompt = sys.argv[1:7]
threads, n_gen = int(threads), int(n_gen)
t = time.perf_counter()
handler = SmolVLMHandler(clip_model_path=mmproj, verbose=True, use_gpu=False)
llm = Llama(model_path=gguf, chat_handler=handler, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
            verbose=True)
load = time.perf_counter() - t
mime = mimetypes.guess_type(image)[0] or "image/png"
url = f"data:{mime};base64," + base64.b64encode(open(image, "rb").read()).decode()
messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]}]
eos = {str(i): -1e9 for i in {llm.token_eos(), *[i for i in (49279,) if i < llm.n_vocab()]}}
t0 = time.perf_counter()
first = None
for chunk in llm.create_chat_completion(messages=messages, max_tokens=n_gen, temperature=0.0, stream=True, logit_bias=eos):
    if first is None and chunk["choices"][0]["delta"].get("content"):
        first = time.perf_counter()
end = time.perf_counter()
# EOS is suppressed, so all n_gen tokens are generated; the last one is sampled but never evaluated
print(json.dumps({"load_s": load, "ttft_s": first - t0, "decode_tokens_per_s": (n_gen - 1) / (end - first),
                  "n_tokens": llm.n_tokens, "prompt_tokens_from_ctx": llm.n_tokens - (n_gen - 1), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
