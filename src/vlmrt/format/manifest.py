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
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import BundleError, malformed as _malformed
from .checks import check_decoder
from .typed_json import Malformed, build
from .verify_record import Record

# 2: each graph lists its data files and the external initializers the host maps (GraphSpec.data_files,
# mapped_weights, prepacked), so that the runtime never parses a graph itself (the onnx package is export-only)
# 3: the decoder by kind (decoder.kind, a tagged union), rope positions as their own input (decoder.positions), the
# cache as a list of per-layer kinds (kv.layers); the conversation template is required
SCHEMA_VERSION = 3
MANIFEST_NAME = "manifest.json"


@dataclass
class TensorSpec:
    name: str
    shape: list[int | str]  # a str is a symbolic dim, e.g. "ctx" (graphs exported with a dynamic cache length)
    dtype: str  # numpy dtype name: "float32", "float16", "int64", "uint8"


@dataclass
class QnnContext:
    """A graph precompiled by the QNN EP for one Hexagon arch: an EPContext model and the context binary it names."""

    file: str  # "<graph>_ctx.onnx"
    binary: str  # "<graph>_ctx_qnn.bin" (with target.shared_context, prefill and decode name the same one)


@dataclass
class GraphSpec:
    """One static ONNX graph."""

    file: str | None  # the ONNX graph (QDQ for the HTP target); None in an HTP bundle exported without --keep-qdq
    precision: str  # weights: one of export.cpu.quantize.PRECISIONS ("fp32", "w4a16", "w4a8m", ...)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    weights: dict[str, Any] = field(default_factory=dict)  # e.g. {"block_size": 32, "symmetric": true, "lm_head": "w8a16"}
    # written by the export from the graph proto (required in a manifest; defaults only while the export builds one):
    data_files: list[str] = field(default_factory=list)  # the external-data files the graph reads
    # external initializers the host may map once and share between sessions (runtime/weights.py SharedWeights):
    # [{"name", "file", "offset", "length", "dtype" (numpy name), "shape"}]; 4-bit tensors and the prepacked
    # MatMulNBits inputs are not listed
    mapped_weights: list[dict[str, Any]] = field(default_factory=list)
    prepacked: bool = False  # the graph has MatMulNBits nodes (their CPU kernel computes from ORT's prepacked copy)
    # MatMulNBits scales / zero points (mapped_weights' form): ORT's x86 int8-compute kernel copies them into its packed
    # weights but keeps the originals, which it never reads again; the runtime maps them itself and drops their pages
    # while the session is built (runtime/weights.py SharedWeights.dropping)
    load_only_weights: list[dict[str, Any]] = field(default_factory=list)
    context: QnnContext | None = None  # the HTP target: what `--device htp` loads (no graph compile at load)
    # the HTP target: QNN EP provider options this graph was compiled with and is loaded with (an fp16 graph:
    # {"enable_htp_fp16_precision": "1"}; export/htp/precisions.py)
    qnn_options: dict[str, str] = field(default_factory=dict)
    _required = ("data_files", "mapped_weights", "prepacked")

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, self.where)

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, self.where)

    @property
    def where(self) -> str:
        return self.file or (self.context.file if self.context else "?")


def _by_name(specs: list[TensorSpec], name: str, where: str) -> TensorSpec:
    for s in specs:
        if s.name == name:
            return s
    raise BundleError(f"graph {where} has no tensor named {name!r}")


@dataclass
class ImageSpec:
    """Host image preprocessing: a named tiling op and its parameters, then rescale + normalize.

    tiling ops the runtime has (runtime/media/image.py):
      "longest_edge_grid": resize longest edge to `longest_edge`, round sides up to multiples of
          `tile_size`, cut a rows×cols grid of tiles + a global tile (or one global tile when
          `split` is false); the Idefics3 / SmolVLM image processor.
    """

    tiling: str
    tile_size: int
    patch_size: int  # the host unfolds each tile into [patches, channels*patch*patch]
    resample: str  # Pillow filter name: "lanczos" | "bicubic" | "bilinear" | "nearest" | "box" | "hamming"
    rescale_factor: float
    mean: list[float]
    std: list[float]
    params: dict[str, Any] = field(default_factory=dict)  # tiling-op specific


