"""Model families: the registry (config.json `model_type` -> family module) and the contract every family module
meets (`Family`). The exporter and the float reference talk to a family only through this contract; the runtime
never does (it reads the manifest the exporter wrote from it).

A family module (smolvlm.py, internvl.py) defines, at module level:
    MODEL_TYPES                          the config.json model types it exports
    config_from_hf(config) -> cfg        its config dataclass (meets `FamilyConfig`)
    load_weights(cfg, tensors)           -> (vision module, decoder module, embedding table [vocab, hidden])
    host_spec(ckpt, cfg, tok_json)       -> HostSpec: what the runtime needs besides graphs
    default_max_context(cfg, host)       -> (max context tokens, why that many)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# config.json model_type -> family module (vlmrt.families.<name>); the modules import torch, so they load on demand
REGISTRY = {"smolvlm": "smolvlm", "idefics3": "smolvlm", "internvl": "internvl", "internvl_chat": "internvl"}

# preprocessor_config.json "resample" (PIL's enum values) -> the runtime's filter names
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class UnknownFamily(ValueError):
    pass


def resample_name(value) -> str:
    name = PIL_RESAMPLE.get(value) if isinstance(value, int) else str(value).lower()
    if name not in PIL_RESAMPLE.values():
        raise ValueError(f"preprocessor_config.json resample {value!r} is not one of Pillow's filters "
                         f"({', '.join(f'{k} {v}' for k, v in PIL_RESAMPLE.items())})")
    return name


def channel_values(value, channels: int = 3) -> list[float]:
    """preprocessor_config.json image_mean / image_std: a list per channel, or one number for all (transformers
    takes both)."""
    return [float(value)] * channels if isinstance(value, (int, float)) else [float(v) for v in value]


@dataclass(frozen=True)
class HostSpec:
    """A family's host plan for one checkpoint, read from its processor files; the exporter writes it into the
    manifest (ImageSpec, PromptSpec, SpecialTokens)."""

    image: dict[str, Any]  # manifest.ImageSpec fields: the tiling op and its parameters
    prompt_expansion: str  # the host op that writes a tile grid as prompt text (runtime/prompt.py)
    prompt_params: dict[str, Any]  # its parameters (the image marker tokens)
    image_placeholder: str  # what the rendered chat template holds where the image goes
    image_token_id: int  # the token whose rows the vision graph's embeddings replace
    system_prompt: str | None = None
    # templates that render no image item (OpenGVLab's originals): (placeholder, text put before the prompt)
    image_in_text_fallback: tuple[str, str] | None = None
    video: dict[str, Any] | None = None  # manifest.VideoSpec fields, for a checkpoint whose processor reads videos


@runtime_checkable
class FamilyConfig(Protocol):
    """The parts of a family's config dataclass the exporter reads."""

    text: Any  # decoder.TextConfig
    vision: Any  # has patch_size
    patches_per_tile: int
    tokens_per_tile: int
    tie_word_embeddings: bool  # the lm head is the embedding table (an untied one is a weight of its own)


@runtime_checkable
class Family(Protocol):
    MODEL_TYPES: tuple[str, ...]

    def config_from_hf(self, config: dict[str, Any]) -> FamilyConfig: ...

    def load_weights(self, cfg: Any, tensors: dict[str, Any]) -> tuple[Any, Any, Any]: ...

    def host_spec(self, ckpt: Any, cfg: Any, tok_json: dict) -> HostSpec: ...

    def default_max_context(self, cfg: Any, host: HostSpec) -> tuple[int, str]: ...


def family_for(config: dict[str, Any]) -> Family:
    """The family module for a checkpoint's config.json."""
    model_type = config.get("model_type")
    if model_type not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownFamily(f"unknown model type {model_type!r} in config.json; vlmrt exports: {known}")
    return importlib.import_module(f"{__name__}.{REGISTRY[model_type]}")
