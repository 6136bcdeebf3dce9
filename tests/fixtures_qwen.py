"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints built from transformers 5.24's config classes (Qwen2_5_VLConfig,
Qwen3VLConfig), weights re-drawn so activations are O(1) (the default init is nearly flat), saved with
save_pretrained: the checkpoints' own weight layouts (Qwen2.5-VL: visual.* + model.layers.*; Qwen3-VL: model.visual.*
+ model.language_model.*)."""

from __future__ import annotations

import json
import math
from pathlib import Path

# (vision config, text config) per model type: small, but every feature on — Qwen2.5-VL windows of 2×2 merge blocks
# (window_size 56 px at 14 px patches) and full attention on blocks 1 and 3; Qwen3-VL a 6×6 position table and
# DeepStack after blocks 0, 1, 2; M-RoPE sections of a 16-wide head
TINY = {
    "qwen2_5_vl": (
        dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
             fullatt_block_indexes=[1, 3], patch_size=14),
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
    ),
    "qwen3_vl": (
        dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=36,
             deepstack_visual_indexes=[0, 1, 2], patch_size=16),
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=1024,
             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                              "mrope_interleaved": True}),
    ),
    # Qwen3.5: Qwen3-VL's tower without DeepStack; Gated DeltaNet layers (2 key heads serving 4 value heads, a conv of
    # kernel 4) beside gated attention layers (partial rotary: 8 of 16 dims, interleaved M-RoPE sections [2, 1, 1])
    "qwen3_5": (
        dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=36,
             patch_size=16),
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=1024, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [2, 1, 1],
                              "mrope_interleaved": True, "partial_rotary_factor": 0.5}),
    ),
}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 1000, 1001, 1002, 1003
EOS_ID = 3


def make_model(kind: str, seed: int = 0, ids: dict | None = None, overrides: dict | None = None):
    """The tiny model in fp32, eval mode, weights re-drawn from seed; ids: the special token ids (default the
    constants above; make_checkpoint passes its tokenizer's), with vocab_size and eos_token_id; overrides: text
    config fields over TINY's (Qwen3.5's layer_types)."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

    vision, text = TINY[kind]
    ids = ids or dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                      vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
                      eos_token_id=EOS_ID, vocab_size=text["vocab_size"])
    ids = dict(ids)
    eos, vocab = ids.pop("eos_token_id"), ids.pop("vocab_size")
    cls, cfg_cls = {"qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig),
                    "qwen3_vl": (Qwen3VLForConditionalGeneration, Qwen3VLConfig),
                    "qwen3_5": (Qwen3_5ForConditionalGeneration, Qwen3_5Config)}[kind]
    text = {**text, **(overrides or {})}
    cfg = cfg_cls(vision_config=vision, text_config={**text, "vocab_size": vocab, "bos_token_id": None,
                                                     "eos_token_id": eos},
                  **ids)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    redraw(model, seed)
    return model