@dataclass
class VideoSpec:
    """How a video becomes frames and prompt text (runtime/media/video.py), as the checkpoint's video processor does it
    (SmolVLM2: SmolVLMVideoProcessor + SmolVLMProcessor; Gemma 4: Gemma4VideoProcessor + Gemma4Processor). Absent from
    a bundle: --video is refused. Named host ops, no family branch: `sampling` (video.SAMPLING) picks the frames,
    `frames` (video.FRAMES) makes each one a tile, the pieces (intro, a frame line before each frame, separator,
    outro) are its text, each frame's image text written by the prompt's expansion with `frame_params` over the
    prompt's params and its rows on `frame_token_id` (None: the image token)."""

    fps: float  # frames sampled per second of video (0: a fixed count, "uniform") ...
    max_frames: int  # ... at most this many ("uniform": the count)
    placeholder: str  # what the rendered template holds for one video ("<video>", "<|video|>")
    frame_line: str  # "\nFrame from {timestamp}:" before each frame's image text ("{timestamp} ": Gemma 4)
    resample: str = "lanczos"  # Pillow filter name, as ImageSpec.resample ("square_tile")
    skip_secs: float = 0.0  # a clip long enough loses this much at each end before sampling ("smolvlm")
    longest_edge: int = 0  # a frame's longest edge is resized to this first ... ("square_tile")
    frame_size: int = 0  # ... then the frame to frame_size × frame_size: one tile ("square_tile")
    # the template a conversation with a video is rendered with (SmolVLM: the processor's own for videos); None: the
    # bundle's chat template
    chat_template: str | None = None
    intro: str = ""  # "You are provided the following series of {frame_count} frames from a {video_duration} ..."
    outro: str = ""  # after the last frame
    separator: str = ""  # between one frame's image text and the next frame's line (Gemma 4: " ")
    sampling: str = "smolvlm"  # video.SAMPLING: "smolvlm" (fps × duration, skip_secs) | "uniform" (transformers' default)
    frames: str = "square_tile"  # video.FRAMES: "square_tile" (SmolVLM) | "image_tiling" (frame_image's tiling op)
    frame_image: ImageSpec | None = None  # "image_tiling": the ImageSpec a frame is tiled with
    frame_params: dict[str, Any] = field(default_factory=dict)  # a frame's expansion params over PromptSpec.params
    frame_token_id: int | None = None  # the token of a frame's rows (Gemma 4's video token); None: the image token


@dataclass
class PromptSpec:
    """How a conversation and its images become token ids (runtime/prompt/conversation.py, runtime/prompt/build.py).

    `chat_template` is the checkpoint's Jinja chat template, rendered at run time with jinja2 as transformers'
    apply_chat_template does, with `template_strings` (bos_token, eos_token, ...) it may read. `content_format` says
    how it takes message content ("parts": [{"type": "image"}, {"type": "text", ...}]; "string": text only, an image
    written into the text as `image_in_text`); `image_placeholder` is what a rendered image item is, replaced by
    the image's expansion: `expansion` names the host op that writes it from the tile grid (runtime/prompt/build.py),
    with `params` for it. (How prompt tokens are positioned is the decoder's: DecoderSpec's positions op.)
    """

    chat_template: str
    expansion: str
    tokens_per_tile: int
    add_special_tokens: bool
    image_placeholder: str
    params: dict[str, Any] = field(default_factory=dict)
    template_strings: dict[str, str] = field(default_factory=dict)
    content_format: str = "parts"
    image_in_text: str | None = None
    system_prompt: str | None = None  # a system turn put first when a conversation has none
    video: VideoSpec | None = None  # video input (SmolVLM2); None: the bundle takes no videos


CACHE_QUANT_TYPES = ("per_channel", "per_tensor")  # CacheQuant.key / value: GroupQueryAttention's k/v_quant_type


@dataclass
class CacheQuant:
    """An attention layer's quantized cache (`vlmrt export --kv-cache int8|int4`, the CPU target's gqa_in_place
    graph): ORT's GroupQueryAttention stores the layer's K and V symmetrically quantized, q = clamp(round(x / scale)),
    and reads them back as q * scale (kv_cache_bit_width, k_quant_type / v_quant_type, the scales the graph holds as
    its k_scale / v_scale inputs). bits 8: int8 buffers [.., head_dim]; 4: uint8 buffers [.., head_dim / 2], two values
    a byte. The scales were calibrated at export (absmax × headroom over the calibration rows, post-RoPE keys) and are
    recorded here as the graph has them: per_channel, kv_heads × head_dim values (head-major); per_tensor, one."""

    bits: int  # 8 | 4
    key: str  # CACHE_QUANT_TYPES
    value: str
    key_scale: list[float]
    value_scale: list[float]
    headroom: float  # the calibrated absmax's multiplier
    calibration_rows: int  # the rows (tokens) the scales were calibrated on

    @property
    def dtype(self) -> str:
        """The buffers' numpy dtype (GroupQueryAttention's: int8 at 8 bits, uint8 nibble pairs at 4)."""
        return "int8" if self.bits == 8 else "uint8"

    def problem(self, kv_heads: int, head_dim: int) -> str | None:
        if self.bits not in (8, 4):
            return f"quant.bits {self.bits} is not 8 or 4"
        if self.bits == 4 and head_dim % 2:
            return "a 4-bit cache needs an even head_dim"
        for name, kind, scale in (("key", self.key, self.key_scale), ("value", self.value, self.value_scale)):
            if kind not in CACHE_QUANT_TYPES:
                return f"quant.{name} {kind[:20]!r} is not one of {', '.join(CACHE_QUANT_TYPES)}"
            want = kv_heads * head_dim if kind == "per_channel" else 1
            if len(scale) != want or not all(s > 0 for s in scale):
                return f"quant.{name}_scale must hold {want} positive scales ({kind})"
        if self.key != self.value:  # (ORT 1.32's CPU kernel: "requires k_quant_type == v_quant_type")
            return f"quant.key {self.key} and quant.value {self.value} differ: GroupQueryAttention takes one type for both"
        return None


