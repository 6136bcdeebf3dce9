"""The bundle contract: what an exporter writes and the runtime executes (stdlib only).

A bundle is a folder holding `manifest.json` and the files it names. The manifest is
written once, at the end of export, and never edited afterwards; every file is listed
with its sha256 so that a runtime can refuse an altered bundle.

The runtime knows nothing about model families: everything that differs between them
(graphs and their I/O names, image tiling, prompt expansion, chat template, special
tokens, KV layout) is in here, as data or as the name of a host op the runtime has.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class BundleError(Exception):
    """A bundle that cannot be used: missing, altered, or of an unknown schema."""


@dataclass
class TensorSpec:
    name: str
    shape: list[int | str]  # a str is a symbolic dim, e.g. "ctx" (graphs exported with a dynamic cache length)
    dtype: str  # numpy dtype name: "float32", "float16", "int64", "uint8"


@dataclass
class GraphSpec:
    """One static ONNX graph."""

    file: str
    precision: str  # weights: one of export.quantize.PRECISIONS ("fp32", "w4a16", "w4a8m", ...)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    weights: dict[str, Any] = field(default_factory=dict)  # e.g. {"block_size": 32, "symmetric": true, "lm_head": "w8a16"}

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, self.file)

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, self.file)


def _by_name(specs: list[TensorSpec], name: str, where: str) -> TensorSpec:
    for s in specs:
        if s.name == name:
            return s
    raise BundleError(f"graph {where} has no tensor named {name!r}")


@dataclass
class ImageSpec:
    """Host image preprocessing: a named tiling op and its parameters, then rescale + normalize.

    tiling ops the runtime has (runtime/image.py):
      "longest_edge_grid": resize longest edge to `longest_edge`, round sides up to multiples of
          `tile_size`, cut a rows×cols grid of tiles + a global tile (or one global tile when
          `split` is false); the Idefics3 / SmolVLM image processor.
    """

    tiling: str
    tile_size: int
    patch_size: int  # the host unfolds each tile into [patches, channels*patch*patch]
    resample: str  # Pillow filter name: "lanczos" | "bicubic" | "bilinear" | "nearest"
    rescale_factor: float
    mean: list[float]
    std: list[float]
    params: dict[str, Any] = field(default_factory=dict)  # tiling-op specific


@dataclass
class PromptSpec:
    """How a user prompt and an image become token ids.

    `template_image` / `template_text` are the model's chat template rendered for one user
    turn with a generation prompt; `{image}` and `{prompt}` mark where the expanded image
    text and the user's text go. `expansion` names the host op that writes the image text
    from the tile grid (runtime/prompt.py), with `params` for it.
    """

    template_image: str
    template_text: str
    expansion: str
    tokens_per_tile: int
    add_special_tokens: bool
    params: dict[str, Any] = field(default_factory=dict)
    # conversations (runtime/conversation.py renders them with jinja2, as transformers' apply_chat_template does):
    # the checkpoint's Jinja chat template, the special-token strings it may read (bos_token, eos_token, ...),
    # how it takes message content ("parts": [{"type": "image"}, {"type": "text", ...}]; "string": text only, an
    # image written into the text as `image_in_text`), and what a rendered image item is (`image_placeholder`,
    # replaced by the expansion op's text, image by image). None: a bundle exported before conversations.
    chat_template: str | None = None
    template_strings: dict[str, str] = field(default_factory=dict)
    content_format: str = "parts"
    image_placeholder: str = ""
    image_in_text: str | None = None
    system_prompt: str | None = None  # a system turn put first when a conversation has none


@dataclass
class KVSpec:
    """The KV cache lives outside the graphs, one [max_context, dim] buffer per layer and K/V.

    A graph step with AR tokens at positions pos..pos+AR-1 reads the cache (the whole of it, or
    the prefix [:ctx] for a graph with a symbolic cache length, DecoderSpec) plus an
    additive mask [AR, ctx + AR] and returns only the AR new rows per layer; the host writes
    row i to cache slot pos+i (runtime/kv_cache.py is the one definition).
    """

    layers: int
    dim: int  # kv_heads * head_dim
    max_context: int
    dtype: str
    key_input: str  # format with layer=i
    value_input: str
    key_output: str
    value_output: str
    # uint8 caches (HTP bundles): per graph, per layer (scale, zero_point) of K and V rows,
    # {"prefill": {"key": [[s, zp], ...], "value": [...]}, "decode": {...}}; q = round(x / s) + zp
    encodings: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)


@dataclass
class DecoderSpec:
    """Names of the decoder graphs' non-cache I/O, shared by prefill and decode."""

    hidden_size: int
    vocab_size: int
    prefill_ar: int
    embeds_input: str
    positions_input: str
    mask_input: str
    logits_output: str
    embedding_file: str  # [vocab, hidden] .npy, memory-mapped by the host
    embedding_dtype: str  # float32 | float16 | int8 (then rows are scaled by embedding_scale_file [vocab])
    embedding_scale_file: str | None = None
    mask_value: float | None = None  # additive mask for hidden slots; None = the I/O dtype's lowest value
    # > 0: the graphs' cache inputs have a symbolic length "ctx" (mask [ar, ctx + ar]); a step at first position
    # pos reads the prefix [:ctx], ctx = pos rounded up to a multiple of context_step (at least context_step, at
    # most max_context). 0: static graphs over the whole cache
    context_step: int = 0
    # the prefill and decode graphs take any AR from 1 to prefill_ar ("ar" in their shapes; usually one graph file
    # for both): a step feeds exactly its tokens, never padding
    dynamic_ar: bool = False
    # the logits output is [1, vocab], the step's last token only (needs dynamic_ar: the last row is then a real
    # token); the rows before it are never computed through the LM head
    last_logits: bool = False


