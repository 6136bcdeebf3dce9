"""Tiny random LFM2-VL checkpoints (SigLIP2 NaFlex + pixel-unshuffle projector + LFM2 hybrid conv/attention decoder),
for tests. Same style as tests/fixtures.py: plain functions, torch / transformers imported inside them.

* :func:`make_lfm2_vl_tokenizer` -- a tiny byte-level BPE with LFM2-VL's special tokens (``<|startoftext|>``,
  ``<|im_start|>`` / ``<|im_end|>``, ``<image>``, ``<|image_start|>`` / ``<|image_end|>``, ``<|img_thumbnail|>``,
  ``<|img_row_R_col_C|>`` for R, C up to ``MAX_GRID``).
* :func:`make_lfm2_vl_checkpoint` -- ``Lfm2VlForConditionalGeneration`` in the hub layout (config.json,
  model.safetensors, tokenizer, preprocessor_config.json for ``Lfm2VlImageProcessor``, chat_template.json,
  generation_config.json), weights re-drawn at unit gain as tests/fixtures.py does, with any ``layer_types``.
* :func:`hf_model`, :func:`hf_processor`, :func:`hf_generate` -- transformers as the oracle (fp32, eager, greedy;
  the torchvision image processor, tests/torchvision_ops.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PAD = "<|pad|>"
BOS = "<|startoftext|>"
EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
IMAGE = "<image>"
IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"
THUMBNAIL = "<|img_thumbnail|>"
MAX_GRID = 10  # max_tiles is at most 10 in LFM2-VL's processor: any R×C grid has R, C <= 10
SPECIAL_TOKENS = [PAD, BOS, EOT, IM_START, IM_END, IMAGE, IMAGE_START, IMAGE_END, THUMBNAIL] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1)]

# LFM2-VL's chat template (reconstructed from the hub repos' chat_template.jinja, not copied: BOS first, an optional
# system turn, content parts joined with an image item as "<image>", "<|im_start|>assistant\n" as generation prompt)
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

TEXT_HIDDEN = 64
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
VISION_HIDDEN = 48
VISION_HEADS = 3
VISION_INTERMEDIATE = 96
QK_GAIN = 2.0  # as tests/fixtures.py: selective attention, so greedy answers do not collapse


def make_lfm2_vl_tokenizer(out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json: byte-level BPE trained on tests/fixtures.py's corpus, no BOS added
    by the tokenizer (the chat template writes it), then SPECIAL_TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fixtures import BPE_VOCAB_SIZE, _corpus

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS[:5], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(out_dir / "tokenizer.json"))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, **entry} for t in SPECIAL_TOKENS},
        "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD,
        "image_token": IMAGE, "image_start_token": IMAGE_START, "image_end_token": IMAGE_END,
        "image_thumbnail_token": THUMBNAIL,
        "additional_special_tokens": SPECIAL_TOKENS[5:],
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def _redraw(model, seed: int, image_token_id: int) -> None:
    """Every parameter re-drawn at unit gain (tests/fixtures.py _redraw_weights): >= 2-D N(0, 1/sqrt(fan_in))
    (q/k projections × QK_GAIN), norm weights 1 + 0.1 N, biases 0.05 N; the <image> row of the (tied) head zeroed.
    The depthwise conv weights [hidden, 1, L] have fan_in L."""
    import torch

    g = torch.Generator().manual_seed(seed + 4242)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                f = QK_GAIN if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * (f / math.sqrt(fan_in)))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        model.lm_head.weight[image_token_id].zero_()


def make_lfm2_vl_checkpoint(
    out_dir: Path,
    *,
    layer_types: tuple[str, ...] = ("conv", "full_attention", "conv", "conv"),
    tie_word_embeddings: bool = True,
    tile_size: int = 64,
    patch_size: int = 8,
    min_image_tokens: int = 4,
    max_image_tokens: int = 16,
    max_tiles: int = 6,
    vision_layers: int = 2,
    position_side: int = 8,
    conv_bias: bool = False,
    projector_layernorm: bool = True,
    intermediate: int = 128,
    auto_adjust_ff: bool = False,
    seed: int = 0,
    projector_hidden: int = 96,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
) -> Path:
    """A tiny random LFM2-VL checkpoint (hub layout) in out_dir. position_side: the side of SigLIP2's learned
    position table (num_patches = side²), resized to each image's patch grid."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.lfm2_vl import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_lfm2_vl_tokenizer(out_dir)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        model_type="lfm2", vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=intermediate,
        num_hidden_layers=len(layer_types), num_attention_heads=TEXT_HEADS, num_key_value_heads=TEXT_KV_HEADS,
        max_position_embeddings=4096, norm_eps=1e-5, conv_bias=conv_bias, conv_L_cache=3,
        block_auto_adjust_ff_dim=auto_adjust_ff, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
        layer_types=list(layer_types), rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=tie_word_embeddings, bos_token_id=ids[BOS], eos_token_id=ids[IM_END], pad_token_id=ids[PAD],
    )
    text.update(text_overrides or {})
    vision = dict(
        model_type="siglip2_vision_model", hidden_size=VISION_HIDDEN, intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=vision_layers, num_attention_heads=VISION_HEADS, num_channels=3, patch_size=patch_size,
        num_patches=position_side**2, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False,
    )
    vision.update(vision_overrides or {})
    config = Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=ids[IMAGE], projector_hidden_size=projector_hidden,
                          projector_bias=True, projector_use_layernorm=projector_layernorm, downsample_factor=2,
                          projector_hidden_act="gelu", tie_word_embeddings=tie_word_embeddings)
    config.architectures = ["Lfm2VlForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Lfm2VlForConditionalGeneration(config)
    _redraw(model, seed, ids[IMAGE])
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[IM_END], pad_token_id=ids[PAD],
                     do_sample=False).save_pretrained(out_dir)
    preprocessor = {
        "image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor",
        "downsample_factor": 2, "do_image_splitting": True, "min_tiles": 2, "max_tiles": max_tiles,
        "use_thumbnail": True, "min_image_tokens": min_image_tokens, "max_image_tokens": max_image_tokens,
        "encoder_patch_size": patch_size, "tile_size": tile_size, "max_pixels_tolerance": 2.0,
        "do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True,
        "max_num_patches": max(max_image_tokens * 4, (tile_size // patch_size) ** 2),
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1) + "\n")
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}) + "\n")
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}) + "\n")
    return out_dir