@dataclass
class AttentionLayer:
    """A layer whose cache state is one K and one V row per slot (runtime/decode/kv_cache.py stores them).

    The decoder kind (DecoderSpec.kind) says how the graph takes them: `gqa_in_place` as buffers
    [1, kv_heads, max_context, head_dim] it updates itself (key_output / value_output: the updated buffers, bound to
    the inputs' memory), the rows kinds as [ctx, kv_heads * head_dim] plus the step's new rows [ar, kv_dim] out."""

    kind: str  # "attention"
    kv_heads: int
    head_dim: int
    key_input: str
    value_input: str
    key_output: str
    value_output: str
    quant: CacheQuant | None = None  # a quantized cache (gqa_in_place only); None: the cache is the I/O dtype

    @property
    def dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def cache_dim(self) -> int:
        """A buffer's last dim: head_dim, or head_dim / 2 bytes in a 4-bit cache."""
        return self.head_dim // 2 if self.quant and self.quant.bits == 4 else self.head_dim

    def cache_dtype(self, io_dtype) -> str:
        """The K/V buffers' dtype: the quantized cache's, else the cache's (kv.dtype)."""
        return self.quant.dtype if self.quant else str(io_dtype)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.key_input, self.value_input

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.key_output, self.value_output

    def problem(self) -> str | None:
        """What is wrong with this entry's numbers (checks.check_decoder names the entry), or None."""
        if self.kv_heads <= 0 or self.head_dim <= 0:
            return "kv_heads and head_dim must be positive"
        return self.quant.problem(self.kv_heads, self.head_dim) if self.quant else None


@dataclass
class ConvLayer:
    """A layer whose cache state is one row per slot of a short convolution's input (LFM2: B*x of its in_proj,
    channels = hidden), of which a step reads a fixed window: state_input [width, channels] = the rows of slots
    slot - width .. slot - 1 before the step (zeros before slot 0), state_output [ar, channels] = the step's own rows,
    which the host writes at the step's slots like K/V rows (so a rewind, a rejected lookahead draft or a padded
    block needs nothing more). The decoder kind lays them out: gqa_in_place's are [B, width, channels] and
    [B, ar / B, channels] (runtime/decode/kv_cache.py HEADS; B = 1 but in a batched call). LFM2-VL's decoder has them."""

    kind: str  # "conv"
    channels: int
    width: int  # the kernel size - 1
    state_input: str
    state_output: str

    @property
    def inputs(self) -> tuple[str, ...]:
        return (self.state_input,)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.state_output,)

    def problem(self) -> str | None:
        """What is wrong with this entry's numbers (checks.check_decoder names the entry), or None."""
        return "channels and width must be positive" if self.channels <= 0 or self.width <= 0 else None


@dataclass
class RecurrentLayer:
    """A layer whose state is not per slot: a Gated DeltaNet layer's (Qwen3.5's `linear_attention`), the window of its
    causal conv's last `width` input rows [width, channels] and the gated delta rule's recurrent state
    [heads, key_dim, value_dim] (value heads), both summarizing every slot before the step. A step reads both
    (conv_input, state_input) and returns them as they are after its last row (conv_output, state_output), which the
    host keeps in place of the old ones (runtime/decode/recurrent_state.py): a step whose rows are not all kept (a
    lookahead call's rejected drafts) is run again over the kept rows, a kept prefix restores a snapshot taken at a
    prompt block's end. gqa_in_place lays them out [B, width, channels] and [B, heads, key_dim, value_dim] (B = 1 but
    in a batched call)."""

    kind: str  # "recurrent"
    width: int  # the conv kernel - 1
    channels: int  # the conv's channels: q, k and v side by side
    heads: int  # value heads (the state's)
    key_dim: int
    value_dim: int
    conv_input: str
    state_input: str
    conv_output: str
    state_output: str

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.conv_input, self.state_input

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.conv_output, self.state_output

    def problem(self) -> str | None:
        """What is wrong with this entry's numbers (checks.check_decoder names the entry), or None."""
        if min(self.width, self.channels, self.heads, self.key_dim, self.value_dim) <= 0:
            return "width, channels, heads, key_dim and value_dim must be positive"
        return None


@dataclass
class SlidingAttentionLayer(AttentionLayer):
    """An attention layer whose queries see only the last `window` keys: a key at slot k is seen by the query at slot
    q when q - window < k <= q (Gemma 4's sliding_attention layers under the rows kinds). Its K and V rows are kept
    one per slot like an attention layer's (runtime/decode/windowed_state.py: so a prefix reuse, a rejected lookahead
    draft or a chunked prefill rewinds by moving the length); the graph adds the window to the kind's mask. The CPU's
    gqa_in_place graphs keep these layers in a windowed cache instead (WindowedAttentionLayer)."""

    window: int = 0  # keys a query sees, its own included

    def problem(self) -> str | None:
        return super().problem() or (None if self.window > 0 else "window must be positive")


