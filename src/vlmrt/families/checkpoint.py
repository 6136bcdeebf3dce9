"""Checkpoint resolution (local folder or hub id) and reading: config, tensors, tokenizer files, templates, and the
processor's settings in both layouts transformers reads (`Checkpoint.image_processor`, `.video_processor`,
`.processor_settings`, `.named_tokens`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    pass


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]

# The processor's files (transformers' PROCESSOR_NAME, IMAGE_PROCESSOR_NAME, VIDEO_PROCESSOR_NAME). transformers 5
# saves a processor as ONE processor_config.json holding its sub-processors' settings as nested objects
# ("image_processor", "video_processor") beside its own (image_seq_len ...); before, each sub-processor had a file.
PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
# the sub-processors a processor's own settings never hold (ProcessorMixin.from_args_and_dict pops its attributes)
SUB_PROCESSORS = ("image_processor", "video_processor", "tokenizer", "feature_extractor")
# the tokenizer's own special-token attributes (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES): not model-specific
TOKENIZER_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def resolve(src: str) -> Path:
    """A local checkpoint folder, or a hub id downloaded through huggingface_hub."""
    p = Path(src).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise CheckpointError(f"{p} is not a Hugging Face checkpoint folder (no config.json)")
        return p
    if not HUB_ID.match(src):
        raise CheckpointError(f"checkpoint not found: {src} (neither a local folder nor a hub id like org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError("downloading from the hub needs huggingface_hub: pip install 'vlmrt[export]'") from None
    try:
        return Path(snapshot_download(src, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot download {src} from the Hugging Face hub: {first}") from None


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, path: Path) -> "Checkpoint":
        return cls(path, read_json(path / "config.json"))

    def json(self, name: str, default: Any = None) -> Any:
        p = self.path / name
        return read_json(p) if p.is_file() else default

    # --- the processor's settings, read where transformers 5.24 reads them ------------------------------------------
    def _processor_file(self) -> dict[str, Any]:
        d = self.json(PROCESSOR_FILE, None)
        if d is None:
            return {}
        if not isinstance(d, dict):
            raise CheckpointError(f"{PROCESSOR_FILE} is not a JSON object")
        return d

    def _nested(self, key: str) -> dict[str, Any] | None:
        d = self._processor_file()
        if d.get(key) is None:  # (absent, or null: transformers then reads the separate files too)
            return None
        if not isinstance(d[key], dict):
            raise CheckpointError(f"{PROCESSOR_FILE}'s {key!r} is not a JSON object")
        return d[key]

    def _file(self, name: str) -> dict[str, Any] | None:
        d = self.json(name, None)
        if d is not None and not isinstance(d, dict):
            raise CheckpointError(f"{name} is not a JSON object")
        return d

    def image_processor(self) -> dict[str, Any] | None:
        """The image processor's settings as transformers reads them (ImageProcessingMixin.get_image_processor_dict,
        which AutoImageProcessor.from_pretrained and so ProcessorMixin.from_pretrained call): processor_config.json's
        nested "image_processor" object where it has one, whatever preprocessor_config.json says; else
        preprocessor_config.json; None where neither is there (transformers raises: no image processor)."""
        nested = self._nested("image_processor")
        return nested if nested is not None else self._file(IMAGE_PROCESSOR_FILE)

    def require_image_processor(self, processor: str) -> dict[str, Any]:
        """image_processor(), refused in one line where the checkpoint has none (transformers' `processor`
        .from_pretrained raises there too: vlmrt never exports an image processor's defaults in its place)."""
        pp = self.image_processor()
        if pp is None:
            raise CheckpointError(f"{self.path} has no image processor settings ({PROCESSOR_FILE} with an "
                                  f"\"image_processor\" object, or {IMAGE_PROCESSOR_FILE}): {processor} cannot be "
                                  f"made without them")
        return pp

    def video_processor(self) -> dict[str, Any] | None:
        """The video processor's settings as transformers reads them (BaseVideoProcessor.get_video_processor_dict,
        called by AutoVideoProcessor.from_pretrained): processor_config.json's nested "video_processor" object, else
        video_preprocessor_config.json, else preprocessor_config.json (the image processor's file: older releases
        kept the video settings there); None where none is there."""
        nested = self._nested("video_processor")
        if nested is not None:
            return nested
        for name in (VIDEO_PROCESSOR_FILE, IMAGE_PROCESSOR_FILE):
            d = self._file(name)
            if d is not None:
                return d
        return None

    def processor_settings(self) -> dict[str, Any]:
        """The processor's own settings (image_seq_len ...): processor_config.json's top level without its
        sub-processors' objects, in both layouts (ProcessorMixin.get_processor_dict, from_args_and_dict); {} where
        the file is absent (transformers then takes the processor class's defaults)."""
        return {k: v for k, v in self._processor_file().items() if k not in SUB_PROCESSORS}

    def named_tokens(self) -> dict[str, str]:
        """The tokenizer's model-specific named tokens (image_token, fake_image_token, start_image_token ...), which
        the processors read as tokenizer attributes, as transformers 5's PreTrainedTokenizerBase.from_pretrained
        collects them from tokenizer_config.json: its top-level "*_token" strings, an "extra_special_tokens" object
        over them (transformers 5 writes that layout), and its "model_specific_special_tokens" object only where
        neither gives one."""
        tc = self.json("tokenizer_config.json", {}) or {}
        if not isinstance(tc, dict):
            raise CheckpointError("tokenizer_config.json is not a JSON object")

        def text(v):  # a string, or an AddedToken as saved ({"__type": "AddedToken", "content": ...})
            return v.get("content") if isinstance(v, dict) else v

        out = {k: text(v) for k, v in tc.items()
               if k.endswith("_token") and k not in TOKENIZER_SPECIALS and isinstance(text(v), str)}
        extra = tc.get("extra_special_tokens")
        if isinstance(extra, dict):
            out.update({k: text(v) for k, v in extra.items() if isinstance(text(v), str)})
        if not out and isinstance(tc.get("model_specific_special_tokens"), dict):
            out = {k: text(v) for k, v in tc["model_specific_special_tokens"].items() if isinstance(text(v), str)}
        return out

    def tensors(self) -> dict:
        """All safetensors tensors (memory-mapped by safetensors), as torch tensors."""
        from safetensors.torch import load_file

        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} has no *.safetensors weights")
        out = {}
        for f in files:
            try:
                out.update(load_file(str(f)))
            except Exception as e:
                raise CheckpointError(f"cannot read weights {f.name}: {e}") from None
        return out

    def chat_template(self) -> str | None:
        """The processor's chat template where transformers' ProcessorMixin.get_processor_dict takes it from:
        processor_config.json's "chat_template" key (an older layout), else chat_template.json (the legacy file wins
        over chat_template.jinja where both are there, as transformers reads them), else chat_template.jinja; else
        the tokenizer's."""
        own = self._processor_file().get("chat_template")
        if isinstance(own, str) and own:
            return own
        ct = self.json("chat_template.json")
        if isinstance(ct, dict) and ct.get("chat_template"):
            return ct["chat_template"]
        if (self.path / "chat_template.jinja").is_file():
            return (self.path / "chat_template.jinja").read_text()
        tc = self.json("tokenizer_config.json", {})
        t = tc.get("chat_template")
        if isinstance(t, list):  # named templates
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        return t

    def eos_ids(self, tok_json: dict) -> list[int]:
        """The EOS token id(s): generation_config.json, config.json (or its text_config), else tokenizer_config.json's
        eos_token looked up in tokenizer.json's added tokens."""
        gen = self.json("generation_config.json", {})
        eos = gen.get("eos_token_id", self.config.get("eos_token_id", self.config.get("text_config", {}).get("eos_token_id")))
        if eos is None:
            name = self.json("tokenizer_config.json", {}).get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
            eos = next((t["id"] for t in tok_json.get("added_tokens", []) if t["content"] == name), None)
        if eos is None:
            raise CheckpointError("cannot find the EOS token id (generation_config.json, config.json or tokenizer_config.json)")
        return [eos] if isinstance(eos, int) else list(eos)

    def pad_id(self, vocab: int) -> int:
        for src in (self.json("generation_config.json", {}), self.config, self.config.get("text_config", {})):
            if isinstance(src.get("pad_token_id"), int):
                return src["pad_token_id"]
        return vocab - 1

    def special_strings(self) -> dict[str, str]:
        """bos/eos/pad/unk token strings of tokenizer_config.json ("" where absent)."""
        tc = self.json("tokenizer_config.json", {})
        out = {}
        for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = tc.get(k)
            out[k] = (v.get("content") if isinstance(v, dict) else v) or ""
        return out


def read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {p}: {e}") from None
