"""torchvision is a test-only dependency (transformers' SmolVLMVideoProcessor needs its transforms), installed with
--no-deps against the CPU torch, whose build does not carry torchvision's C++ ops: importing torchvision (which
transformers does as soon as it is installed) registers fake kernels for torchvision::nms / qnms, and fails if their
schemas do not exist. declare() defines the two schemas, once, before anything imports torchvision (conftest.py)."""

from __future__ import annotations

import importlib.util

_LIB = None  # the Library must stay alive for its definitions to last


def declare() -> None:
    global _LIB
    if _LIB is not None or importlib.util.find_spec("torchvision") is None:
        return
    import torch

    _LIB = torch.library.Library("torchvision", "DEF")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