def resident(t: int, capacity: int, window: int) -> int:
    """L(t) of a windowed cache (WindowedAttentionLayer; ORT 1.32's GroupQueryAttention, sliding_window_cache): the
    rows [0, L) that hold slots t - L .. t - 1 after t slots, capacity C, window W: t while t <= C, else t - G *
    ceil((t - C) / G), G = C - W + 1 (eviction frees G rows at once; min(t, W) <= L <= min(t, C))."""
    if t <= capacity:
        return t
    g = capacity - window + 1
    return t - g * -(-(t - capacity) // g)


@dataclass
class WindowedAttentionLayer(SlidingAttentionLayer):
    """A sliding-window layer whose K and V buffers hold `capacity` rows, not one per slot (gqa_in_place graphs:
    ORT's GroupQueryAttention with sliding_window_cache, which evicts in the graph): after T slots rows [0, L(T))
    hold slots T - L(T) .. T - 1, L(T) = T while T <= capacity, else T - G * ceil((T - capacity) / G), G = capacity
    - window + 1 (runtime/decode/windowed_state.py: how the runtime stores, rewinds and batches them)."""

    capacity: int = 0  # rows of each K / V buffer (>= window)

    def resident(self, t: int) -> int:
        """L(t): the rows holding slots after t slots were written (class doc)."""
        return resident(t, self.capacity, self.window)

    def first(self, t: int) -> int:
        """The slot in row 0 after t slots: t - L(t). Two counts with the same first slot share their rows: the
        buffers of the larger hold the smaller's (a rewind between them moves the length only)."""
        return t - resident(t, self.capacity, self.window)

    def lowest(self, t: int) -> int:
        """The smallest count whose first slot is first(t) (0 while nothing was evicted, else first + window)."""
        f = self.first(t)
        return f + self.window if f else 0

    def problem(self) -> str | None:
        if self.quant and self.quant.bits == 4 and self.head_dim % 32:  # (ORT 1.32's sliding_window_cache kernel)
            return f"a 4-bit windowed cache needs a head_dim that is a multiple of 32, not {self.head_dim}"
        return super().problem() or (None if self.capacity >= self.window else "capacity must be at least window")


@dataclass
class SharedKVLayer:
    """A layer with no K/V of its own (Gemma 4's num_kv_shared_layers): its queries attend over the cache of the
    earlier layer kv.layers[source] (the last earlier layer of its attention type that has K/V), which the graph
    reads inside (the source's own inputs): no state, no graph input or output of its own."""

    kind: str  # "shared_kv"
    source: int  # the kv.layers index whose K/V rows this layer reads

    @property
    def inputs(self) -> tuple[str, ...]:
        return ()

    @property
    def outputs(self) -> tuple[str, ...]:
        return ()

    def problem(self) -> str | None:
        return "source must be a layer index >= 0" if self.source < 0 else None


CACHE_LAYER_KINDS = {"attention": AttentionLayer, "conv": ConvLayer, "recurrent": RecurrentLayer,
                     "sliding_attention": SlidingAttentionLayer, "windowed_attention": WindowedAttentionLayer,
                     "shared_kv": SharedKVLayer}


def attention_layers(n: int, kv_heads: int, head_dim: int, key_input: str = "past_key_{layer}",
                     value_input: str = "past_value_{layer}", key_output: str = "new_key_{layer}",
                     value_output: str = "new_value_{layer}") -> list[AttentionLayer]:
    """n attention layers of one shape, their tensor names the templates formatted with layer=i."""
    return [AttentionLayer("attention", kv_heads, head_dim, key_input.format(layer=i), value_input.format(layer=i),
                           key_output.format(layer=i), value_output.format(layer=i)) for i in range(n)]


@dataclass
class KVSpec:
    """The decoder's state outside the graphs: one entry per decoder layer, by kind (CACHE_LAYER_KINDS), over
    max_context slots. runtime/decode/state_kinds.py is the one definition of how each kind is stored and written (one class per kind)."""

    max_context: int
    dtype: str
    layers: list[AttentionLayer | ConvLayer | RecurrentLayer | SlidingAttentionLayer | WindowedAttentionLayer
                 | SharedKVLayer]
    # uint8 caches (HTP bundles): per graph, per layer (scale, zero_point) of K and V rows,
    # {"prefill": {"key": [[s, zp], ...], "value": [...]}, "decode": {...}}; q = round(x / s) + zp
    encodings: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)

    def attention(self) -> list[AttentionLayer]:
        return [layer for layer in self.layers if isinstance(layer, AttentionLayer)]

    def state_inputs(self) -> list[str]:
        """Every layer's state inputs, in layer order (attention: key, value)."""
        return [n for layer in self.layers for n in layer.inputs]

    def state_outputs(self) -> list[str]:
        return [n for layer in self.layers for n in layer.outputs]

    def window_capacity(self) -> int:
        """The rows of the windowed layers' buffers (WindowedAttentionLayer.capacity; 0: no windowed layer)."""
        return max((layer.capacity for layer in self.layers if isinstance(layer, WindowedAttentionLayer)), default=0)