def image_spec(pre: dict):
    """The manifest ImageSpec of the naflex_tiles op for Lfm2VlImageProcessor settings (preprocessor_config.json's
    keys), as the lfm2_vl family writes it."""
    from vlmrt.format.manifest import ImageSpec

    f, patch = pre["downsample_factor"], pre["encoder_patch_size"]
    split = pre.get("do_image_splitting", True)
    max_patches = max(pre["max_image_tokens"] * f * f, (pre["tile_size"] // patch) ** 2 if split else 0)
    params = {k: pre[k] for k in ("downsample_factor", "min_tiles", "max_tiles", "use_thumbnail", "min_image_tokens",
                                  "max_image_tokens", "max_pixels_tolerance")}
    return ImageSpec(tiling="naflex_tiles", tile_size=pre["tile_size"], patch_size=patch, resample="bilinear",
                     rescale_factor=pre.get("rescale_factor", 1 / 255), mean=pre.get("image_mean", [0.5] * 3),
                     std=pre.get("image_std", [0.5] * 3), params={**params, "split": split, "max_num_patches": max_patches})


# ---------------------------------------------------------------------------
# transformers oracle
# ---------------------------------------------------------------------------


def hf_model(ckpt: Path):
    import torch
    from transformers.models.lfm2_vl import Lfm2VlForConditionalGeneration

    return Lfm2VlForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32,
                                                          attn_implementation="eager").eval()


def hf_processor(ckpt: Path):
    """Lfm2VlProcessor over the torchvision Lfm2VlImageProcessor (the only one transformers has) and the tokenizer."""
    from transformers import AutoTokenizer
    from transformers.models.lfm2_vl import Lfm2VlProcessor
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    from oracle import settings, without_types

    pre, own = settings(ckpt)  # (either layout, as transformers reads it)
    pre = {k: v for k, v in without_types(pre).items() if k != "max_num_patches"}
    return Lfm2VlProcessor(image_processor=Lfm2VlImageProcessor(**pre), tokenizer=AutoTokenizer.from_pretrained(str(ckpt)),
                           chat_template=own["chat_template"])


def hf_inputs(processor, images: list, prompt: str):
    """The processor's tensors for one user turn: the images (PIL), then the text."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return processor(text=[text], images=[images] if images else None, return_tensors="pt")


def hf_generate(model, processor, images: list, prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new ids) from transformers' generate, EOS ignored (exactly max_new_tokens)."""
    import copy

    import torch

    inputs = hf_inputs(processor, images, prompt)
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=cfg, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def model_pixels(tiles) -> dict:
    """Lfm2VlForConditionalGeneration's image keywords from vlmrt's naflex_tiles (oracle.OracleFamily.model_pixels):
    the padded patch rows, their grids, the mask of the real rows."""
    import numpy as np
    import torch

    n = tiles.patch_grids.prod(1)
    mask = np.arange(tiles.pixels.shape[1])[None] < n[:, None]
    return {"pixel_values": torch.from_numpy(tiles.pixels), "spatial_shapes": torch.from_numpy(tiles.patch_grids),
            "pixel_attention_mask": torch.from_numpy(mask)}


def _oracle():
    from oracle import OracleFamily

    return OracleFamily(
        model="transformers.models.lfm2_vl:Lfm2VlForConditionalGeneration",
        processor="transformers.models.lfm2_vl:Lfm2VlProcessor",
        image_processor="transformers.models.lfm2_vl.image_processing_lfm2_vl:Lfm2VlImageProcessor",
        seq_len_key="", nested_images=True, pixel_batch_dim=False,
        make_processor="fixtures_lfm2_vl:hf_processor", model_pixels="fixtures_lfm2_vl:model_pixels", rgb=True)


LFM2_VL = _oracle()
