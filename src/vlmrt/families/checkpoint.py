"""Checkpoint resolution (local folder or hub id) and reading: config, tensors, tokenizer files, templates."""

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
        """The processor's chat template (chat_template.json / .jinja), else the tokenizer's."""
        if (self.path / "chat_template.jinja").is_file():
            return (self.path / "chat_template.jinja").read_text()
        ct = self.json("chat_template.json")
        if ct and ct.get("chat_template"):
            return ct["chat_template"]
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
