"""transformers as the oracle, for both families: the checkpoint's processor (PIL image processor, no video
processor: torchvision does not work with this torch), the model in fp32, and greedy generation.

A family is described once (`OracleFamily`); tests/fixtures.py and tests/fixtures_internvl.py bind it.
"""

from __future__ import annotations

import copy
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class OracleFamily:
    model: str  # "module:Class" of the ...ForConditionalGeneration
    processor: str  # "module:Class" of the processor
    image_processor: str  # "module:Class" of the PIL image processor
    seq_len_key: str | None  # processor_config.json's image tokens per tile (and the processor's keyword); None: none
    nested_images: bool  # the processor takes one list of images per text (SmolVLM) or a flat list (InternVL)
    pixel_batch_dim: bool  # pixel_values come as [1, tiles, 3, S, S] (SmolVLM) or [tiles, 3, S, S] (InternVL)
    # the processor's own apply_chat_template reads video_processor.num_frames (SmolVLM): use ProcessorMixin's
    mixin_chat_template: bool = False
    # "module:function" (ckpt) -> the processor, for a family whose processor is built otherwise (LFM2-VL's
    # torchvision image processor, its max_num_patches left out); None: `processor` below
    make_processor: str | None = None
    # "module:function" (vlmrt's image.Tiles) -> the model's image keywords, for a family that takes more than
    # pixel_values (LFM2-VL: spatial_shapes, pixel_attention_mask); None: pixel_values alone
    model_pixels: str | None = None
    # the image processor takes RGB images only (LFM2-VL's torchvision one): images converted first with
    # transformers' convert_to_rgb (transparency composited onto white)
    rgb: bool = False
    # native resolution (Qwen-VL): pixel_values are one image's patch rows [patches, c·t·p²] with image_grid_thw, and
    # the model's M-RoPE reads which prompt tokens are the image's (mm_token_type_ids)
    native: bool = False
    # "module:Class" of the family's video processor (SmolVLM2's), saved with the processor by save_nested
    video_processor: str | None = None
    # an image is one tile at any size (Gemma 4's aspect-ratio patches padded to a budget; native resolution too)
    one_tile: bool = False


def settings(ckpt: Path) -> tuple[dict, dict]:
    """(the image processor's settings, the processor's own with its chat template) of a checkpoint, read by
    transformers' own readers, as its from_pretrained reads them in either layout (ImageProcessingMixin
    .get_image_processor_dict: processor_config.json's nested "image_processor" first; ProcessorMixin
    .get_processor_dict: processor_config.json, the chat template files)."""
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.processing_utils import ProcessorMixin

    pre = ImageProcessingMixin.get_image_processor_dict(str(ckpt))[0]
    own = ProcessorMixin.get_processor_dict(str(ckpt))[0]
    return dict(pre), dict(own)


def video_settings(ckpt: Path) -> dict:
    """The video processor's settings as transformers reads them (BaseVideoProcessor.get_video_processor_dict)."""
    from transformers.video_processing_utils import BaseVideoProcessor

    return dict(BaseVideoProcessor.get_video_processor_dict(str(ckpt))[0])


def without_types(d: dict) -> dict:
    """Processor settings less the keys that name classes (not constructor arguments)."""
    return {k: v for k, v in d.items() if k not in ("image_processor_type", "video_processor_type", "processor_class")}


def model_image_inputs(fam: "OracleFamily", tiles, ids: list[int], image_token_id: int) -> dict:
    """The model's image keywords from vlmrt's own tiles (the first-logits check feeds them to the model) for the
    prompt ids."""
    import torch

    if fam.native:  # the one tile's patch rows, its grid (t, h, w), the image tokens' mask
        return {"pixel_values": torch.from_numpy(tiles.pixels[0]), "image_grid_thw": torch.tensor([[1, *tiles.patch_grids[0]]]),
                "mm_token_type_ids": torch.tensor([[int(t == image_token_id) for t in ids]])}
    if fam.model_pixels:
        return _import(fam.model_pixels)(tiles)
    return {"pixel_values": torch.from_numpy(tiles.pixels[None] if fam.pixel_batch_dim else tiles.pixels)}


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def load_model(fam: OracleFamily, ckpt: Path, attn_implementation: str = "eager"):
    """The checkpoint as the family's ...ForConditionalGeneration, fp32, eval mode."""
    import torch

    return _import(fam.model).from_pretrained(str(ckpt), dtype=torch.float32,
                                              attn_implementation=attn_implementation).eval()


