"""Llama-architecture GGUF files (llama.cpp) read as Hugging Face tensors and a `tokenizers` tokenizer.

The GGUF side of `smollm2.py` (which assembles a SmolVLM checkpoint around the result): tensors are
de-quantized to fp32 with the `gguf` package (``gguf.quants.dequantize``), renamed from llama.cpp to
Hugging Face Llama names by an explicit table, and q/k rows put back in Hugging Face's RoPE layout
(:func:`unpermute_qk`); the byte-level BPE tokenizer is rebuilt from the GGUF metadata.
Only numpy, ``gguf`` and ``tokenizers`` are used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np


class GGUFError(ValueError):
    """A GGUF this reader does not handle, or a missing package; the message is one line."""


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading GGUF files needs the gguf package: pip install 'vlmrt[export]' (or pip install gguf)") from None
    return gguf


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py, ``LlamaModel.permute``), for tests.

    Hugging Face's RoPE rotates the pairs (i, i + d/2) of each head (``rotate_half``); llama.cpp's
    "normal" RoPE rotates adjacent pairs (2i, 2i+1). The converter therefore reorders the rows of
    each head from [x0..x(d/2-1), y0..y(d/2-1)] to [x0, y0, x1, y1, ...]:
    ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``. It is applied to q_proj with the number of
    attention heads and to k_proj with the number of KV heads. Heads keep their order.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_qk`: rows of each head [x0, y0, x1, y1, ...] -> [x0.., y0..]."""
    if w.shape[0] % (2 * n_head):
        raise GGUFError(f"cannot undo the Q/K permutation: {w.shape[0]} rows is not a multiple of 2 x {n_head} heads")
    d = w.shape[0] // n_head
    return np.ascontiguousarray(w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# llama.cpp tensor name (per block: blk.N.<name>) -> Hugging Face Llama name
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``, etc."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in the GGUF (this converter handles plain Llama decoders)")


def read_metadata(reader) -> dict[str, Any]:
    """All GGUF key/values as Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header: version, tensor_count, kv_count
            continue
        meta[key] = field.contents()
    return meta


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(tensors, meta)``: the decoder de-quantized to fp32 in Hugging Face Llama names, and the metadata.

    numpy shapes are GGUF's ``ne`` reversed (``ne[0]`` is the contiguous, input dimension), which is
    exactly torch's ``[out_features, in_features]``. q_proj / k_proj rows are un-permuted. There is
    no ``lm_head.weight`` when the GGUF has no ``output.weight`` (tied embeddings, as SmolLM2-135M).
    """
    gguf = _gguf_module()
    from gguf.quants import dequantize

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise GGUFError(f"cannot read GGUF {path}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path.name}: architecture {arch!r}, expected 'llama'")
    n_head = int(meta["llama.attention.head_count"])
    n_head_kv = int(meta.get("llama.attention.head_count_kv", n_head))

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        want = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(want)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, n_head)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, n_head_kv)
        tensors[name] = np.ascontiguousarray(w)
    return tensors, meta


# tokenizer.ggml.pre -> how text is split before BPE. llama.cpp's "smollm" (like starcoder,
# refact, command-r) splits every digit off (\p{N}) and then applies the GPT-2 regex; the real
# SmolLM2 tokenizer.json says the same with Digits(individual_digits) + ByteLevel(use_regex).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell")
_GPT2 = ("gpt2", "default")

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4  # gguf.TokenType


def tokenizer_from_gguf(meta: dict[str, Any]):
    """The GGUF's byte-level BPE tokenizer as a ``tokenizers.Tokenizer`` (no post-processor adds tokens).

    Control tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...) become special added
    tokens at their ids, user-defined ones plain added tokens -- as in the real tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges_raw: list[str] = list(meta["tokenizer.ggml.merges"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF tokenizer has duplicate tokens")
    merges = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"GGUF tokenizer merge {m!r} is not two tokens")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _GPT2:
        tok.pre_tokenizer = byte_level
    else:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(_DIGITS_THEN_GPT2 + _GPT2)})")
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)

    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    for t in special + user:
        if tok.token_to_id(t.content) != vocab[t.content]:
            raise GGUFError(f"GGUF tokenizer: added token {t.content!r} moved")
    return tok
