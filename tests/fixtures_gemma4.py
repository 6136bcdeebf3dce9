"""A tiny random Gemma 4 VLM checkpoint (Gemma4ForConditionalGeneration saved by transformers: config.json in its
own form, per_layer_config), for tests. Same style as tests/fixtures_lfm2_vl.py: plain functions, torch /
transformers imported inside them.

* :func:`make_gemma4_checkpoint` -- the decoder of tests/test_gemma4_decoder.py's "shared" pattern (2:1 sliding /
  full, window 5, 2 kv-shared layers, per-layer inputs, k_eq_v, soft-capping) and test_gemma4_vision.py's tower
  (patch 4, kernel 3, max_soft_tokens 70), a byte-level BPE with Gemma's markers (`<boi>`, `<|image|>`, `<eoi>`,
  `<|video|>`, turns), a chat template (images and videos), Gemma4ImageProcessor's and Gemma4VideoProcessor's
  settings (4 frames a video); optionally an audio tower.
* :func:`hf_processor`, :func:`hf_generate` -- transformers' Gemma4Processor (the Pillow image processor) and
  generate as the oracle (fp32, greedy, EOS ignored).
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
TURN, END_TURN = "<start_of_turn>", "<end_of_turn>"
BOI, IMAGE, EOI = "<boi>", "<|image|>", "<eoi>"
BOA, AUDIO, EOA = "<boa>", "<|audio|>", "<eoa>"  # (Gemma4Processor reads them even without audio)
VIDEO = "<|video|>"  # (Gemma4Processor's video token, config.json's video_token_id)
SPECIAL_TOKENS = [PAD, EOS, BOS, TURN, END_TURN, BOI, IMAGE, EOI, BOA, AUDIO, EOA, VIDEO]
SOFT = 70
VIDEO_FRAMES = 4  # the video processor's num_frames (its class default is 32)

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<start_of_turn>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<|video|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

TEXT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=6, sliding_window=5, global_head_dim=32, num_global_key_value_heads=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention", "full_attention"],
            num_kv_shared_layers=2, hidden_size_per_layer_input=8, attention_k_eq_v=True, use_double_wide_mlp=True,
            final_logit_softcapping=30.0, max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=128, standardize=True)


def make_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fixtures import BPE_VOCAB_SIZE, _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS[:3], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(out_dir / "tokenizer.json"))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, **entry} for t in SPECIAL_TOKENS},
              "bos_token": BOS, "eos_token": END_TURN, "pad_token": PAD,
              "extra_special_tokens": {"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI,
                                       "audio_token": AUDIO, "boa_token": BOA, "eoa_token": EOA},
              "clean_up_tokenization_spaces": False, "model_max_length": 4096}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def make_gemma4_checkpoint(out_dir: Path, *, seed: int = 0, audio: bool = False, text: dict | None = None,
                           spread: bool = True) -> Path:
    """text: config entries over TEXT's (benchmarks' larger shapes and other layer patterns); spread False: the
    weights as transformers' random init leaves them (the tests spread them for clear margins)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, GenerationConfig, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out_dir)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(TEXT, **(text or {}), vocab_size=len(tok), vocab_size_per_layer_input=len(tok), pad_token_id=ids[PAD],
                eos_token_id=ids[END_TURN], bos_token_id=ids[BOS])
    audio_config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32) if audio \
        else None
    cfg = Gemma4Config(text_config=text, vision_config=VISION, audio_config=audio_config, image_token_id=ids[IMAGE],
                       boi_token_id=ids[BOI], eoi_token_id=ids[EOI], video_token_id=ids[VIDEO])
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # spread what a random init leaves at 1 / 0 / small (as tests/test_gemma4_*.py)
        for n, p in model.named_parameters() if spread else ():
            if "audio" in n:
                continue
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "position_embedding" in n:
                p.normal_()
            elif p.dim() == 2 and "embed_tokens" not in n:
                p.mul_(5)
        for layer in model.model.language_model.layers if spread else ():
            layer.layer_scalar.uniform_(0.5, 1.5)
        if spread:
            model.model.vision_tower.std_bias.normal_()
            model.model.vision_tower.std_scale.uniform_(0.5, 2)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[END_TURN], pad_token_id=ids[PAD],
                     do_sample=False).save_pretrained(out_dir)
    pre = {"image_processor_type": "Gemma4ImageProcessor", "processor_class": "Gemma4Processor", "patch_size": 4,
           "max_soft_tokens": SOFT, "pooling_kernel_size": 3, "do_resize": True, "resample": 3, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": False, "image_mean": [0.0] * 3, "image_std": [1.0] * 3}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(pre, indent=1) + "\n")
    video = {"video_processor_type": "Gemma4VideoProcessor", "patch_size": 4, "max_soft_tokens": SOFT,
             "pooling_kernel_size": 3, "num_frames": VIDEO_FRAMES}
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1) + "\n")
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}) + "\n")
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}) + "\n")
    return out_dir


def hf_model(ckpt: Path):
    import torch
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def hf_processor(ckpt: Path):
    """Gemma4Processor over the Pillow image processor and the video processor (the checkpoint's settings, as
    transformers reads them in either layout), the tokenizer, and the audio feature extractor it requires (unused)."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4 import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from oracle import settings, video_settings, without_types

    pre, _ = settings(ckpt)
    return Gemma4Processor(image_processor=Gemma4ImageProcessorPil(**without_types(pre)),
                           tokenizer=AutoTokenizer.from_pretrained(str(ckpt)), feature_extractor=Gemma4AudioFeatureExtractor(),
                           video_processor=Gemma4VideoProcessor(**without_types(video_settings(ckpt))), chat_template=CHAT_TEMPLATE)


def hf_generate(model, processor, images: list, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new ids) from transformers' processor + generate, EOS ignored."""
    import copy

    import torch

    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=cfg, do_sample=False, max_new_tokens=n)
    k = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, k:].tolist()


def model_pixels(tiles) -> dict:
    """Gemma4ForConditionalGeneration's image keywords from vlmrt's pooled_aspect tiles (oracle.OracleFamily
    .model_pixels): the padded patch rows and each row's patch (x, y), -1 on padding."""
    import numpy as np
    import torch

    from vlmrt.runtime.media import image_pooled

    budget = tiles.pixels.shape[1]
    positions = np.stack([image_pooled.positions(g, budget) for g in tiles.patch_grids])
    return {"pixel_values": torch.from_numpy(tiles.pixels), "image_position_ids": torch.from_numpy(positions)}


def _oracle():
    from oracle import OracleFamily

    return OracleFamily(
        model="transformers.models.gemma4:Gemma4ForConditionalGeneration",
        processor="transformers.models.gemma4:Gemma4Processor",
        image_processor="transformers.models.gemma4.image_processing_pil_gemma4:Gemma4ImageProcessorPil",
        seq_len_key=None, nested_images=True, pixel_batch_dim=False, make_processor="fixtures_gemma4:hf_processor",
        model_pixels="fixtures_gemma4:model_pixels", one_tile=True,
        video_processor="transformers.models.gemma4.video_processing_gemma4:Gemma4VideoProcessor")


GEMMA4 = _oracle()