@dataclass
class PositionsSpec:
    """The rope positions, a graph input of every decoder kind, computed by the host apart from the cache slot a row
    is written to: `input` [rows, ar] int64 (rows: rope rows, 1 for a plain RoPE, 3 for M-RoPE's (t, h, w)). `op`
    names the host op that computes a prompt's positions (runtime/prompt/positions.py POSITION_OPS; "slots": the position of
    slot p is p); a generated token's is the largest of the last slot's positions + 1."""

    input: str
    rows: int = 1
    op: str = "slots"
    params: dict[str, Any] = field(default_factory=dict)  # op-specific


@dataclass(frozen=True)
class KindParts:
    """A decoder kind's optional parts, each explicit (None / 0 / False: the kind's graphs have none). Each kind says
    which it has in one place (its `parts()`); the runtime builds its step features from this (runtime/decode/step_features.py)
    and the checks read it (checks.py), never a kind's own optional fields.
      step_inputs       the kind's per-step inputs besides embeds, positions and the cache: a mask, or the end slot's two
      logit_rows_input  [r] int64: the rows whose logits a step returns ([r, vocab])
      argmax_output     [r] int64: each logits row's argmax (greedy decoding reads it)
      token_rows_input, token_scales_input  an int8 token row [ar, hidden] and its scale [ar] the graph adds to embeds
      hidden_output     the decoder's final-norm rows [ar, hidden], mapped to logits by graphs.head (one row)
      verify_ar         the AR of graphs.verify (a lookahead verify graph; 0: none)
      batched           one call advances several sequences (export/batch_dim.py)
      valid_rows_input  [ar] float32, 1 for the step's real rows and 0 for a padded block's padding: a static graph of
                        recurrent layers keeps their state at the last real row (export/graphs.py static_valid_rows)"""

    step_inputs: tuple[str, ...] = ()
    logit_rows_input: str | None = None
    argmax_output: str | None = None
    token_rows_input: str | None = None
    token_scales_input: str | None = None
    hidden_output: str | None = None
    verify_ar: int = 0
    batched: bool = False
    valid_rows_input: str | None = None

    def inputs(self) -> list[str]:
        """The kind's own graph inputs (beside embeds, positions, the row input and the cache)."""
        return [n for n in (*self.step_inputs, self.logit_rows_input, self.token_rows_input, self.token_scales_input,
                            self.valid_rows_input) if n]

    def outputs(self, logits_output: str) -> list[str]:
        """The decoder graphs' outputs beside the cache's: the logits (or the head graph's input), the argmax."""
        return [self.hidden_output or logits_output, *([self.argmax_output] if self.argmax_output else [])]


@dataclass
class GqaInPlaceKind:
    """The CPU target's one decoder graph: each layer's attention is ORT's GroupQueryAttention over the cache buffers,
    which it updates in place; AR symbolic 1..prefill_ar, the buffers read whole. It takes the step's end slot
    (seqlens_input [1] int32 = last slot, total_length_input [] int32 = last slot + 1) instead of a mask, and
    positions [1, ar] (GroupQueryAttention's position_ids: ORT applies RoPE at them)."""

    name: str  # "gqa_in_place"
    seqlens_input: str
    total_length_input: str
    logit_rows_input: str  # [r] int64: the rows whose logits the step returns ([r, vocab])
    argmax_output: str  # [r] int64: each logits row's argmax (greedy decoding reads it)
    # int8 tables (DecoderSpec.embedding_scale_file): inputs [ar, hidden] int8 and [ar] float32; the graph adds
    # token_rows * token_scales (in float32, cast to the I/O dtype) to inputs_embeds, so a decode step reads its row
    # straight into the bound input and the host does no multiply (scale 0: the row is not used)
    token_rows_input: str | None = None
    token_scales_input: str | None = None
    # the graph takes a batch (export/batch_dim.py): B = the length of seqlens_input, the cache buffers
    # [B, kv_heads, max_context, head_dim] (conv windows [B, width, channels]), B sequences of ar / B tokens each
    # (positions [1, ar] in sequence order); one call advances B sequences (runtime/decode/scheduler.py). False: B is 1
    # (bundles exported before)
    batched: bool = False

    def parts(self) -> KindParts:
        return KindParts((self.seqlens_input, self.total_length_input), self.logit_rows_input, self.argmax_output,
                         self.token_rows_input, self.token_scales_input, batched=self.batched)

    def check(self, m: "Manifest") -> None:
        """This kind's fields fit together and with the manifest (BundleError if not)."""
        if bool(self.token_rows_input) != bool(self.token_scales_input) or (
                self.token_rows_input and (m.decoder.embedding_dtype != "int8" or m.decoder.embedding_group)):
            raise _malformed("decoder.kind.token_rows_input and token_scales_input go together, with an int8 embedding "
                             "table of one scale per row (embedding_scale_file, no embedding_group)")


