"""torchvision is a test-only dependency (transformers' SmolVLMVideoProcessor needs its transforms), installed with
--no-deps beside whichever torch 2.13.0 the test set-up has. PyPI's torchvision wheel is built against PyPI's
default (CUDA) torch: with that torch its C++ library (torchvision/_C.so) loads and defines the torchvision::nms /
qnms schemas itself; with the CPU build (+cpu, what scripts/setup installs here) it cannot load (it links
libtorch_cuda), and importing torchvision (which transformers does as soon as it is installed) then registers fake
kernels for the two ops, which fails if their schemas do not exist.

declare() runs once, before anything imports torchvision (conftest.py): it loads torchvision's C++ library the way
torchvision does (torch.ops.load_library; loading it again when torchvision imports is a no-op), and defines the two
schemas only where that fails. Defining them where the library loads would make its own registration of the
torchvision namespace abort the process (a second TORCH_LIBRARY for one namespace: Fatal Python error at collection).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

_LIB = None  # the Library must stay alive for its definitions to last
_DONE = False
SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def extension_path() -> Path | None:
    """torchvision's C++ library, found as torchvision.extension finds it, without importing torchvision."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if (Path(folder) / f"_C{suffix}").is_file():
                return Path(folder) / f"_C{suffix}"
    return None


def library_loads() -> bool:
    """Whether torchvision's C++ library loads with this torch (loading it registers its ops, as importing torchvision
    would)."""
    path = extension_path()
    if path is None:
        return False
    import torch

    try:
        torch.ops.load_library(str(path))
    except OSError:  # e.g. libtorch_cuda.so not found: the CPU torch
        return False
    return True


def declare() -> bool:
    """Define torchvision::nms / qnms where torchvision's C++ library cannot define them; True where they were
    defined here."""
    global _LIB, _DONE
    if not _DONE and importlib.util.find_spec("torchvision") is not None and not library_loads():
        import torch

        _LIB = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            _LIB.define(schema)
    _DONE = True
    return _LIB is not None
