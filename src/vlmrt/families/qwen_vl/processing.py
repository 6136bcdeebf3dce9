"""Qwen2.5-VL / Qwen3-VL processor files -> the runtime's image op (runtime/media/image_native.py "smart_resize") and its
parameters, and the patch budget the static vision graph is exported for.

The image processor's settings (preprocessor_config.json, or processor_config.json's "image_processor" as
transformers 5 saves them: families/checkpoint.py) come in two shapes: the hub's Qwen2.5-VL files give `min_pixels` /
`max_pixels`, transformers 5 (and Qwen3-VL's files) `size: {shortest_edge, longest_edge}`; both mean the same (the
processor's __init__ maps the first onto the second, and the first wins when both are there). Absent keys take the
processor's defaults.
"""

from __future__ import annotations

from typing import Any

from ...format.manifest import ImageSpec
from .. import processor_image
from ..decoder import UnsupportedCheckpoint
from .config import DEFAULT_MAX_PATCHES, VisionConfig

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # the processor's defaults (OPENAI_CLIP_MEAN / STD)
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def image_spec(pre: dict[str, Any], v: VisionConfig, max_patches: int | None = None) -> ImageSpec:
    """The manifest's ImageSpec for these processor settings and a vision graph of max_patches rows (None:
    DEFAULT_MAX_PATCHES, or fewer when the processor's own max_pixels needs fewer)."""
    if pre.get("do_resize", True) is False:
        raise UnsupportedCheckpoint("the image processor's settings set do_resize false; vlmrt exports the resizing "
                                    "processor only")
    size = dict(pre.get("size") or {})
    min_pixels = int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    patch, merge = int(pre.get("patch_size", v.patch)), int(pre.get("merge_size", v.merge))
    temporal = int(pre.get("temporal_patch_size", v.temporal_patch))
    if (patch, merge, temporal) != (v.patch, v.merge, v.temporal_patch):
        raise UnsupportedCheckpoint(f"the image processor's patches ({patch} px, merge {merge}, temporal "
                                    f"{temporal}) differ from the vision config's ({v.patch}, {v.merge}, "
                                    f"{v.temporal_patch})")
    if min_pixels > max_pixels:
        raise UnsupportedCheckpoint(f"the image processor's settings have min_pixels {min_pixels} > max_pixels {max_pixels}")
    own = max_pixels // (patch * patch)  # the most patches the processor itself makes (but at extreme aspect ratios)
    budget = max_patches or min(DEFAULT_MAX_PATCHES, own - own % (merge * merge))
    if budget < max(merge * merge, -(-min_pixels // (patch * patch))):
        raise UnsupportedCheckpoint(f"a patch budget of {budget} is below the processor's min_pixels "
                                    f"({min_pixels} px = {-(-min_pixels // (patch * patch))} patches)")
    if budget % (merge * merge):
        raise UnsupportedCheckpoint(f"a patch budget of {budget} is not a multiple of {merge * merge} (a merge block)")
    pp = dict(pre)
    if pre.get("do_rescale", True) is False:
        pp["rescale_factor"] = 1.0
    if pre.get("do_normalize", True) is False:
        pp["image_mean"], pp["image_std"] = [0.0] * 3, [1.0] * 3
    return processor_image(pp, tiling="smart_resize", tile_size=patch * merge, patch_size=patch,
                           params={"merge": merge, "temporal_patch": temporal, "min_pixels": min_pixels,
                                   "max_pixels": max_pixels, "max_patches": budget},
                           resample=3, mean=CLIP_MEAN, std=CLIP_STD)  # the processor's defaults: bicubic, CLIP