def _no_video_processor_class(fam: OracleFamily):
    from transformers.processing_utils import ProcessorMixin

    base = _import(fam.processor)

    class NoVideo(base):
        """The family's processor accepting ``video_processor=None``: ProcessorMixin.__init__ type-checks every
        sub-processor, and None is let through for the video processor only."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        if fam.mixin_chat_template:
            def apply_chat_template(self, conversation, chat_template=None, **kwargs):
                return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    NoVideo.__name__ = base.__name__ + "NoVideo"
    return NoVideo


def processor(fam: OracleFamily, ckpt: Path):
    """The family's processor over its PIL image processor + the checkpoint's tokenizer, no video processor."""
    from transformers import AutoTokenizer

    if fam.make_processor:
        return _import(fam.make_processor)(ckpt)
    pre, own = settings(ckpt)
    seq = {fam.seq_len_key: own[fam.seq_len_key]} if fam.seq_len_key else {}
    return _no_video_processor_class(fam)(
        image_processor=_import(fam.image_processor)(**without_types(pre)),
        tokenizer=AutoTokenizer.from_pretrained(str(ckpt)), video_processor=None, chat_template=own["chat_template"],
        **seq,
    )


LEGACY_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                "chat_template.json")


def save_nested(fam: OracleFamily, ckpt: Path, stale: dict | None = None) -> None:
    """The checkpoint's processor saved over its separate files as transformers 5 saves it (ProcessorMixin
    .save_pretrained: one processor_config.json, the image processor's settings (and the video processor's, for a
    family with one) nested in it; chat_template.jinja; the tokenizer's files). stale: {file: (its old settings) ->
    edits}: those old files are left beside it, edited (a fine-tuned checkpoint saved over its hub snapshot), which
    transformers does not read."""
    ckpt = Path(ckpt)
    proc = processor(fam, ckpt)
    if fam.video_processor:
        proc.video_processor = _import(fam.video_processor)(**without_types(video_settings(ckpt)))
    old = {name: json.loads((ckpt / name).read_text()) for name in LEGACY_FILES if (ckpt / name).exists()}
    for name in old:
        (ckpt / name).unlink()
    base = _import(fam.processor)
    if "video_processor" in base.get_attributes() and proc.video_processor is None:
        # (the oracle's InternVL / Qwen-VL processors have none: saved without one, "video_processor": null)
        proc.__class__ = type(base.__name__, (base,), {"get_attributes": classmethod(
            lambda cls: [a for a in base.get_attributes() if a != "video_processor"])})
    else:
        proc.__class__ = base  # (saved as the family's processor class, not the NoVideo subclass)
    proc.save_pretrained(str(ckpt))
    nested = json.loads((ckpt / "processor_config.json").read_text())
    assert nested["image_processor"] and bool(fam.video_processor) == bool(nested.get("video_processor")), nested
    for name, edit in (stale or {}).items():
        (ckpt / name).write_text(json.dumps({**old[name], **edit(old[name])}, indent=1) + "\n")


def greedy_new_ids(model, inputs, max_new_tokens: int, ignore_eos: bool) -> list[int]:
    """transformers greedy `generate` on processor inputs; the new ids. generate() fills every unset
    option from model.generation_config, so passing eos_token_id=None does not disable EOS: with
    ignore_eos the model's generation config is swapped for one without EOS (plain argmax, no stop)."""
    import torch

    saved = model.generation_config
    gen_config = copy.deepcopy(saved)
    if ignore_eos:
        gen_config.eos_token_id = None
    model.generation_config = gen_config
    try:
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
    finally:
        model.generation_config = saved
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def generate(fam: OracleFamily, ckpt: Path, image, prompt: str, max_new_tokens: int, *, ignore_eos: bool = False,
             model=None, processor=None) -> tuple[list[int], np.ndarray, list[int]]:
    """Greedy generation with transformers for one user turn (the image, if any, before the text).

    Returns ``(prompt_ids, pixel_values, new_ids)``: the full templated prompt after image-token expansion, the
    processor's ``pixel_values`` as float32 (no tiles when ``image`` is None), and the generated ids.
    ``max_new_tokens=0`` runs the processor only (no model call). ``ignore_eos=True`` generates exactly
    ``max_new_tokens`` plain-argmax tokens: EOS is neither suppressed nor a stop condition.
    Pass ``model`` / ``processor`` to reuse loaded ones."""
    import torch

    ckpt = Path(ckpt)
    model = load_model(fam, ckpt) if model is None else model
    processor = globals()["processor"](fam, ckpt) if processor is None else processor
    content = [{"type": "text", "text": prompt}]
    if image is not None:
        content = [{"type": "image"}] + content
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    if image is not None:
        inputs = processor(text=[text], images=[[image]] if fam.nested_images else [image], return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(torch.float32).numpy()
    else:
        inputs = processor(text=[text], return_tensors="pt")
        if fam.native:
            v = model.config.vision_config
            return (inputs["input_ids"][0].tolist(), np.zeros((0, 3 * v.temporal_patch_size * v.patch_size**2), np.float32),
                    greedy_new_ids(model, inputs, max_new_tokens, ignore_eos) if max_new_tokens else [])
        size = getattr(model.config.vision_config, "image_size", 0)  # (NaFlex towers have none)
        tile = size[0] if isinstance(size, (list, tuple)) else size
        pixel_values = np.zeros(((1,) if fam.pixel_batch_dim else ()) + (0, 3, tile, tile), dtype=np.float32)
    prompt_ids = inputs["input_ids"][0].tolist()
    if max_new_tokens == 0:  # the processor's outputs alone
        return prompt_ids, pixel_values, []
    return prompt_ids, pixel_values, greedy_new_ids(model, inputs, max_new_tokens, ignore_eos)


def text_equals_transformers(fam: OracleFamily, ckpt: Path, bundle: Path, prompt: str, n: int = 16):
    """A vlmrt bundle's greedy ids on a text prompt equal transformers' in both modes, and its logits teacher-forced
    along them are transformers' to float32 rounding (2e-4 of the largest, test_smolvlm's first-logits tolerance).
    Returns (prompt + greedy ids, transformers' logits [n, vocab])."""
    import torch

    from vlmrt.runtime.vlm import VLM

    model = load_model(fam, ckpt)
    prompt_ids, _, want = generate(fam, ckpt, None, prompt, n, ignore_eos=True, model=model)
    assert len(set(want)) > 4  # not degenerate
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt_ids + want])).logits[0, len(prompt_ids) - 1:-1].numpy()
    vlm = VLM.load(bundle)
    ids = vlm.prompt(prompt).ids
    assert ids == prompt_ids
    for mode in ("kv", "hybrid"):
        vlm.reset()
        assert vlm(prompt, mode=mode, max_new_tokens=n, ignore_eos=True).token_ids == want, mode
        vlm.reset()
        got = vlm.row.score(vlm.scheduler.embed(ids), want, mode)
        assert np.abs(got - ref).max() < 2e-4 * max(1.0, np.abs(ref).max()), mode
    return prompt_ids + want, ref