@dataclass
class VisionSpec:
    patches_input: str
    embeds_output: str


@dataclass
class SpecialTokens:
    image_token_id: int
    eos_token_ids: list[int]
    pad_token_id: int


@dataclass
class Manifest:
    model: dict[str, Any]  # informational: family, source, name — the runtime never branches on it
    graphs: dict[str, GraphSpec]  # "vision", "prefill", "decode"
    tokenizer_file: str
    image: ImageSpec
    prompt: PromptSpec
    special_tokens: SpecialTokens
    kv: KVSpec
    decoder: DecoderSpec
    vision: VisionSpec
    generate: dict[str, Any]  # {"default_mode": "hybrid", "modes": [...], "max_new_tokens": N}
    # where the graphs are meant to run: {"name": "cpu"} or {"name": "htp", "soc_model": ..., "htp_arch": ...}
    target: dict[str, Any] = field(default_factory=lambda: {"name": "cpu"})
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> {sha256, bytes}
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def list_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The `files` table for the named files in folder."""
    return {n: {"sha256": sha256_file(folder / n), "bytes": (folder / n).stat().st_size} for n in sorted(names)}


def save(manifest: Manifest, folder: Path) -> None:
    (Path(folder) / MANIFEST_NAME).write_text(manifest.to_json())


def _tensors(items: list[dict]) -> list[TensorSpec]:
    return [TensorSpec(**t) for t in items]


def _decoder_fields(dec: dict[str, Any]) -> dict[str, Any]:
    """Bundles written before context buckets were removed carry `buckets` ({} unless exported with --buckets)."""
    dec = dict(dec)
    if dec.pop("buckets", None):
        raise BundleError("this bundle was exported with context buckets (--buckets), which this vlmrt no longer runs; "
                          "re-export it (decoder graphs now take any cache length)")
    return dec


def from_dict(d: dict[str, Any]) -> Manifest:
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(f"bundle schema version {version} is not supported (this vlmrt reads {SCHEMA_VERSION}); re-export it")
    try:
        graphs = {
            k: GraphSpec(file=g["file"], precision=g["precision"], inputs=_tensors(g["inputs"]), outputs=_tensors(g["outputs"]),
                         weights=g.get("weights", {}))
            for k, g in d["graphs"].items()
        }
        return Manifest(
            model=d["model"],
            graphs=graphs,
            tokenizer_file=d["tokenizer_file"],
            image=ImageSpec(**d["image"]),
            prompt=PromptSpec(**d["prompt"]),
            special_tokens=SpecialTokens(**d["special_tokens"]),
            kv=KVSpec(**d["kv"]),
            decoder=DecoderSpec(**_decoder_fields(d["decoder"])),
            vision=VisionSpec(**d["vision"]),
            generate=d["generate"],
            target=d.get("target", {"name": "cpu"}),
            files=d["files"],
            schema_version=version,
        )
    except (KeyError, TypeError) as e:
        raise BundleError(f"manifest.json is malformed: {e}") from None


def load(folder: Path, verify: bool = True) -> Manifest:
    """Read and validate a bundle's manifest; with verify, check every file's size and sha256."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"{folder} is not a vlmrt bundle (no {MANIFEST_NAME})")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"cannot read {path}: {e}") from None
    m = from_dict(d)
    if m.decoder.last_logits and not m.decoder.dynamic_ar:
        raise BundleError("manifest.json is malformed: decoder.last_logits needs decoder.dynamic_ar")
    named = {g.file for g in m.graphs.values()} | {m.tokenizer_file, m.decoder.embedding_file}
    if m.decoder.embedding_scale_file:
        named.add(m.decoder.embedding_scale_file)
    missing = sorted(n for n in named if n not in m.files)
    if missing:
        raise BundleError(f"manifest does not list {', '.join(missing)}")
    if verify:
        verify_files(folder, m)
    return m


def verify_files(folder: Path, m: Manifest) -> None:
    for name, entry in m.files.items():
        p = folder / name
        if not p.is_file():
            raise BundleError(f"bundle file missing: {p}")
        if p.stat().st_size != entry["bytes"] or sha256_file(p) != entry["sha256"]:
            raise BundleError(f"bundle file altered (sha256 mismatch): {p}")
