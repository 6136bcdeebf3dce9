"""The files of a SmolVLM checkpoint built around the SmolLM2 GGUF (demo/smollm2.py writes them): SmolVLM's added
tokens, the chat templates, the vision presets, the contents of config.json / tokenizer_config.json /
preprocessor_config.json, and the vision tower's weights (random or given). numpy only."""

from __future__ import annotations

from typing import Any

import numpy as np

from .gguf_llama import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, GGUFError


class SmolLM2Error(GGUFError):
    """A missing package/file, or a checkpoint this converter cannot write; the message is one line."""


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

# SmolVLM's added tokens at the ids of HuggingFaceTB/SmolVLM-256M-Instruct (added after the 49152
# SmolLM2 tokens): <global-img>, the 36 <row_r_col_c> grid tokens, <fake_token_around_image>,
# <image>, 88 reserved tokens, <end_of_utterance>  -> vocab 49280, <image> = 49190.
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
MAX_GRID = 6
SMOLVLM_ADDED_TOKENS: list[str] = (
    [GLOBAL_IMAGE_TOKEN]
    + [f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)]
    + [FAKE_IMAGE_TOKEN, IMAGE_TOKEN]
    + [f"<|reserved_special_token_{i}|>" for i in range(88)]
    + [END_OF_UTTERANCE]
)


def add_smolvlm_tokens(tok) -> dict[str, int]:
    """Append SmolVLM's added tokens (special) at the ids SmolVLM-256M-Instruct gives them; {token: id}."""
    from tokenizers import AddedToken

    base = tok.get_vocab_size(with_added_tokens=True)
    ids = {}
    for i, t in enumerate(SMOLVLM_ADDED_TOKENS):
        if tok.token_to_id(t) is not None:
            raise SmolLM2Error(f"tokenizer already has {t!r}")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        ids[t] = tok.token_to_id(t)
        if ids[t] != base + i:
            raise SmolLM2Error(f"added token {t!r} got id {ids[t]}, expected {base + i}")
    return ids


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------

# transformers.models.smolvlm.processing_smolvlm.DEFAULT_CHAT_TEMPLATE (transformers 5.24), verbatim.
SMOLVLM_CHAT_TEMPLATE = "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"  # noqa: E501

# SmolLM2-Instruct's own ChatML template (the GGUF's tokenizer.chat_template) extended to SmolVLM's
# message content lists ({"type": "image"} -> "<image>"). Text-only, it renders exactly what the
# GGUF template renders (tests/test_smollm2.py checks it): the untrained-VLM decoder then sees the
# prompt format it was trained on -- and the one llama.cpp uses -- instead of "User: ...<end_of_utterance>".
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_TEMPLATES = {"smolvlm": SMOLVLM_CHAT_TEMPLATE, "smollm2": SMOLLM2_CHAT_TEMPLATE}

# vision presets: SigLIP config + pixel-shuffle factor + the processor's longest edge (in tiles)
VISION_PRESETS: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolVLM-256M-Instruct: 512 px tiles, patch 16, scale 4 -> 64 tokens per tile
    "256m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 image_size=512, patch_size=16, scale_factor=4, longest_edge=2048),
    # fast experiments: 64 px tiles, patch 8, scale 2 -> 16 tokens per tile
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 image_size=64, patch_size=8, scale_factor=2, longest_edge=256),
    # the shipped easy-vqa demo (vlmrt.demo.checkpoint): one 64 px tile (a 64x64 image is a single
    # global tile), patch 8, scale 4 -> 4 tokens (short sequences keep training cheap); weights trained by training/train_easyvqa.py
    "easyvqa": dict(hidden_size=96, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                    image_size=64, patch_size=8, scale_factor=4, longest_edge=64),
}
VISION_ACT = "gelu_pytorch_tanh"
VISION_EPS = 1e-6
ADDED_ROW_NOISE = 0.01  # x the embedding table's per-column std
ADDED_ROW_SEED = 20240  # the added embedding rows do not depend on `seed` (text results stay put)


