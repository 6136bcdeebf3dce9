"""Tiny random InternVL checkpoints (InternVL3 / InternVL3.5 shapes), for tests.

The InternVL counterpart of tests/fixtures.py (same style: plain functions, torch / transformers
imported lazily inside them, torchvision never imported):

* :func:`make_internvl_tokenizer` -- a tiny byte-level BPE with the Qwen pre-tokenizer and the Qwen
  + InternVL special tokens, or the real Qwen3 tokenizer (tests/assets/qwen3-tokenizer) with the
  InternVL tokens appended the way the ``-hf`` repos have them.
* :func:`make_internvl_checkpoint` -- ``InternVLForConditionalGeneration`` (InternViT + Qwen2 or
  Qwen3 decoder) in the Hugging Face ``-hf`` hub layout (``OpenGVLab/InternVL3-1B-hf``,
  ``OpenGVLab/InternVL3_5-1B-HF``): config.json, model.safetensors, tokenizer, preprocessor_config.json
  (GotOcr2 image processor), processor_config.json, chat_template.json, generation_config.json.
  Weights are re-drawn at unit gain (attention q/k at ``fixtures.QK_GAIN``), layer-scale vectors random
  and non-zero, and the ``<IMG_CONTEXT>`` row of lm_head zeroed so it is never generated.
* :func:`to_original_layout` -- the same weights in the ORIGINAL OpenGVLab layout
  (``InternVLChatModel``: ``vision_model.*`` with fused ``attn.qkv``, ``mlp1.*``,
  ``language_model.*``), i.e. what ``OpenGVLab/InternVL3-1B`` / ``InternVL3_5-1B`` ship.
* :func:`load_hf_model`, :func:`hf_processor`, :func:`hf_generate` -- the transformers oracle
  (fp32, eval, greedy).

How InternVLProcessor expands an image (transformers 5.24, processing_internvl.py): the chat
template emits ``<IMG_CONTEXT>\\n`` for an image content item; the processor replaces each
``<IMG_CONTEXT>`` of the text by ``<img>`` + ``<IMG_CONTEXT>`` * (image_seq_length * num_tiles)
+ ``</img>`` (no newlines inside), so the ``\\n`` of the template follows ``</img>`` -- the same
string the original ``model.chat()`` builds from ``<image>\\n{question}``.
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
from functools import partial
from pathlib import Path

import oracle
from fixtures import redraw_weights
from oracle import OracleFamily

HERE = Path(__file__).resolve().parent
QWEN3_TOKENIZER_DIR = HERE / "assets" / "qwen3-tokenizer"

# ---------------------------------------------------------------------------
# Tokens
# ---------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMG_START = "<img>"
IMG_END = "</img>"
IMG_CONTEXT = "<IMG_CONTEXT>"
VIDEO_TOKEN = "<video>"
# Appended in this order by transformers' convert_internvl_weights_to_hf.py (write_tokenizer):
# Qwen2.5 vocab -> <img>=151665 ... </box>=151673, image_token_id 151667 (InternVL3-1B-hf);
# Qwen3 vocab (which already ends with <think></think>) -> <img>=151669, <IMG_CONTEXT>=151671
# (InternVL3_5-1B-HF's image_token_id).
INTERNVL_TOKENS: list[str] = [
    IMG_START,
    IMG_END,
    IMG_CONTEXT,
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
]
# The -hf tokenizer_config declares video_token="<video>" (InternVLProcessor reads it); transformers
# adds it to the vocab at load time when missing, so it is written explicitly after the others.
ADDED_TOKENS: list[str] = INTERNVL_TOKENS + [VIDEO_TOKEN]
QWEN_SPECIAL_TOKENS: list[str] = [ENDOFTEXT, IM_START, IM_END]

# tokenizer_config.json attributes InternVLProcessor.__init__ reads (tokenizer.start_image_token,
# .end_image_token, .context_image_token, .video_token and their *_id). transformers 5 turns
# unknown top-level "*_token" keys (and an "extra_special_tokens" dict) into model-specific special
# tokens, so getattr(tokenizer, "context_image_token") works.
INTERNVL_TOKENIZER_ATTRS = {
    "start_image_token": IMG_START,
    "end_image_token": IMG_END,
    "context_image_token": IMG_CONTEXT,
    "video_token": VIDEO_TOKEN,
}

# Qwen2 / Qwen2.5 / Qwen3 pre-tokenizer regex (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX and the
# Split pattern of the real tokenizer.json). transformers 5's Qwen2Tokenizer REBUILDS the pipeline
# (NFC + this Split + ByteLevel) from vocab/merges instead of using tokenizer.json's, so the tiny
# tokenizer uses exactly that pipeline: the oracle and a `tokenizers`-based runtime then agree.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

BPE_VOCAB_SIZE = 480  # 256 byte symbols + 3 Qwen specials + ~221 merges; + 10 InternVL tokens -> ~490

# Default system message of the ORIGINAL InternVL2.5 / InternVL3 conversation template
# ("internvl2_5" in conversation.py; the InternVL3 tokenizer_config chat_template inserts it when
# there is no system turn). The -hf chat templates do NOT insert it.
INTERNVL_SYSTEM_MESSAGE = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)

# chat_template.json of OpenGVLab/InternVL3-1B-hf: verbatim the `chat_template` of transformers'
# src/transformers/models/internvl/convert_internvl_weights_to_hf.py (the script that produced the
# -hf repos; the InternVL3.5 version of the script writes the same template for Qwen3 decoders).
# transformers' own integration tests confirm it: apply_chat_template on [image, text] gives exactly
# "<|im_start|>user\n<IMG_CONTEXT>\nPlease describe the image explicitly.<|im_end|>\n<|im_start|>assistant\n"
# (no system turn).
HF_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}"
    "{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{'<|im_end|>\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{'<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# tokenizer_config chat_template of the ORIGINAL repos (text-only, string content; images are put in
# the text by model.chat() as "<image>\n" and expanded to <img>...</img>). Reconstructed, not copied:
# lmdeploy's tests show the InternVL3 one inserts INTERNVL_SYSTEM_MESSAGE when there is no system
# turn and the InternVL3.5 one does not.
_ORIG_TEMPLATE_BODY = (
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ORIGINAL_CHAT_TEMPLATES = {
    "qwen2": "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + INTERNVL_SYSTEM_MESSAGE + "<|im_end|>\n' }}"
    "{% endif %}" + _ORIG_TEMPLATE_BODY,
    "qwen3": "{% for message in messages %}" + _ORIG_TEMPLATE_BODY,
}


def _added_token_entry(content: str, special: bool = True) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def make_internvl_tokenizer(out_dir: Path, *, real_qwen3: bool = False) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``) to ``out_dir``.

    real_qwen3=False: a tiny byte-level BPE (trained in a few ms on tests/fixtures.py's corpus) with
    the Qwen pipeline (NFC, Qwen Split regex + ByteLevel, ByteLevel decoder, no BOS/EOS added).
    Ids: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>``, 256 byte symbols, merges, then
    ``ADDED_TOKENS`` (``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ``<quad>``, ``</quad>``, ``<ref>``,
    ``</ref>``, ``<box>``, ``</box>``, ``<video>``) appended in order.

    real_qwen3=True: the real Qwen3 tokenizer (151669 entries, ``<|endoftext|>``=151643,
    ``<|im_start|>``=151644, ``<|im_end|>``=151645, ..., ``</think>``=151668) + ``ADDED_TOKENS``
    appended: ``<img>``=151669, ``</img>``=151670, ``<IMG_CONTEXT>``=151671, ..., ``<video>``=151678.

    Both: tokenizer_class ``Qwen2Tokenizer``, eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, and the
    ``INTERNVL_TOKENIZER_ATTRS`` InternVLProcessor needs (top level and as an ``extra_special_tokens``
    dict, as in the -hf repos).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    if real_qwen3:
        raw = gzip.decompress((QWEN3_TOKENIZER_DIR / "tokenizer.json.gz").read_bytes()).decode("utf-8")
        tok = Tokenizer.from_str(raw)
        config = json.loads((QWEN3_TOKENIZER_DIR / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)  # Qwen3's own template; the -hf repos use HF_CHAT_TEMPLATE
        base_extra = list(config.get("additional_special_tokens", []))
    else:
        from fixtures import _corpus

        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        trainer = trainers.BpeTrainer(
            vocab_size=BPE_VOCAB_SIZE,
            min_frequency=2,
            show_progress=False,
            special_tokens=QWEN_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        for t in QWEN_SPECIAL_TOKENS:
            assert tok.token_to_id(t) is not None, t
        config = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {str(tok.token_to_id(t)): _added_token_entry(t) for t in QWEN_SPECIAL_TOKENS},
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "errors": "replace",
            "model_max_length": 8192,
            "pad_token": ENDOFTEXT,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        base_extra = [IM_START, IM_END]

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED_TOKENS])
    for t in ADDED_TOKENS:
        assert tok.token_to_id(t) is not None, t
    tok.save(str(out_dir / "tokenizer.json"))

    for t in ADDED_TOKENS:
        config["added_tokens_decoder"][str(tok.token_to_id(t))] = _added_token_entry(t)
    extra = base_extra + [t for t in INTERNVL_TOKENS if t not in base_extra]
    config["additional_special_tokens"] = extra
    config.update(INTERNVL_TOKENIZER_ATTRS)
    config["extra_special_tokens"] = dict(INTERNVL_TOKENIZER_ATTRS)
    config["chat_template"] = HF_CHAT_TEMPLATE
    config["model_max_length"] = 8192
    config["padding_side"] = "left"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "additional_special_tokens": extra,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------

TEXT_HIDDEN = 64
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
TEXT_HEAD_DIM = {"qwen2": 16, "qwen3": 32}  # qwen3: explicit head_dim != hidden / heads (as Qwen3 allows)
TEXT_INTERMEDIATE = 128
TEXT_ROPE_THETA = 1_000_000.0
TEXT_MAX_POS = 4096
TEXT_RMS_EPS = 1e-6
VISION_HIDDEN = 48
VISION_HEADS = 3
VISION_INTERMEDIATE = 96
VISION_LN_EPS = 1e-6
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

# q/k are drawn at fixtures.QK_GAIN above unit gain so attention is selective and greedy generation does not
# collapse into repeating one token; Qwen3's per-head q/k norms undo that, so their weights get this gain instead
QK_NORM_GAIN = 2.5


def image_seq_len_for(image_size: int, patch_size: int, downsample_ratio: float) -> int:
    """Tokens per tile: (image_size / patch)^2 * downsample_ratio^2 (InternVLChatModel.num_image_token)."""
    return int((image_size // patch_size) ** 2 * downsample_ratio**2)


def _vision_rule(leaf: str, p, g) -> bool:
    """InternViT's parameters whose default init is 0 or 1 (fixtures.redraw_weights' special rule):

    * vision ``cls_token`` N(0, 1), ``position_embeddings`` N(0, 0.5^2).
    * vision layer scale ``lambda_1`` / ``lambda_2``: U(0.25, 1.0) per channel -- non-zero and not
      constant, so a runtime that drops or mis-broadcasts them is caught.
    The rest as fixtures.redraw_weights draws it, with 1-D biases at 0.1 N(0,1) (Qwen2 q/k/v biases included),
    Qwen3's q/k norm weights at QK_NORM_GAIN, and the ``<IMG_CONTEXT>`` row of lm_head zeroed.
    """
    import torch

    if leaf == "cls_token":
        p.copy_(torch.randn(p.shape, generator=g))
    elif leaf == "position_embeddings":
        p.copy_(0.5 * torch.randn(p.shape, generator=g))
    elif leaf in ("lambda_1", "lambda_2"):
        p.copy_(0.25 + 0.75 * torch.rand(p.shape, generator=g))
    else:
        return False
    return True


def _redraw_weights(model, seed: int, gain: float, image_token_id: int) -> None:
    redraw_weights(model, seed, gain, image_token_id, bias_std=0.1, qk_norm_gain=QK_NORM_GAIN, special=_vision_rule)


def write_processor_files(
    out_dir: Path,
    *,
    image_size: int = 28,
    patch_size: int = 7,
    downsample_ratio: float = 0.5,
    min_tiles: int = 1,
    max_tiles: int = 6,
) -> None:
    """preprocessor_config.json (GotOcr2 image processor, as the -hf repos), processor_config.json,
    chat_template.json.

    Note: InternVLProcessor passes ``crop_to_patches=True`` to the image processor by default
    (class attribute ``images_kwargs``), whatever preprocessor_config.json says; it is written
    ``true`` here so the file and the oracle agree. GotOcr2 always appends the thumbnail when a
    grid has more than one tile (there is no use_thumbnail switch).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    preprocessor = {
        "image_processor_type": "GotOcr2ImageProcessorFast",
        "processor_class": "InternVLProcessor",
        "crop_to_patches": True,
        "min_patches": min_tiles,
        "max_patches": max_tiles,
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": image_size, "width": image_size},
        "resample": 3,  # PIL.Image.BICUBIC
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": IMAGENET_MEAN,
        "image_std": IMAGENET_STD,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    processor_cfg = {
        "processor_class": "InternVLProcessor",
        "image_seq_length": image_seq_len_for(image_size, patch_size, downsample_ratio),
    }
    (out_dir / "processor_config.json").write_text(json.dumps(processor_cfg, indent=2) + "\n")
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": HF_CHAT_TEMPLATE}, indent=2) + "\n")


def make_internvl_checkpoint(
    out_dir: Path,
    *,
    decoder: str = "qwen2",
    tie_word_embeddings: bool = False,
    image_size: int = 28,
    patch_size: int = 7,
    downsample_ratio: float = 0.5,
    min_tiles: int = 1,
    max_tiles: int = 6,
    vision_norm: str = "layer_norm",
    layer_scale: float = 0.1,
    use_thumbnail: bool = True,
    text_layers: int = 2,
    vision_layers: int = 2,
    seed: int = 0,
    gain: float = 1.0,
    real_qwen3_tokenizer: bool = False,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
) -> Path:
    """Write a tiny random InternVL checkpoint (-hf hub layout) into ``out_dir`` and return it.

    decoder="qwen2": InternVL3-1B shape (Qwen2.5: q/k/v biases, head_dim = hidden / heads = 16).
    decoder="qwen3": InternVL3.5-1B shape (Qwen3: q_norm / k_norm, no biases, explicit head_dim 32).
    vision_norm: InternViT ``norm_type`` ("layer_norm" for InternViT-300M, "rms_norm" for 6B).
    layer_scale: ``layer_scale_init_value`` written to the config (the lambda vectors themselves are
    re-drawn random, see :func:`_redraw_weights`). use_thumbnail must be True: it is what
    InternVL3/3.5 use and the only behaviour of the GotOcr2 image processor.
    text_overrides / vision_overrides replace entries of the text / vision config (a vocab_size
    larger than the tokenizer is allowed).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.internvl import InternVLConfig, InternVLForConditionalGeneration

    if decoder not in ("qwen2", "qwen3"):
        raise ValueError(f"decoder must be 'qwen2' or 'qwen3', got {decoder!r}")
    if vision_norm not in ("layer_norm", "rms_norm"):
        raise ValueError(f"vision_norm must be 'layer_norm' or 'rms_norm', got {vision_norm!r}")
    if not use_thumbnail:
        raise ValueError("the GotOcr2 image processor always appends a thumbnail (use_thumbnail=True)")
    if image_size % patch_size:
        raise ValueError("image_size must be a multiple of patch_size")
    side = image_size // patch_size
    scale = round(1 / downsample_ratio)
    if abs(scale * downsample_ratio - 1) > 1e-9 or side % scale:
        raise ValueError("patches per side must be a multiple of 1 / downsample_ratio")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_internvl_tokenizer(out_dir, real_qwen3=real_qwen3_tokenizer)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    vocab_size = len(tok)
    c = tok.convert_tokens_to_ids
    eos_id, pad_id, image_id = c(IM_END), c(ENDOFTEXT), c(IMG_CONTEXT)

    text_config = dict(
        model_type=decoder,
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_INTERMEDIATE,
        num_hidden_layers=text_layers,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_KV_HEADS,
        hidden_act="silu",
        max_position_embeddings=TEXT_MAX_POS,
        rms_norm_eps=TEXT_RMS_EPS,
        rope_theta=TEXT_ROPE_THETA,
        use_sliding_window=False,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if decoder == "qwen3":
        text_config.update(head_dim=TEXT_HEAD_DIM["qwen3"], attention_bias=False)
    text_config.update(text_overrides or {})
    vision_config = dict(
        model_type="internvl_vision",
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=vision_layers,
        num_attention_heads=VISION_HEADS,
        num_channels=3,
        image_size=[image_size, image_size],
        patch_size=[patch_size, patch_size],
        hidden_act="gelu",
        norm_type=vision_norm,
        layer_norm_eps=VISION_LN_EPS,
        attention_bias=True,  # InternViT-300M: qkv_bias=True
        use_qk_norm=False,  # InternViT-300M: qk_normalization=False
        use_mean_pooling=True,  # -> no final vision layernorm (InternViT has none)
        use_absolute_position_embeddings=True,
        use_mask_token=False,
        layer_scale_init_value=layer_scale,
        attention_dropout=0.0,
        projection_dropout=0.0,
        hidden_dropout_prob=0.0,
    )
    vision_config.update(vision_overrides or {})
    config = InternVLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=image_id,
        image_seq_length=image_seq_len_for(image_size, patch_size, downsample_ratio),
        downsample_ratio=downsample_ratio,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )
    config.architectures = ["InternVLForConditionalGeneration"]

    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    _redraw_weights(model, seed, gain, image_id)
    emb = model.model.language_model.embed_tokens.weight
    if tie_word_embeddings:
        assert model.lm_head.weight is emb, "lm_head should be tied to embed_tokens"
    else:
        assert model.lm_head.weight is not emb
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained also writes a generation_config.json; overwrite it with ours.
    GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False).save_pretrained(
        out_dir
    )
    write_processor_files(
        out_dir,
        image_size=image_size,
        patch_size=patch_size,
        downsample_ratio=downsample_ratio,
        min_tiles=min_tiles,
        max_tiles=max_tiles,
    )
    return out_dir


# ---------------------------------------------------------------------------
# Original OpenGVLab layout
# ---------------------------------------------------------------------------


def _hf_to_original_key(key: str) -> str:
    """One -hf tensor name -> its original InternVLChatModel name (vision q/k/v are fused by the caller).

    Accepts both the on-disk names (transformers 5 save_pretrained writes the legacy llava-style
    ``vision_tower.*`` / ``multi_modal_projector.*`` / ``language_model.model.*`` /
    ``language_model.lm_head.weight``, as the real -hf repos have) and the in-memory module names
    (``model.vision_tower.*``, ``model.language_model.*``, ``lm_head.weight``).
    """
    if key in ("lm_head.weight", "language_model.lm_head.weight"):
        return "language_model.lm_head.weight"
    for prefix in ("model.language_model.", "language_model.model."):
        if key.startswith(prefix):
            return "language_model.model." + key[len(prefix) :]
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            for hf, orig in (("layer_norm.", "mlp1.0."), ("linear_1.", "mlp1.1."), ("linear_2.", "mlp1.3.")):
                if rest.startswith(hf):
                    return orig + rest[len(hf) :]
            raise KeyError(key)
    for prefix in ("model.vision_tower.", "vision_tower."):
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        emb = {
            "embeddings.cls_token": "embeddings.class_embedding",
            "embeddings.position_embeddings": "embeddings.position_embedding",
            "embeddings.patch_embeddings.projection.weight": "embeddings.patch_embedding.weight",
            "embeddings.patch_embeddings.projection.bias": "embeddings.patch_embedding.bias",
        }
        if rest in emb:
            return "vision_model." + emb[rest]
        if rest.startswith("encoder.layer."):
            idx, sub = rest[len("encoder.layer.") :].split(".", 1)
            if sub == "lambda_1":
                return f"vision_model.encoder.layers.{idx}.ls1"
            if sub == "lambda_2":
                return f"vision_model.encoder.layers.{idx}.ls2"
            layer = {
                "attention.projection_layer.": "attn.proj.",
                "attention.q_norm.": "attn.q_norm.",
                "attention.k_norm.": "attn.k_norm.",
                "layernorm_before.": "norm1.",
                "layernorm_after.": "norm2.",
                "mlp.fc1.": "mlp.fc1.",
                "mlp.fc2.": "mlp.fc2.",
            }
            for hf, orig in layer.items():
                if sub.startswith(hf):
                    return f"vision_model.encoder.layers.{idx}.{orig}{sub[len(hf) :]}"
        raise KeyError(key)
    raise KeyError(key)


def to_original_layout(hf_ckpt: Path, out_dir: Path) -> Path:
    """Rewrite a -hf checkpoint (from :func:`make_internvl_checkpoint`) in the ORIGINAL OpenGVLab layout.

    The inverse of transformers' ``convert_internvl_weights_to_hf.py`` (ORIGINAL_TO_CONVERTED_KEY_MAPPING_*
    and the ``attn.qkv`` split ``q = qkv[:dim], k = qkv[dim:2*dim], v = qkv[-dim:]``)::

        -hf model.safetensors (as saved by transformers 5.24)   original (InternVLChatModel)
        V = vision_tower.,  E = V + "encoder.layer.{i}."          O = vision_model.encoder.layers.{i}.
        -----------------------------------------------------   -------------------------------------------------
        V embeddings.cls_token                  [1,1,D]         vision_model.embeddings.class_embedding   [1,1,D]
        V embeddings.position_embeddings        [1,N+1,D]       vision_model.embeddings.position_embedding [1,N+1,D]
        V embeddings.patch_embeddings.projection.weight/bias    vision_model.embeddings.patch_embedding.weight/bias
        E attention.{q,k,v}_proj.weight  [D,D]  (x3)            O attn.qkv.weight  [3D,D] = cat([q, k, v], dim=0)
        E attention.{q,k,v}_proj.bias    [D]    (x3)            O attn.qkv.bias    [3D]   = cat([q, k, v], dim=0)
              rows [0,D) q, [D,2D) k, [2D,3D) v, each head-major; no permutation (the original reshapes
              qkv(x) to (B, N, 3, heads, head_dim))
        E attention.projection_layer.*                          O attn.proj.*
        E attention.{q,k}_norm.weight (use_qk_norm only)        O attn.{q,k}_norm.weight
        E lambda_1 / lambda_2                   [D]             O ls1 / ls2   [D]
        E layernorm_before.* / layernorm_after.*                O norm1.* / norm2.*
        E mlp.fc1.* / mlp.fc2.*                                 O mlp.fc1.* / mlp.fc2.*
        multi_modal_projector.layer_norm.*      [4D]            mlp1.0.*  nn.LayerNorm(4D), eps 1e-5 in both
        multi_modal_projector.linear_1.*        [H,4D]          mlp1.1.*
        (projector_hidden_act "gelu")                           mlp1.2    nn.GELU() (exact erf), no weights
        multi_modal_projector.linear_2.*        [H,H]           mlp1.3.*
        language_model.model.*                                  language_model.model.*  (unchanged)
        language_model.lm_head.weight                           language_model.lm_head.weight (both absent if tied)

    (In memory the -hf names carry ``model.`` -- ``model.vision_tower.*``, ``model.language_model.*``
    without the inner ``.model``, ``lm_head.weight`` -- transformers' "llava" conversion mapping renames
    on load / save; both spellings are accepted.)

    Config: InternVLVisionConfig -> InternVisionConfig (attention_bias -> qkv_bias, use_qk_norm ->
    qk_normalization, layer_scale_init_value -> initializer_factor, attention_dropout, projection_dropout
    -> dropout; image_size / patch_size as ints), text_config -> llm_config (with ``architectures``,
    ``rope_theta`` at top level), plus downsample_ratio, template "internvl2_5", select_layer -1,
    ps_version "v2", force_image_size, min/max_dynamic_patch, use_thumbnail, dynamic_image_size.
    Tokenizer files are copied (chat_template replaced by ORIGINAL_CHAT_TEMPLATES[decoder]); a
    CLIP-style preprocessor_config.json and the generation_config.json are written too. No
    ``auto_map`` / remote-code .py files are written.
    """
    import torch
    from safetensors.torch import load_file, save_file

    hf_ckpt, out_dir = Path(hf_ckpt), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf_ckpt / "config.json").read_text())
    vc, tc = cfg["vision_config"], cfg["text_config"]
    if not vc.get("use_mean_pooling", True):
        raise ValueError("use_mean_pooling=False adds a final vision layernorm the original InternViT does not have")
    if cfg.get("vision_feature_select_strategy", "default") != "default":
        raise ValueError("the original model always drops the class token ('default' strategy)")

    sd = load_file(str(hf_ckpt / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        if "vision_tower." in key and any(f".attention.{w}_proj." in key for w in "qkv"):
            # vision_tower.encoder.layer.{i}.attention.{q,k,v}_proj.{weight,bias}
            idx = key.split("encoder.layer.", 1)[1].split(".", 1)[0]
            which, leaf = key.rsplit(".", 2)[1:]
            qkv.setdefault(f"vision_model.encoder.layers.{idx}.attn.qkv.{leaf}", {})[which[0]] = t
            continue
        out[_hf_to_original_key(key)] = t.contiguous()
    for key, parts in qkv.items():
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0).contiguous()
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    def _int(x):
        return int(x[0]) if isinstance(x, (list, tuple)) else int(x)

    image_size, patch_size = _int(vc["image_size"]), _int(vc["patch_size"])
    vision_config = {
        "architectures": ["InternVisionModel"],
        "model_type": "intern_vit_6b",
        "num_channels": vc.get("num_channels", 3),
        "patch_size": patch_size,
        "image_size": image_size,
        "qkv_bias": vc["attention_bias"],
        "hidden_size": vc["hidden_size"],
        "num_attention_heads": vc["num_attention_heads"],
        "intermediate_size": vc["intermediate_size"],
        "qk_normalization": vc["use_qk_norm"],
        "num_hidden_layers": vc["num_hidden_layers"],
        "use_flash_attn": False,
        "hidden_act": vc["hidden_act"],
        "norm_type": vc["norm_type"],
        "layer_norm_eps": vc["layer_norm_eps"],
        "dropout": vc.get("projection_dropout", 0.0),
        "drop_path_rate": 0.0,
        "attention_dropout": vc.get("attention_dropout", 0.0),
        "initializer_range": vc.get("initializer_range", 0.02),
        "initializer_factor": vc.get("layer_scale_init_value", 0.1),
    }
    decoder = tc["model_type"]
    llm_keys = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
        "rms_norm_eps", "use_cache", "tie_word_embeddings", "use_sliding_window", "sliding_window",
        "max_window_layers", "attention_dropout", "attention_bias", "bos_token_id", "eos_token_id",
        "pad_token_id", "layer_types",
    ]  # fmt: skip
    llm_config = {k: tc[k] for k in llm_keys if k in tc}
    rope = tc.get("rope_parameters") or {}
    llm_config["rope_theta"] = rope.get("rope_theta", tc.get("rope_theta"))
    llm_config["rope_scaling"] = None
    llm_config["architectures"] = ["Qwen2ForCausalLM" if decoder == "qwen2" else "Qwen3ForCausalLM"]
    llm_config["model_type"] = decoder
    llm_config["torch_dtype"] = "float32"
    pre = json.loads((hf_ckpt / "preprocessor_config.json").read_text())
    tie = bool(cfg.get("tie_word_embeddings", tc.get("tie_word_embeddings", False)))
    llm_config["tie_word_embeddings"] = tie
    orig_cfg = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "vision_config": vision_config,
        "llm_config": llm_config,
        "downsample_ratio": cfg["downsample_ratio"],
        "template": "internvl2_5",
        "select_layer": cfg.get("vision_feature_layer", -1),
        "ps_version": "v2",
        "force_image_size": image_size,
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "min_dynamic_patch": pre.get("min_patches", 1),
        "max_dynamic_patch": pre.get("max_patches", 12),
        "pad2square": False,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(orig_cfg, indent=2) + "\n")

    for name in ("tokenizer.json", "special_tokens_map.json", "generation_config.json"):
        if (hf_ckpt / name).exists():
            shutil.copy(hf_ckpt / name, out_dir / name)
    tok_cfg = json.loads((hf_ckpt / "tokenizer_config.json").read_text())
    for k in list(INTERNVL_TOKENIZER_ATTRS) + ["extra_special_tokens"]:
        tok_cfg.pop(k, None)
    tok_cfg["chat_template"] = ORIGINAL_CHAT_TEMPLATES[decoder]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    # The original repos ship a CLIP-style preprocessor_config (the tiling is done by model-card code).
    orig_pre = {
        "crop_size": image_size,
        "do_center_crop": True,
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": pre["image_mean"],
        "image_std": pre["image_std"],
        "resample": pre.get("resample", 3),
        "size": image_size,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(orig_pre, indent=2) + "\n")
    return out_dir


# ---------------------------------------------------------------------------
# transformers oracle
# ---------------------------------------------------------------------------


INTERNVL = OracleFamily(
    model="transformers.models.internvl:InternVLForConditionalGeneration",
    processor="transformers.models.internvl.processing_internvl:InternVLProcessor",
    image_processor="transformers.models.got_ocr2.image_processing_pil_got_ocr2:GotOcr2ImageProcessorPil",
    seq_len_key="image_seq_length", nested_images=False, pixel_batch_dim=False,
)
load_hf_model = partial(oracle.load_model, INTERNVL)  # (ckpt) -> InternVLForConditionalGeneration, fp32
hf_processor = partial(oracle.processor, INTERNVL)  # (ckpt) -> InternVLProcessor, no video processor
hf_generate = partial(oracle.generate, INTERNVL)  # (ckpt, image, prompt, n) -> (prompt ids, pixels [tiles, ...], ids)