@dataclass
class RowsDynamicKind:
    """One decoder graph under the rows contract, symbolic in AR (1..prefill_ar) and cache length: a step at slot s
    reads the cache prefix [:ctx] (ctx = s rounded up to context_step; kv_cache.context_slots) and an additive mask
    [ar, ctx + ar] built from slots, and returns the step's new rows, which the host writes (--attention portable)."""

    name: str  # "rows_dynamic"
    mask_input: str
    context_step: int
    logit_rows_input: str  # [r] int64: the rows whose logits the step returns

    def parts(self) -> KindParts:
        return KindParts((self.mask_input,), self.logit_rows_input)

    def check(self, m: "Manifest") -> None:
        _float_cache(m)
        if self.context_step < 0:
            raise _malformed("decoder.kind.context_step must not be negative")
        if self.context_step == 0:
            raise _malformed("decoder kind rows_dynamic needs context_step > 0 (symbolic cache length)")


@dataclass
class RowsStaticKind:
    """Decoder graphs at fixed AR under the rows contract: prefill (AR = prefill_ar, the last block padded), decode
    (AR = 1), and verify (AR = verify_ar > 0: the lookahead verify graph, every row's logits). context_step 0: the
    cache inputs are the whole cache (the HTP target); > 0: the prefix [:ctx] as rows_dynamic's (two-graph CPU
    exports). logits [ar, vocab]; with hidden_output the graphs return the final norm's [ar, hidden] and graphs.head
    maps a step's last valid row (that input) to logits [1, vocab]. valid_rows_input (KindParts): where a layer's
    state is not per slot (kv.layers kind "recurrent"), the graphs keep it at a padded step's last real row."""

    name: str  # "rows_static"
    mask_input: str
    context_step: int = 0
    mask_value: float | None = None  # additive mask for hidden slots; None = the I/O dtype's lowest value
    verify_ar: int = 0
    hidden_output: str | None = None
    valid_rows_input: str | None = None

    def parts(self) -> KindParts:
        return KindParts((self.mask_input,), hidden_output=self.hidden_output, verify_ar=self.verify_ar,
                         valid_rows_input=self.valid_rows_input)

    def check(self, m: "Manifest") -> None:
        _float_cache(m)
        if self.context_step < 0:
            raise _malformed("decoder.kind.context_step must not be negative")
        if not self.valid_rows_input and any(isinstance(layer, RecurrentLayer) for layer in m.kv.layers):
            raise _malformed("static decoder graphs of recurrent layers (kv.layers kind recurrent) need "
                             "decoder.kind.valid_rows_input: a padded block would enter their state")


def _float_cache(m: "Manifest") -> None:
    """The rows kinds' host writes the step's new rows, which a graph returns as floats: no quantized cache there."""
    if any(layer.quant for layer in m.kv.attention()):
        raise _malformed("a quantized cache (kv.layers[].quant) needs decoder kind gqa_in_place, whose graph writes it")


DECODER_KINDS = {"gqa_in_place": GqaInPlaceKind, "rows_dynamic": RowsDynamicKind, "rows_static": RowsStaticKind}


@dataclass
class TablePart:
    """A run of a token row's columns stored in a form of its own (DecoderSpec.embedding_parts)."""

    columns: int
    dtype: str  # float32 | float16 | int8 | int4
    group: int | None = None  # values per float16 scale (int8: 64; int4: 32 or 64); None for float columns


@dataclass
class DecoderSpec:
    """The decoder graphs' non-cache I/O; `kind` says which contract they follow (DECODER_KINDS), with its fields."""

    hidden_size: int
    vocab_size: int
    prefill_ar: int  # hybrid mode's prompt block
    embeds_input: str
    positions: PositionsSpec
    logits_output: str
    embedding_file: str  # [vocab, hidden] .npy, memory-mapped by the host
    # float32 | float16 | int8 | int4 (then rows are scaled by embedding_scale_file: runtime/table_rows.py); parts: a
    # row's columns in runs of their own forms (embedding_parts), a row stored as one run of bytes
    embedding_dtype: str
    kind: GqaInPlaceKind | RowsDynamicKind | RowsStaticKind
    embedding_scale_file: str | None = None
    # values per scale of an int8 / int4 table: None, one float32 scale per row ([vocab]); G, one float16 scale per G
    # values of a row ([vocab, ⌈hidden_size / G⌉]; int4 codes two per byte, [vocab, ⌈hidden_size / 2⌉] uint8)
    embedding_group: int | None = None
    # embedding_dtype "parts": the row's parts in order (their columns sum to hidden_size), each stored as its form's
    # codes then its float16 scales, side by side in a uint8 row (embed.npy [vocab, row bytes]); None otherwise
    embedding_parts: list[TablePart] | None = None
    row_input: RowInputSpec | None = None  # a per-token row input (VisionSpec.row_outputs); None: the graphs take none
    # [ar] int64: each row's image span (a run of image-token rows; -1: none): a span's rows see each other both ways
    # on the layers the graph applies it to (Gemma 4's bidirectional vision attention), so the runtime never splits a
    # span across steps (runtime/decode/spans.py: a prompt block ends before a span it would cut, or runs on to its
    # end); decode and verify steps feed -1. None: the graphs take none (causal)
    span_input: str | None = None


