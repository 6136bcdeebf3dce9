"""Tiny random SmolVLM checkpoints in the Hugging Face hub layout, for tests.

Plain functions (no pytest fixtures here) so that tests, benchmarks and scripts can
all build the same checkpoints:

* :func:`make_tokenizer` -- a real byte-level BPE tokenizer (trained in a few ms on a
  built-in English corpus) with the SmolVLM special tokens.
* :func:`make_smolvlm_checkpoint` -- ``config.json``, ``model.safetensors``, tokenizer,
  ``preprocessor_config.json``, ``processor_config.json``, ``chat_template.json`` and
  ``generation_config.json``, with weights re-drawn at unit gain so logits are far
  from flat.
* :func:`load_hf_model`, :func:`hf_processor`, :func:`hf_generate` -- the transformers
  oracle (fp32, eval, greedy) that the vlmrt runtime is compared against.

transformers / torch are imported lazily inside the functions: importing this module
costs nothing. torchvision is never imported (the PIL image processor is used and the
processor is built with ``video_processor=None``).
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import oracle
from oracle import OracleFamily

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_UTTERANCE = "<end_of_utterance>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
IMAGE_TOKEN = "<image>"
MAX_GRID = 6

SPECIAL_TOKENS: list[str] = [
    ENDOFTEXT,
    IM_START,
    IM_END,
    END_OF_UTTERANCE,
    FAKE_IMAGE_TOKEN,
    GLOBAL_IMAGE_TOKEN,
    IMAGE_TOKEN,
] + [f"<row_{r}_col_{c}>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)]

BPE_VOCAB_SIZE = 480  # 256 byte symbols + 3 trainer specials + ~221 merges; + 40 added tokens -> 520

_COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "brown", "gray", "pink"]
_SHAPES = ["circle", "square", "triangle", "rectangle", "star", "line", "box", "ball"]
_THINGS = ["cat", "dog", "cup", "coffee", "rocket", "person", "page", "camera", "tree", "car", "house", "bird"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "no"]
_POSITIONS = ["left", "right", "top", "bottom", "middle", "center", "corner", "background", "front"]
_TEMPLATES = [
    "What colour is the {shape}?",
    "What color is the {thing} in the image?",
    "Is there a {colour} {shape} in the picture?",
    "How many {shape}s are there?",
    "How many {thing}s can you see in this image?",
    "There are {number} {colour} {shape}s on the {position}.",
    "The {thing} is {colour} and sits in the {position}.",
    "Describe the image in detail.",
    "Can you describe this picture?",
    "What shape is in the {position} of the image?",
    "The image shows a {colour} {thing} next to a {shape}.",
    "Yes, there is a {colour} {shape} at the {position}.",
    "No, I do not see a {thing} here.",
    "Count the {colour} objects: there are {number}.",
    "Where is the {thing}? It is at the {position}.",
    "This is a photo of a {thing} with a {colour} {shape}.",
    "Answer briefly: what is the main object?",
    "The answer is {number}.",
    "Which {shape} is bigger, the {colour} one or the other one?",
    "Read the text on the {thing}, please.",
]


def _corpus() -> list[str]:
    """A few hundred deterministic English sentences about images, colours, shapes and counting."""
    lines = []
    n = 0
    for i, template in enumerate(_TEMPLATES):
        for j in range(18):
            n += 1
            lines.append(
                template.format(
                    colour=_COLOURS[(i * 3 + j) % len(_COLOURS)],
                    shape=_SHAPES[(i + j * 5) % len(_SHAPES)],
                    thing=_THINGS[(i * 7 + j) % len(_THINGS)],
                    number=_NUMBERS[(i + j * 3) % len(_NUMBERS)],
                    position=_POSITIONS[(i * 2 + j * 7) % len(_POSITIONS)],
                )
            )
    lines += [
        "User: What is in this image?\nAssistant: A cat lying on a red blanket.",
        "User: How many circles are there?\nAssistant: There are three circles.",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 100 2024.",
        "Punctuation, quotes \"like this\", colons: and (brackets) - dashes!",
    ]
    return lines


def make_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``) to ``out_dir``.

    Byte-level BPE (no normalizer, ByteLevel pre-tokenizer/decoder, no post-processor, so no
    BOS is added -- the chat template starts with ``<|im_start|>`` like real SmolVLM).
    Ids: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>``, then the 256 byte symbols
    and the merges, then the remaining special tokens appended in ``SPECIAL_TOKENS`` order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS[:3],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    for t in SPECIAL_TOKENS:
        assert tok.token_to_id(t) is not None, t
    tok.save(str(out_dir / "tokenizer.json"))

    added_tokens_decoder = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": IM_START,
        "eos_token": END_OF_UTTERANCE,
        "pad_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        # As in the real SmolVLM tokenizer_config.json: top-level "*_token" keys. transformers 5
        # turns unknown "*_token" keys into model-specific special tokens, so
        # getattr(tokenizer, "image_token") works (SmolVLMProcessor reads them that way).
        "fake_image_token": FAKE_IMAGE_TOKEN,
        "image_token": IMAGE_TOKEN,
        "end_of_utterance_token": END_OF_UTTERANCE,
        "global_image_token": GLOBAL_IMAGE_TOKEN,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS[3:]],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "padding_side": "left",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": IM_START,
        "eos_token": END_OF_UTTERANCE,
        "pad_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS[3:]],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


# ---------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------

TEXT_HIDDEN = 64
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
TEXT_INTERMEDIATE = 128
TEXT_ROPE_THETA = 100000.0
TEXT_MAX_POS = 2048
VISION_HIDDEN = 48
VISION_HEADS = 3
VISION_INTERMEDIATE = 96


def image_seq_len_for(tile_size: int, patch_size: int, scale_factor: int) -> int:
    return (tile_size // patch_size) ** 2 // scale_factor**2


# q_proj/k_proj are drawn this much larger than unit gain: attention logits get std ~4, so
# attention is selective. At plain unit gain, attention over a long image prompt is close to
# a uniform average, the decode hidden state barely depends on the current token, and greedy
# generation collapses into repeating one token (seen for 4/8 seeds with an image).
QK_GAIN = 2.0


def redraw_weights(model, seed: int, gain: float, image_token_id: int, *, bias_std: float = 0.05,
                   qk_norm_gain: float = 1.0, special=None) -> None:
    """Re-draw every parameter so activations/logits have O(1) scale (default init is ~flat); both families'
    fixtures (fixtures_internvl.py passes its own rules).

    special(leaf, p, g) -> bool: a family's own rule for a parameter, tried first (True: drawn there).
    >=2-D (Linear, Embedding, Conv): N(0, gain/sqrt(fan_in)), fan_in = prod(shape[1:])
    (x QK_GAIN for q_proj/k_proj).  1-D "weight" (LayerNorm / RMSNorm): 1 + 0.1 N(0,1), times qk_norm_gain for
    Qwen3's per-head q_norm / k_norm.  1-D "bias": bias_std N(0,1).  Tied parameters are shared objects and
    named_parameters() yields them once.  Finally the image token's row of lm_head (== of embed_tokens when tied;
    that row is never read as input, image features replace it) is zeroed so it gets logit 0 and is never
    generated: a generated image token would make ``model(prompt + generated, pixel_values)`` fail (more image
    tokens than features).
    """
    import torch

    g = torch.Generator().manual_seed(seed + 12345)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if special is not None and special(leaf, p, g):
                continue
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                f = QK_GAIN if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * (f * gain / math.sqrt(fan_in)))
            elif leaf == "weight" and ("self_attn.q_norm" in name or "self_attn.k_norm" in name):
                # Qwen3 normalizes q and k per head, which undoes QK_GAIN: scale the norm weights
                # instead, or attention stays near-uniform and greedy output collapses
                p.copy_(qk_norm_gain * (1.0 + 0.1 * torch.randn(p.shape, generator=g)))
            elif leaf == "weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(bias_std * torch.randn(p.shape, generator=g))
        model.lm_head.weight[image_token_id].zero_()


def make_smolvlm_checkpoint(
    out_dir: Path,
    *,
    tie_word_embeddings: bool = False,
    do_image_splitting: bool = True,
    tile_size: int = 64,
    patch_size: int = 8,
    scale_factor: int = 2,
    longest_edge_tiles: int = 3,
    text_layers: int = 2,
    vision_layers: int = 2,
    seed: int = 0,
    gain: float = 1.0,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    video_sampling: dict | None = None,
) -> Path:
    """Write a tiny random SmolVLM checkpoint (hub layout) into ``out_dir`` and return it.

    video_sampling: SmolVLM2's video processor settings (video_preprocessor_config.json); default fps 1, at most 4
    frames, the longest edge to 2 tiles first (SmolVLM2 releases: fps 1, 64 frames, 512 = the tile).

    text_overrides / vision_overrides replace entries of the text / vision config (e.g. the real
    SmolVLM-256M sizes for benchmarks; a vocab_size larger than the tokenizer is allowed)."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.smolvlm import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    if tile_size % patch_size:
        raise ValueError("tile_size must be a multiple of patch_size")
    if (tile_size // patch_size) % scale_factor:
        raise ValueError("patches per side must be a multiple of scale_factor")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out_dir)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))
    vocab_size = len(tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    bos_id, eos_id, pad_id = ids[IM_START], ids[END_OF_UTTERANCE], ids[ENDOFTEXT]

    text_config = dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_INTERMEDIATE,
        num_hidden_layers=text_layers,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_KV_HEADS,
        head_dim=TEXT_HIDDEN // TEXT_HEADS,
        hidden_act="silu",
        max_position_embeddings=TEXT_MAX_POS,
        rms_norm_eps=1e-5,
        rope_theta=TEXT_ROPE_THETA,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    text_config.update(text_overrides or {})
    vision_config = dict(
        model_type="smolvlm_vision",
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=vision_layers,
        num_attention_heads=VISION_HEADS,
        num_channels=3,
        image_size=tile_size,
        patch_size=patch_size,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    )
    vision_config.update(vision_overrides or {})
    config = SmolVLMConfig(
        text_config=text_config,
        vision_config=vision_config,
        scale_factor=scale_factor,
        image_token_id=ids[IMAGE_TOKEN],
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    config.architectures = ["SmolVLMForConditionalGeneration"]

    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration(config)
    redraw_weights(model, seed, gain, ids[IMAGE_TOKEN])
    emb = model.model.text_model.embed_tokens.weight
    if tie_word_embeddings:
        assert model.lm_head.weight is emb, "lm_head should be tied to embed_tokens"
    else:
        assert model.lm_head.weight is not emb
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained also writes a generation_config.json; overwrite it with ours.
    GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        do_sample=False,
    ).save_pretrained(out_dir)

    image_seq_len = image_seq_len_for(tile_size, patch_size, scale_factor)
    preprocessor = {
        "image_processor_type": "SmolVLMImageProcessor",
        "processor_class": "SmolVLMProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": longest_edge_tiles * tile_size},
        "max_image_size": {"longest_edge": tile_size},
        "resample": 1,  # PIL.Image.LANCZOS
        "do_image_splitting": do_image_splitting,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    processor_cfg = {"processor_class": "SmolVLMProcessor", "image_seq_len": image_seq_len}
    (out_dir / "processor_config.json").write_text(json.dumps(processor_cfg, indent=2) + "\n")
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": DEFAULT_CHAT_TEMPLATE}, indent=2) + "\n")
    video = {
        "video_processor_type": "SmolVLMVideoProcessor",
        "processor_class": "SmolVLMProcessor",
        "video_sampling": video_sampling or {"fps": 1, "max_frames": 4, "video_size": {"longest_edge": 2 * tile_size}},
        "max_image_size": {"longest_edge": tile_size},
        "resample": 1,  # LANCZOS
        "do_sample_frames": True,
        **{k: preprocessor[k] for k in ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")},
    }
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out_dir


# ---------------------------------------------------------------------------
# transformers oracle
# ---------------------------------------------------------------------------


SMOLVLM = OracleFamily(
    model="transformers.models.smolvlm:SmolVLMForConditionalGeneration",
    processor="transformers.models.smolvlm.processing_smolvlm:SmolVLMProcessor",
    image_processor="transformers.models.smolvlm.image_processing_pil_smolvlm:SmolVLMImageProcessorPil",
    seq_len_key="image_seq_len", nested_images=True, pixel_batch_dim=True, mixin_chat_template=True,
    video_processor="transformers.models.smolvlm.video_processing_smolvlm:SmolVLMVideoProcessor",
)
load_hf_model = partial(oracle.load_model, SMOLVLM)  # (ckpt) -> SmolVLMForConditionalGeneration, fp32
hf_processor = partial(oracle.processor, SMOLVLM)  # (ckpt) -> SmolVLMProcessor, no video processor
hf_generate = partial(oracle.generate, SMOLVLM)  # (ckpt, image, prompt, n) -> (prompt ids, pixels [1, tiles, ...], ids)