def _shortest_float32(x: float) -> float:
    """The shortest decimal that is the same float32 (GGUF stores 1e-5 as float32 9.99999975e-06)."""
    return float(str(np.float32(x)))


def text_config_from_meta(meta: dict[str, Any], vocab_size: int, special: dict[str, Any]) -> dict[str, Any]:
    """The Llama ``text_config`` of the GGUF's decoder."""
    a = meta["general.architecture"]
    hidden = int(meta[f"{a}.embedding_length"])
    heads = int(meta[f"{a}.attention.head_count"])
    head_dim = hidden // heads
    rope_dim = int(meta.get(f"{a}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise SmolLM2Error(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    if meta.get(f"{a}.rope.scaling.type", "none") not in ("none", None):
        raise SmolLM2Error(f"RoPE scaling {meta[f'{a}.rope.scaling.type']!r} is not supported")
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    return dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta[f"{a}.feed_forward_length"]),
        num_hidden_layers=int(meta[f"{a}.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(meta.get(f"{a}.context_length", 8192)),
        rms_norm_eps=_shortest_float32(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        rope_theta=theta,
        rope_parameters={"rope_theta": theta, "rope_type": "default"},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        **special,
    )


SMOLVLM_SPECIAL = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE]  # additional_special_tokens, as SmolVLM's


def tokenizer_config(meta: dict[str, Any], added: dict[str, int], *, bos: str, pad: str, unk: str) -> dict[str, Any]:
    """tokenizer_config.json: SmolVLM's special-token attributes (transformers 5 turns the top-level
    ``*_token`` keys into tokenizer attributes, which SmolVLMProcessor reads) + SmolLM2's chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    added_decoder = {}
    for i, ty in enumerate(meta.get("tokenizer.ggml.token_type") or []):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            added_decoder[str(i)] = dict(content=tokens[i], lstrip=False, normalized=False, rstrip=False,
                                         single_word=False, special=ty == TOKEN_TYPE_CONTROL)
    for t, i in added.items():
        added_decoder[str(i)] = dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "added_tokens_decoder": added_decoder,
        "bos_token": bos,
        "eos_token": END_OF_UTTERANCE,
        "pad_token": pad,
        "unk_token": unk,
        "fake_image_token": FAKE_IMAGE_TOKEN,
        "image_token": IMAGE_TOKEN,
        "global_image_token": GLOBAL_IMAGE_TOKEN,
        "end_of_utterance_token": END_OF_UTTERANCE,
        "additional_special_tokens": SMOLVLM_SPECIAL,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length", 8192)),
        "truncation_side": "left",
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]  # SmolLM2's ChatML template
    return config


def preprocessor_config(preset: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json as SmolVLM-256M's (tiles of image_size px, longest edge from the preset)."""
    return {
        "image_processor_type": "SmolVLMImageProcessor",
        "processor_class": "SmolVLMProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": preset["longest_edge"]},
        "max_image_size": {"longest_edge": preset["image_size"]},
        "resample": 1,  # PIL.Image.LANCZOS
        "do_image_splitting": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }


def smolvlm_config(text_config: dict[str, Any], preset: dict[str, Any], image_token_id: int, special: dict[str, Any]) -> dict[str, Any]:
    """config.json: SmolVLMForConditionalGeneration, tied embeddings (flag at both levels, as released configs)."""
    vision_config = dict(
        model_type="smolvlm_vision",
        hidden_size=preset["hidden_size"],
        intermediate_size=preset["intermediate_size"],
        num_hidden_layers=preset["num_hidden_layers"],
        num_attention_heads=preset["num_attention_heads"],
        num_channels=3,
        image_size=preset["image_size"],
        patch_size=preset["patch_size"],
        hidden_act=VISION_ACT,
        layer_norm_eps=VISION_EPS,
    )
    return {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "image_token_id": image_token_id,
        "scale_factor": preset["scale_factor"],
        "tie_word_embeddings": True,
        "vocab_size": text_config["vocab_size"],
        **special,
        "dtype": "float32",
        "text_config": text_config,
        "vision_config": vision_config,
    }


def vision_shapes(preset: dict[str, Any], text_hidden: int) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of the SigLIP tower + connector of a SmolVLM with this vision preset."""
    h, inter, p = preset["hidden_size"], preset["intermediate_size"], preset["patch_size"]
    n_pos = (preset["image_size"] // p) ** 2
    v = "model.vision_model."
    shapes: dict[str, tuple[int, ...]] = {
        v + "embeddings.patch_embedding.weight": (h, 3, p, p),
        v + "embeddings.patch_embedding.bias": (h,),
        v + "embeddings.position_embedding.weight": (n_pos, h),
    }
    for i in range(preset["num_hidden_layers"]):
        L = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{L}self_attn.{proj}.weight"] = (h, h)
            shapes[f"{L}self_attn.{proj}.bias"] = (h,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{L}{norm}.weight"] = (h,)
            shapes[f"{L}{norm}.bias"] = (h,)
        shapes[f"{L}mlp.fc1.weight"] = (inter, h)
        shapes[f"{L}mlp.fc1.bias"] = (inter,)
        shapes[f"{L}mlp.fc2.weight"] = (h, inter)
        shapes[f"{L}mlp.fc2.bias"] = (h,)
    shapes[v + "post_layernorm.weight"] = (h,)
    shapes[v + "post_layernorm.bias"] = (h,)
    shapes["model.connector.modality_projection.proj.weight"] = (text_hidden, h * preset["scale_factor"] ** 2)
    return shapes


def random_vision(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Unit-gain random weights (as tests/fixtures.py draws them): >=2-D N(0, 1/fan_in) with
    fan_in = prod(shape[1:]); 1-D weights (LayerNorm) 1 + 0.1 N(0, 1); biases 0.05 N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        x = rng.standard_normal(shape, dtype=np.float32)
        if len(shape) >= 2:
            x *= np.float32(1.0 / np.sqrt(np.prod(shape[1:])))
        elif name.endswith("weight"):
            x = np.float32(1.0) + np.float32(0.1) * x
        else:
            x *= np.float32(0.05)
        out[name] = x
    return out


def given_vision(vision_weights: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    missing = sorted(set(shapes) - set(vision_weights))
    extra = sorted(set(vision_weights) - set(shapes))
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise SmolLM2Error(f"vision_weights do not fit the vision preset: {what} ({len(missing)} missing, {len(extra)} unexpected)")
    out = {}
    for name, shape in shapes.items():
        w = vision_weights[name]
        if hasattr(w, "detach"):  # a torch tensor
            w = w.detach().cpu().float().numpy()
        w = np.ascontiguousarray(np.asarray(w, dtype=np.float32))
        if w.shape != shape:
            raise SmolLM2Error(f"vision_weights[{name!r}] has shape {w.shape}, expected {shape}")
        out[name] = w
    return out


def grow_embeddings(embed: np.ndarray, n_new: int) -> np.ndarray:
    """Append ``n_new`` rows: the mean embedding + ADDED_ROW_NOISE x column std x N(0, 1) (fixed seed).

    With tied embeddings these rows are also lm_head rows; the mean row's logit is the mean logit,
    so a new token is never the greedy pick of the text-only model."""
    rng = np.random.default_rng(ADDED_ROW_SEED)
    mean = embed.mean(axis=0, dtype=np.float64)
    std = embed.std(axis=0, dtype=np.float64)
    new = mean + ADDED_ROW_NOISE * std * rng.standard_normal((n_new, embed.shape[1]))
    return np.concatenate([embed, new.astype(np.float32)], axis=0)