@dataclass
class VisionSpec:
    """The vision graph's tensors. `tile_inputs` names the host op that turns one tile into its inputs
    (runtime/media/tile_inputs.py TILE_INPUTS: "unfold_patches", the square tiles' patch rows; "naflex_rows", a NaFlex
    tile's token-major rows + position weights + key mask; "native_grid", a native-resolution image's patch rows
    padded to the graph's rows with the 2-D rotary, window order / position interpolation and masks its grid needs)
    with its `params`; `extra_inputs` maps the op's inputs after the patch rows, by role, to the graph's input names.
    embeds_output: one row per image token; row_outputs: more outputs of one row per image token (Qwen3-VL's
    DeepStack features), fed to the decoder's row input (DecoderSpec.row_input) on the image's rows, in order."""

    patches_input: str
    embeds_output: str
    tile_inputs: str = "unfold_patches"
    extra_inputs: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    row_outputs: list[str] = field(default_factory=list)


@dataclass
class RowInputSpec:
    """A per-token decoder input besides the embeddings: `input` [ar, width], an image token's row the vision graph's
    row_outputs side by side, zeros for text and generated tokens (Qwen3-VL's DeepStack features)."""

    input: str
    width: int


@dataclass
class SpecialTokens:
    image_token_id: int
    eos_token_ids: list[int]
    pad_token_id: int


@dataclass
class Manifest:
    model: dict[str, Any]  # informational: family, source, name — the runtime never branches on it
    # "vision", "prefill", "decode" (one file for both with the symbolic-AR kinds); rows_static: "verify" with
    # decoder.kind.verify_ar, "head" with decoder.kind.hidden_output
    graphs: dict[str, GraphSpec]
    tokenizer_file: str
    image: ImageSpec
    prompt: PromptSpec
    special_tokens: SpecialTokens
    kv: KVSpec
    decoder: DecoderSpec
    vision: VisionSpec
    generate: dict[str, Any]  # {"default_mode": "hybrid", "modes": [...], "max_new_tokens": N}
    # where the graphs are meant to run: {"name": "cpu"} or {"name": "htp", "soc_model": id, "soc_name", "htp_arch",
    # "qnn_sdk" (the SDK that compiled the context binaries), "shared_context": bool}
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


def from_dict(d: Any) -> Manifest:
    if not isinstance(d, dict):
        raise BundleError("manifest.json is malformed: it must be a JSON object")
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(f"bundle schema version {version} is not supported (this vlmrt reads {SCHEMA_VERSION}); "
                          "re-export it from its checkpoint with `vlmrt export CHECKPOINT OUT`")
    try:
        check_kinds(d)
        m = build(Manifest, d, "")
        for name, entry in m.files.items():
            build(FileEntry, entry, f"files.{name}")
        for name, g in m.graphs.items():
            for where, w in [(f"graphs.{name}.{f}[{i}]", w) for f in ("mapped_weights", "load_only_weights")
                             for i, w in enumerate(getattr(g, f))]:
                w = build(MappedWeight, w, where)
                if w.dtype not in MAPPED_DTYPES:
                    raise Malformed(f"{where}.dtype: unknown dtype {w.dtype[:40]!r}")
                if w.offset < 0 or w.length < 0 or any(d < 0 for d in w.shape):
                    raise Malformed(f"{where}: offset, length and shape must not be negative")
                if w.file not in g.data_files:
                    raise Malformed(f"{where}.file {w.file[:80]!r} is not one of the graph's data_files")
    except Malformed as e:
        raise BundleError(f"manifest.json is malformed: {e}") from None
    except RecursionError:
        raise BundleError("manifest.json is malformed: nested too deeply") from None
    return m


def _tag(value, where: str):
    """A tagged union's tag as read: a string or absent (a list or an object is not one: refused by name, not a
    TypeError from the kinds' lookup)."""
    if value is not None and not isinstance(value, str):
        raise BundleError(f"manifest.json is malformed: {where} must be a string, not {type(value).__name__}")
    return value


def check_kinds(d: dict) -> None:
    """The tagged unions' tags (decoder.kind.name, kv.layers[i].kind) name kinds this vlmrt knows (else: upgrade), and
    each entry is well formed as its kind (Malformed names the field); build then picks the same dataclass."""
    kind = d.get("decoder", {}).get("kind") if isinstance(d.get("decoder"), dict) else None
    if isinstance(kind, dict):
        name = _tag(kind.get("name"), "decoder.kind.name")
        if name not in DECODER_KINDS:
            raise BundleError(f"bundle decoder kind {str(name)[:40]!r} is not known to this vlmrt "
                              f"({', '.join(DECODER_KINDS)}); upgrade vlmrt")
        build(DECODER_KINDS[name], kind, "decoder.kind")
    layers = d.get("kv", {}).get("layers") if isinstance(d.get("kv"), dict) else None
    for i, layer in enumerate(layers if isinstance(layers, list) else []):
        if isinstance(layer, dict):
            if _tag(layer.get("kind"), f"kv.layers[{i}].kind") not in CACHE_LAYER_KINDS:
                raise BundleError(f"bundle cache layer kind {str(layer.get('kind'))[:40]!r} (kv.layers[{i}]) is not "
                                  f"known to this vlmrt ({', '.join(CACHE_LAYER_KINDS)}); upgrade vlmrt")
            build(CACHE_LAYER_KINDS[layer["kind"]], layer, f"kv.layers[{i}]")