def redraw(model, seed: int) -> None:
    """Every parameter re-drawn: >= 2-D N(0, 1/fan_in) (an Embedding's rows and the position table N(0, 0.5²)),
    norm weights 1 + 0.1 N, biases 0.1 N."""
    import torch

    g = torch.Generator().manual_seed(seed + 777)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pos_embed.weight") or "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):  # (Qwen3.5: decays exp(-A softplus(.)) neither 1 nor 0)
                p.copy_(torch.empty(p.shape).uniform_(0.1, 1.0, generator=g).log())
            elif name.endswith("linear_attn.conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(math.prod(p.shape[1:])))
            elif name.endswith("weight") and "norm" in name and _zero_centered(model, name):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))  # (Qwen3.5's norms scale by 1 + w)
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _zero_centered(model, name: str) -> bool:
    """Whether the norm weight `name` scales by 1 + w (Qwen3_5RMSNorm) rather than w."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return type(module).__name__ == "Qwen3_5RMSNorm"


def make_checkpoint(kind: str, out_dir: Path, seed: int = 0) -> Path:
    """The tiny model saved as a checkpoint folder (config.json + model.safetensors)."""
    make_model(kind, seed).save_pretrained(out_dir)
    return out_dir


_LOADED: dict = {}


def loaded(kind: str, tmp_path_factory):
    """(config, transformers' model, our vision tower, our decoder, embedding table, checkpoint folder) for kind, built
    once per test session (both test modules share it); every checkpoint weight is checked to be read."""
    if kind in _LOADED:
        return _LOADED[kind]
    import json

    from safetensors.torch import load_file

    from vlmrt.families.qwen_vl import language, vision
    from vlmrt.families.qwen_vl.config import QwenVLConfig

    ckpt = make_checkpoint(kind, tmp_path_factory.mktemp(kind))
    cfg = QwenVLConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    tensors = load_file(str(ckpt / "model.safetensors"))
    used = set()

    def take(name):
        used.add(name)
        return tensors[name]

    tower = vision.load(cfg.vision, tensors, take)
    assert used == {n for n in tensors if "visual." in n}  # the tower reads every vision weight
    dec, embed = language.load(cfg, tensors, take, positions=512)
    assert used == set(tensors), sorted(set(tensors) - used)[:3]  # and the decoder the rest
    _LOADED[kind] = (cfg, make_model(kind), tower, dec, embed, ckpt)
    return _LOADED[kind]


_VISION_GRAPHS: dict = {}
VISION_PATHS: dict = {}  # (kind, rows) -> the exported graph file (vision_graph)


def vision_graph(kind: str, tmp_path_factory, rows: int):
    """Our tower exported as one static ONNX graph of `rows` patch rows (export/graphs.py export_graph, fp32), as an
    ORT session; once per session and size."""
    if (kind, rows) in _VISION_GRAPHS:
        return _VISION_GRAPHS[kind, rows]
    import onnxruntime as ort

    from vlmrt.export.graphs import export_graph
    from vlmrt.families.qwen_vl import vision

    cfg, _, tower, *_ = loaded(kind, tmp_path_factory)
    v = cfg.vision
    path = tmp_path_factory.mktemp(f"{kind}-vision") / "vision.onnx"
    export_graph(tower, vision.example_inputs(v, rows, -1e30), vision.input_names(v), vision.output_names(v), path)
    VISION_PATHS[kind, rows] = path
    _VISION_GRAPHS[kind, rows] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return _VISION_GRAPHS[kind, rows]


# --- full checkpoints (the hub layout: tokenizer, processor files, chat template), for the export and the runtime ---

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL / Qwen2.5-VL's chat template (reconstructed from the hub repos' chat_template.json: a default system
# turn, image items as <|vision_start|><|image_pad|><|vision_end|>)
QWEN25_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's (reconstructed, its tool and thinking parts left out: no system turn by default)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# what each kind's processor normalizes with (Qwen2.5-VL: CLIP's, the processor's default; Qwen3-VL's files: 0.5)
MEAN_STD = {"qwen2_5_vl": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
            "qwen3_vl": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]), "qwen3_5": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])}
# the fixture's processor pixel range, in merge blocks (2x2 patches): 4 .. 64 (a 256-patch vision graph)
MIN_BLOCKS, MAX_BLOCKS = 4, 64


def factor(kind: str) -> int:
    """Pixels per merge block side: patch × merge."""
    return 2 * TINY[kind][0]["patch_size"]


def make_tokenizer(out_dir: Path) -> dict:
    """tokenizer.json + tokenizer_config.json: a tiny byte-level BPE with the Qwen pipeline (fixtures_internvl's),
    the Qwen specials first (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2), the vision tokens appended. Returns the
    special ids as the model config takes them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from fixtures import _corpus
    from fixtures_internvl import QWEN_PRETOKENIZE_REGEX, _added_token_entry

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=480, min_frequency=2, show_progress=False, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(out_dir / "tokenizer.json"))
    c = tok.token_to_id
    config = {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "errors": "replace", "model_max_length": 8192, "split_special_tokens": False,
              "clean_up_tokenization_spaces": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
              "added_tokens_decoder": {str(c(t)): _added_token_entry(t) for t in SPECIALS + VISION_TOKENS},
              "additional_special_tokens": SPECIALS[1:] + VISION_TOKENS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return dict(image_token_id=c("<|image_pad|>"), video_token_id=c("<|video_pad|>"),
                vision_start_token_id=c("<|vision_start|>"), vision_end_token_id=c("<|vision_end|>"),
                eos_token_id=c("<|im_end|>"), vocab_size=tok.get_vocab_size())


def write_processor_files(kind: str, out_dir: Path, min_blocks: int = MIN_BLOCKS, max_blocks: int = MAX_BLOCKS) -> None:
    """preprocessor_config.json in each kind's hub layout (Qwen2.5-VL: min_pixels / max_pixels; Qwen3-VL: size
    {shortest_edge, longest_edge}) and chat_template.json."""
    f = factor(kind)
    mean, std = MEAN_STD[kind]
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": mean, "image_std": std,
           "do_convert_rgb": True, "patch_size": f // 2, "temporal_patch_size": 2, "merge_size": 2}
    if kind == "qwen2_5_vl":
        pre.update(min_pixels=min_blocks * f * f, max_pixels=max_blocks * f * f)
    else:
        pre["size"] = {"shortest_edge": min_blocks * f * f, "longest_edge": max_blocks * f * f}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(pre, indent=1) + "\n")
    template = QWEN25_TEMPLATE if kind == "qwen2_5_vl" else QWEN3_TEMPLATE
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}) + "\n")


def make_full_checkpoint(kind: str, out_dir: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """The tiny model with its tokenizer, processor files and chat template (what `vlmrt export` reads); the video
    token's lm-head row zeroed (never generated: a prompt holding it would be a video)."""
    import torch
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = make_tokenizer(out_dir)
    model = make_model(kind, seed, ids, overrides)
    with torch.no_grad():
        for t in ("image_token_id", "video_token_id"):
            model.lm_head.weight[ids[t]] = 0
    model.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=ids["eos_token_id"], pad_token_id=0, do_sample=False).save_pretrained(out_dir)
    write_processor_files(kind, out_dir)
    return out_dir


def oracle_family(kind: str):
    from oracle import OracleFamily

    model, proc = {
        "qwen2_5_vl": ("qwen2_5_vl:Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl.processing_qwen2_5_vl:Qwen2_5_VLProcessor"),
        "qwen3_vl": ("qwen3_vl:Qwen3VLForConditionalGeneration", "qwen3_vl.processing_qwen3_vl:Qwen3VLProcessor"),
        "qwen3_5": ("qwen3_5:Qwen3_5ForConditionalGeneration", "qwen3_vl.processing_qwen3_vl:Qwen3VLProcessor")}[kind]
    return OracleFamily(model=f"transformers.models.{model}", processor=f"transformers.models.{proc}",
                        image_processor="transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil",
                        seq_len_key=None, nested_images=False, pixel_batch_dim=False, native=True)


QWEN25, QWEN3 = oracle_family("qwen2_5_vl"), oracle_family("qwen3_vl")