MAPPED_DTYPES = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"}


@dataclass
class FileEntry:
    sha256: str
    bytes: int


@dataclass
class MappedWeight:
    name: str
    file: str
    offset: int
    length: int
    dtype: str
    shape: list[int]


def bundle_paths(m: Manifest) -> list[tuple[str, str]]:
    """(manifest field, path) for every file the manifest names."""
    out = [(f"graphs.{k}.file", g.file) for k, g in m.graphs.items() if g.file is not None]
    out += [(f"graphs.{k}.context.{f}", getattr(g.context, f)) for k, g in m.graphs.items() if g.context
            for f in ("file", "binary")]
    out += [(f"graphs.{k}.data_files", f) for k, g in m.graphs.items() for f in g.data_files]
    out += [(f"graphs.{k}.mapped_weights", w["file"]) for k, g in m.graphs.items() for w in g.mapped_weights]
    out += [(f"graphs.{k}.load_only_weights", w["file"]) for k, g in m.graphs.items() for w in g.load_only_weights]
    out += [("tokenizer_file", m.tokenizer_file), ("decoder.embedding_file", m.decoder.embedding_file)]
    if m.decoder.embedding_scale_file is not None:
        out.append(("decoder.embedding_scale_file", m.decoder.embedding_scale_file))
    out += [("files", n) for n in m.files]
    return out


def check_path(folder: Path, field_name: str, name: str) -> None:
    """Refuse a bundle path that is empty, absolute, has a `..` (or any non-plain) part, or resolves (symlinks
    included) outside the bundle folder — before anything opens it."""
    bad = None
    parts = PurePosixPath(name).parts
    if not name or "\\" in name or "\0" in name:
        bad = "is not a plain relative path"
    elif name.startswith("/") or os.path.isabs(name):
        bad = "is absolute"
    elif any(p in ("..", ".") for p in parts) or name.endswith("/"):
        bad = "contains '..' or '.'" if any(p in ("..", ".") for p in parts) else "is not a file name"
    else:
        root = folder.resolve()
        try:
            inside = (folder / name).resolve().is_relative_to(root)
        except (OSError, RuntimeError):  # a symlink loop
            inside = False
        if not inside:
            bad = "resolves (through a symlink) outside the bundle"
    if bad:
        raise BundleError(f"manifest field {field_name}: path {name[:80]!r} {bad}; a bundle reads only its own files")


def load(folder: Path, verify: bool = True) -> Manifest:
    """Read and validate a bundle's manifest; with verify, check every file's size and sha256 (a file verified before
    and not changed since is not hashed again: vlmrt/verify_record.py)."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(f"{folder} is not a vlmrt bundle (no {MANIFEST_NAME})")
    try:
        raw = path.read_bytes()
        d = json.loads(raw.decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"cannot read {path}: {e}") from None
    except RecursionError:
        raise BundleError(f"cannot read {path}: nested too deeply") from None
    m = from_dict(d)
    checked = set()
    for field_name, name in bundle_paths(m):  # each path once (every mapped weight names its data file)
        if name not in checked:
            check_path(folder, field_name, name)
            checked.add(name)
    for name in ("vision", "prefill", "decode", *(("head",) if "head" in m.graphs else ())):
        if name not in m.graphs:
            raise BundleError(f"manifest.json is malformed: graphs lacks the graph {name!r}")
    for name in m.graphs:
        if m.graphs[name].file is None and m.graphs[name].context is None:
            raise BundleError(f"manifest.json is malformed: graphs.{name} has neither a file nor a context")
    check_decoder(m)
    named = {n for f, n in bundle_paths(m) if f != "files"}
    missing = sorted(n for n in named if n not in m.files)
    if missing:
        raise BundleError(f"manifest does not list {', '.join(missing)}")
    if verify:
        verify_files(folder, m, raw)
    return m


def verify_files(folder: Path, m: Manifest, manifest_bytes: bytes) -> None:
    """Every listed file exists with its size and sha256; the verifications are remembered (Record) for this
    manifest, so that an unchanged file is hashed once."""
    record = Record(folder, manifest_bytes)
    for name, entry in m.files.items():
        p = folder / name
        if not p.is_file():
            raise BundleError(f"bundle file missing: {p}")
        before = p.stat()
        if before.st_size != entry["bytes"]:
            raise BundleError(f"bundle file altered (sha256 mismatch): {p}")
        if record.holds(name, before, entry["sha256"]):
            continue
        if sha256_file(p) != entry["sha256"]:
            raise BundleError(f"bundle file altered (sha256 mismatch): {p}")
        record.add(name, before, p.stat(), entry["sha256"])
    record.save()
