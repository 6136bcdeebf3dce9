"""Model families: the registry (config.json `model_type` -> family module) and the contract every family meets.

A family module (smolvlm.py, internvl.py; or a package, as qwen_vl/ will be) provides one `Family` as `FAMILY`: its name, the model
types it exports and four functions (read the config, build the modules from the checkpoint's tensors, plan the host
side, size the default context). `REGISTRY` names the module that holds each model type; the modules import torch,
so they load on demand. The exporter and the float reference (eval/reference.py) talk to a family only through the
checked accessors below (`Family.config`, `Family.weights`, `Family.host`, `Family.max_context`); the runtime never
does (it reads the manifest the exporter wrote from them).

What the exporter relies on is checked where a family is looked up (`family_for`: the module's FAMILY agrees with
REGISTRY) and when the export starts (the accessors), each in one line naming the family, before any graph is
traced: the decoder derives from `DecoderModule` (layers.CausalDecoder, or a family's own with its step contract: a
cache kind per layer, attention or conv), whose members the exporter reads as they are (defaults where a decoder has
no such part), with the HF-Llama module names the quantizer matches, the vision module maps one tile to `tokens_per_tile`
rows of the decoder's width, the embedding table is [vocab, hidden], and the host ops the family names exist in
the runtime. What a new family provides: docs/adding-a-family.md.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol

from ..format.manifest import ImageSpec

if TYPE_CHECKING:  # (torch only for export: this module is imported without it)
    import torch

    from .checkpoint import Checkpoint
    from .decoder import TextConfig
    from .token_table import TokenTable

# config.json model_type -> the family module (vlmrt.families.<name>) whose FAMILY exports it
REGISTRY = {"smolvlm": "smolvlm", "idefics3": "smolvlm", "internvl": "internvl", "internvl_chat": "internvl",
            "lfm2_vl": "lfm2_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen_vl", "qwen3_5": "qwen_vl",
            "gemma4": "gemma4"}

# the image processor's "resample" (PIL's enum values) -> the runtime's filter names
PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

# the module names the quantizer and the GPTQ calibration find weights by (HF Llama's: export/cpu/quantize.py
# MIXED_8BIT, export/cpu/calibrate_gptq.py), per decoder layer by its cache kind (DecoderModule.layer_kinds), and
# the stack's own
DECODER_LAYER_WEIGHTS = {
    "attention": ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "conv": ("input_layernorm", "conv.in_proj", "conv.out_proj", "post_attention_layernorm", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"),  # (a gated short convolution in place of attention: LFM2)
    "recurrent": ("input_layernorm", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                  "linear_attn.in_proj_a", "linear_attn.out_proj", "post_attention_layernorm", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"),  # (a Gated DeltaNet in place of attention: Qwen3.5)
    # Gemma 4 (families/gemma4/language.py): a sliding-window layer has an attention layer's weights; a kv-shared
    # one has no k / v projections (it reads its source layer's K/V)
    "sliding_attention": ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                          "mlp.down_proj"),
    "windowed_attention": ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                           "mlp.down_proj"),
    "shared_kv": ("input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "post_attention_layernorm",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}
DECODER_WEIGHTS = ("norm", "lm_head")


class UnknownFamily(ValueError):
    pass


class FamilyContractError(ValueError):
    """A family module does not meet the contract: a bug in the family, caught before any graph is traced."""


def resample_name(value) -> str:
    name = PIL_RESAMPLE.get(value) if isinstance(value, int) else str(value).lower()
    if name not in PIL_RESAMPLE.values():
        raise ValueError(f"the processor's resample {value!r} is not one of Pillow's filters "
                         f"({', '.join(f'{k} {v}' for k, v in PIL_RESAMPLE.items())})")
    return name


def channel_values(value, channels: int = 3) -> list[float]:
    """The image processor's image_mean / image_std: a list per channel, or one number for all (transformers
    takes both)."""
    return [float(value)] * channels if isinstance(value, (int, float)) else [float(v) for v in value]


def processor_image(pp: dict[str, Any], *, tiling: str, tile_size: int, patch_size: int, params: dict[str, Any],
                    resample: int, mean: list[float], std: list[float]) -> ImageSpec:
    """The ImageSpec for an image processor's settings `pp` (Checkpoint.image_processor: either layout): its resample filter, rescale factor, mean and std read as
    transformers reads them (resample, mean, std: the family's image processor's defaults), with the family's tiling
    op and its parameters."""
    return ImageSpec(tiling=tiling, tile_size=tile_size, patch_size=patch_size,
                     resample=resample_name(pp.get("resample", resample)), rescale_factor=pp.get("rescale_factor", 1 / 255),
                     mean=channel_values(pp.get("image_mean", mean)), std=channel_values(pp.get("image_std", std)),
                     params=params)


@dataclass(frozen=True)
class HostSpec:
    """A family's host plan for one checkpoint, read from its processor files; the exporter writes it into the
    manifest (ImageSpec, PromptSpec, SpecialTokens)."""

    image: ImageSpec  # the tiling op (a name in runtime/media/image.py TILING) and its parameters, rescale, normalize
    prompt_expansion: str  # the host op that writes a tile grid as prompt text (runtime/prompt/build.py EXPANSION)
    prompt_params: dict[str, Any]  # its parameters (the image marker tokens)
    image_placeholder: str  # what the rendered chat template holds where the image goes
    image_token_id: int  # the token whose rows the vision graph's embeddings replace
    system_prompt: str | None = None
    # templates that render no image item (OpenGVLab's originals): (placeholder, text put before the prompt)
    image_in_text_fallback: tuple[str, str] | None = None
    video: dict[str, Any] | None = None  # manifest.VideoSpec fields, for a checkpoint whose processor reads videos
    # how the vision graph takes a tile: a host op of runtime/media/tile_inputs.py TILE_INPUTS and its parameters
    tile_inputs: str = "unfold_patches"
    tile_params: dict[str, Any] | None = None
    positions_op: str = "slots"  # the rope positions' host op (runtime/prompt/positions.py POSITION_OPS; "mrope": M-RoPE)
    positions_rows: int = 1  # its rows (the decoder's rope_rows)


class DecoderModule:
    """What the exporter, the quantizer, the GPTQ calibration and the float reference rely on in a family's decoder:
    the base class of every decoder a family builds (beside torch.nn.Module: layers.CausalDecoder, lfm2_vl/language.py
    Lfm2Decoder), its members read as they are (no probing), the defaults below where a decoder has no such part.
    One step over the cache outside the graph, as layers.CausalDecoder's doc says: forward(inputs_embeds [ar, hidden],
    position_ids [rope_rows, ar], [row_input [ar, row_levels * hidden]], [span_ids [ar] int64], *the attention kind's
    step inputs, *state
    per layer (layer_kinds)[, logit_rows [r]]) -> (logits, *new state[, next_token]) (export/decoder_inputs.py builds
    these inputs for the export and the GPTQ calibration alike). `Family.weights` checks the members."""

    layers: Any  # nn.ModuleList, one module per decoder layer, with DECODER_LAYER_WEIGHTS[its kind]
    norm: Any
    lm_head: Any
    rope_rows: int = 1  # position_ids' rows (M-RoPE: 3; HostSpec.positions_rows must agree)
    row_levels: int = 0  # DeepStack: a row_input [ar, row_levels * hidden] after position_ids (0: no such input)
    # span_ids [ar] int64 after them: each row's image span (-1: none), whose rows see each other both ways on the
    # layers the family says (Gemma 4's bidirectional vision attention); a step never splits a span (manifest
    # decoder.span_input)
    span_input: bool = False
    conv_state: tuple[int, int] = (0, 0)  # (width, channels) of a conv layer's window (read only where a layer is "conv")
    # (width, channels, heads, key_dim, value_dim) of a recurrent layer's conv window and state (where one is "recurrent")
    recurrent_state: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    logit_rows: bool = False  # the graph takes logit_rows last and returns those rows' logits (with_options sets it)
    # a static graph of a decoder whose state is not per slot (a "recurrent" layer): it takes valid_rows [ar] last (1:
    # the step's real rows, 0: padding) and keeps that state at the last real row; export_decoder sets it on
    # with_options' copy (only such a decoder reads it)
    valid_rows: bool = False
    # the attention kinds (layers.ATTENTION_KINDS) with_options builds; empty: every one (Qwen3.5's: gqa_in_place)
    attention_kinds: tuple[str, ...] = ()
    window: int = 0  # the keys a sliding_attention layer's query sees (read only where a layer is "sliding_attention")
    # rows of a windowed cache's buffers (export/graphs.py window_capacity sets it where the graph takes one; a
    # decoder with a window then names its sliding layers "windowed_attention"); 0: sliding rows by slot
    window_capacity: int = 0

    def kv_shape(self, i: int) -> tuple[int, int]:
        """(kv_heads, head_dim) of layer i's K/V (an attention layer's self_attn; Gemma 4's full layers differ)."""
        attn = self.layers[i].self_attn
        return attn.kv_heads, attn.head_dim

    def layer_weights(self, i: int) -> tuple[str, ...]:
        """The modules layer i has (DECODER_LAYER_WEIGHTS of its kind; Gemma 4's attention_k_eq_v layers have no
        v_proj: the values are the key projection)."""
        return DECODER_LAYER_WEIGHTS[self.layer_kinds[i]]

    def kv_source(self, i: int) -> int:
        """The layer whose K/V a "shared_kv" layer i reads (only such a decoder has one)."""
        raise NotImplementedError

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's cache kind (manifest.CACHE_LAYER_KINDS: "attention" | "conv"): attention, every one."""
        return ("attention",) * len(self.layers)

    def with_options(self, *, attention: str, logit_rows: bool, rope_positions: int) -> DecoderModule:
        """A new decoder with a copy of these weights, built as a graph of the attention kind (layers.ATTENTION_KINDS)
        with or without the logit_rows input, and a rope table of rope_positions rows."""
        raise NotImplementedError


class VisionModule:
    """What the exporter relies on in a family's vision tower: the base class of every tower a family builds (beside
    torch.nn.Module), its members read as they are, with the defaults of a plain tower below. forward(patches
    [rows, patch_dim], *the extra inputs by role) -> image-token embeddings [tokens, hidden][, *row outputs]."""

    row_outputs: tuple[str, ...] = ()  # outputs after the embeddings, one row per image token each (manifest
    # VisionSpec.row_outputs -> the decoder's row input: Qwen3-VL's DeepStack features); none for a plain tower

    def extra_inputs(self) -> dict[str, tuple[int, ...]]:
        """The inputs after the patch rows, by role (manifest VisionSpec.extra_inputs: a NaFlex tower's position
        weights and key mask), with their shapes; none for a plain tower."""
        return {}

    def example_inputs(self, rows: int, patch_dim: int) -> dict[str, Any]:
        """The inputs by role, "patches" first, as tensors of the graph's shapes: zero patch rows [rows, patch_dim] and
        the extra_inputs() in float32 (a native-resolution tower gives its own: int64 inputs among them, patch rows
        of its own width)."""
        import torch

        return {"patches": torch.zeros(rows, patch_dim), **{r: torch.zeros(s) for r, s in self.extra_inputs().items()}}


class VisionSizes(Protocol):
    patch_size: int  # a tile is unfolded into [patches_per_tile, 3 * patch_size**2] on the host


class FamilyConfig(Protocol):
    """The parts of a family's config dataclass the exporter reads (checked by `Family.config`)."""

    text: TextConfig  # the decoder's shape (families/decoder.py; or a family's own with the fields TEXT_FIELDS names)
    vision: VisionSizes
    patches_per_tile: int  # the vision graph's input rows (one tile)
    tokens_per_tile: int  # its output rows: image tokens per tile
    tie_word_embeddings: bool  # the lm head is the embedding table (an untied one is a weight of its own)


class Weights(NamedTuple):
    """What `load_weights` builds from a checkpoint's tensors (eval mode, float32)."""

    vision: VisionModule  # forward(patches [patches_per_tile, 3*p*p]) -> [tokens_per_tile, text hidden]
    decoder: DecoderModule  # layers.CausalDecoder (families/decoder.py `build` / `load`), or a family's own
    embed: TokenTable  # the token table [vocab, row width] (the host's lookup: embed.npy); load_weights may give a
    # torch tensor (Family.weights wraps it) or a TokenTable of row blocks (a table too large to hold: Gemma 4's)


@dataclass(frozen=True)
class Family:
    """What a family provides. The functions are the family's own; callers use the checked accessors."""

    name: str  # the module's name; written as the manifest's model.family (informational: the runtime never reads it)
    model_types: tuple[str, ...]  # the config.json model types it exports (each one a REGISTRY key naming this module)
    config_from_hf: Callable[[dict[str, Any]], FamilyConfig]  # config.json -> its config dataclass
    load_weights: Callable[[FamilyConfig, Mapping[str, torch.Tensor]], Weights]  # checkpoint tensors -> modules
    host_spec: Callable[[Checkpoint, FamilyConfig, dict], HostSpec]  # (checkpoint, config, tokenizer.json) -> host plan
    default_max_context: Callable[[FamilyConfig, HostSpec], tuple[int, str]]  # -> (max context tokens, why that many)

    def fail(self, what: str) -> FamilyContractError:
        return FamilyContractError(f"family {self.name}: {what} (a bug in vlmrt.families.{self.name}, not in the "
                                   "checkpoint)")

    def config(self, config: dict[str, Any]) -> FamilyConfig:
        from .decoder import TextConfig

        cfg = self.config_from_hf(config)
        text = getattr(cfg, "text", None)
        if not isinstance(text, TextConfig) and not all(_positive(getattr(text, f, None)) for f in TEXT_FIELDS):
            raise self.fail("config_from_hf must give a config whose .text is a families.decoder.TextConfig (or has "
                            f"positive int {', '.join(TEXT_FIELDS)})")
        for field in ("patches_per_tile", "tokens_per_tile"):
            value = getattr(cfg, field, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise self.fail(f"config.{field} must be a positive int, not {value!r}")
        patch = getattr(getattr(cfg, "vision", None), "patch_size", None)
        if not isinstance(patch, int) or patch < 1:
            raise self.fail(f"config.vision.patch_size must be a positive int, not {patch!r}")
        if not isinstance(getattr(cfg, "tie_word_embeddings", None), bool):
            raise self.fail("config.tie_word_embeddings must be a bool")
        return cfg

    def weights(self, cfg: FamilyConfig, tensors: Mapping[str, torch.Tensor]) -> Weights:
        import torch

        from ..format.manifest import CACHE_LAYER_KINDS
        from .token_table import TokenTable

        vision, decoder, embed = self.load_weights(cfg, tensors)
        t = cfg.text
        if not isinstance(decoder, torch.nn.Module) or not isinstance(decoder, DecoderModule) or \
                type(decoder).with_options is DecoderModule.with_options:
            raise self.fail(f"load_weights gave a {type(decoder).__name__} decoder; the exporter traces, quantizes and "
                            "calibrates a families.DecoderModule only (layers.CausalDecoder: build it with "
                            "families/decoder.py; a decoder of the family's own derives from DecoderModule and "
                            "gives its with_options)")
        kinds = decoder.layer_kinds
        if not isinstance(kinds, tuple) or not set(kinds) <= set(CACHE_LAYER_KINDS):
            raise self.fail(f"the decoder's layer_kinds {kinds!r} must be a tuple of {', '.join(CACHE_LAYER_KINDS)}")
        if not _positive(decoder.rope_rows) or not (isinstance(decoder.row_levels, int) and decoder.row_levels >= 0):
            raise self.fail(f"the decoder's rope_rows {decoder.rope_rows!r} must be a positive int and its row_levels "
                            f"{decoder.row_levels!r} an int >= 0")
        names = {n for n, _ in decoder.named_modules()}
        if "lm_head" in names and "norm" in names:  # (else: named below)
            got = (len(decoder.layers), decoder.norm.weight.shape[0], decoder.lm_head.out_features)
            if got != (t.layers, t.hidden, t.vocab):
                raise self.fail(f"the decoder's layers / hidden / vocab {' / '.join(map(str, got))} are not the config's "
                                f"{t.layers} / {t.hidden} / {t.vocab}")
        if len(kinds) != t.layers:
            raise self.fail(f"the decoder's layer_kinds name {len(kinds)} layers, the config {t.layers}")
        want = [f"layers.{i}.{w}" for i in range(len(kinds)) for w in decoder.layer_weights(i)] + list(DECODER_WEIGHTS)
        missing = [w for w in want if w not in names]
        if missing:
            raise self.fail(f"the decoder has no module {missing[0]} (the quantizer finds weights by HF Llama's names)")
        if "conv" in kinds and not (isinstance(decoder.conv_state, tuple) and all(map(_positive, decoder.conv_state))):
            raise self.fail("a decoder with conv layers must give conv_state = (width, channels), positive ints")
        if "recurrent" in kinds and not (isinstance(decoder.recurrent_state, tuple) and len(decoder.recurrent_state) == 5
                                         and all(map(_positive, decoder.recurrent_state))):
            raise self.fail("a decoder with recurrent layers must give recurrent_state = (width, channels, heads, "
                            "key_dim, value_dim), positive ints")
        if isinstance(embed, torch.Tensor):
            embed = TokenTable.of(embed)
        if not isinstance(embed, TokenTable) or tuple(embed.shape) != (t.vocab, t.row_width):
            raise self.fail(f"the embedding table must be a [vocab, row width] = [{t.vocab}, {t.row_width}] tensor, not "
                            f"{tuple(getattr(embed, 'shape', ())) or type(embed).__name__}")
        if not isinstance(vision, torch.nn.Module) or not isinstance(vision, VisionModule):
            raise self.fail(f"load_weights gave a {type(vision).__name__} vision tower, not a torch module derived "
                            "from families.VisionModule")
        example = vision_examples(vision, cfg.patches_per_tile, 3 * cfg.vision.patch_size**2)
        got = _output_shape(vision, *example.values())
        if got != (cfg.tokens_per_tile, t.row_width):
            raise self.fail(f"the vision module maps one tile {list(example['patches'].shape)} "
                            f"to {list(got)}, not [tokens_per_tile, row width] = [{cfg.tokens_per_tile}, {t.row_width}]")
        return Weights(vision, decoder, embed)

    def host(self, ckpt: Checkpoint, cfg: FamilyConfig, tok_json: dict) -> HostSpec:
        from ..runtime.media.image import TILING
        from ..runtime.prompt.build import EXPANSION
        from ..runtime.media.tile_inputs import TILE_INPUTS

        host = self.host_spec(ckpt, cfg, tok_json)
        if not isinstance(host, HostSpec) or not isinstance(host.image, ImageSpec):
            raise self.fail("host_spec must give a HostSpec whose image is a manifest.ImageSpec")
        if host.image.tiling not in TILING:
            raise self.fail(f"tiling {host.image.tiling!r} is not a host op of the runtime ({', '.join(TILING)}; "
                            "runtime/media/image.py TILING)")
        if host.tile_inputs not in TILE_INPUTS:
            raise self.fail(f"tile inputs {host.tile_inputs!r} is not a host op of the runtime ({', '.join(TILE_INPUTS)}; "
                            "runtime/media/tile_inputs.py TILE_INPUTS)")
        from ..runtime.prompt.positions import POSITION_OPS

        if host.positions_op not in POSITION_OPS:
            raise self.fail(f"positions op {host.positions_op!r} is not a host op of the runtime ({', '.join(POSITION_OPS)}; "
                            "runtime/prompt/positions.py POSITION_OPS)")
        if host.prompt_expansion not in EXPANSION:
            raise self.fail(f"prompt expansion {host.prompt_expansion!r} is not a host op of the runtime "
                            f"({', '.join(EXPANSION)}; runtime/prompt/build.py EXPANSION)")
        if host.video is not None:
            from ..runtime.media.video import FRAMES, SAMPLING

            v = host.video
            for what, name, ops, where in (("video sampling", v.get("sampling", "smolvlm"), SAMPLING, "SAMPLING"),
                                           ("video frames", v.get("frames", "square_tile"), FRAMES, "FRAMES")):
                if name not in ops:
                    raise self.fail(f"{what} {name!r} is not a host op of the runtime ({', '.join(ops)}; "
                                    f"runtime/media/video.py {where})")
            if v.get("frame_image") is not None and v["frame_image"].tiling not in TILING:
                raise self.fail(f"the video's frame tiling {v['frame_image'].tiling!r} is not a host op of the runtime "
                                f"({', '.join(TILING)}; runtime/media/image.py TILING)")
        if host.image.patch_size != cfg.vision.patch_size:
            raise self.fail(f"the host unfolds patches of {host.image.patch_size} pixels, the vision tower takes "
                            f"{cfg.vision.patch_size}")
        if not isinstance(host.image_token_id, int) or not 0 <= host.image_token_id < cfg.text.vocab:
            raise self.fail(f"image_token_id {host.image_token_id!r} is not a token of the {cfg.text.vocab}-token vocabulary")
        return host

    def max_context(self, cfg: FamilyConfig, host: HostSpec) -> tuple[int, str]:
        tokens, why = self.default_max_context(cfg, host)
        if not isinstance(tokens, int) or tokens < 2 or not isinstance(why, str):
            raise self.fail(f"default_max_context must give (tokens >= 2, why), not {(tokens, why)!r}")
        return tokens, why


# the fields of a family's text config the exporter reads (families/decoder.py TextConfig has them all)
# (row_width: a token's row in the host's table, the vision graph's output and the decoder's inputs_embeds: hidden,
# or wider where per-layer rows ride beside the embedding, Gemma 4's hidden + layers × per_layer)
TEXT_FIELDS = ("hidden", "heads", "kv_heads", "head_dim", "layers", "intermediate", "vocab", "row_width")


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def vision_examples(vision: VisionModule, rows: int, patch_dim: int) -> dict[str, Any]:
    """The vision module's inputs by role, "patches" first, as tensors of the graph's shapes (what the exporter traces
    with): its example_inputs (VisionModule's default: zero patch rows and its extra_inputs() in float32)."""
    return dict(vision.example_inputs(rows, patch_dim))


def vision_row_outputs(vision: VisionModule) -> list[str]:
    """The vision module's outputs after the image-token embeddings (VisionModule.row_outputs)."""
    return list(vision.row_outputs)


def _output_shape(module, *example) -> tuple[int, ...]:
    """The module's (first) output shape for inputs like `example`, worked out on fake tensors (no compute, no
    memory: the towers of real checkpoints are hundreds of millions of weights)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = module(*(mode.from_tensor(x) for x in example))
        return tuple((out[0] if isinstance(out, tuple) else out).shape)


# what each accessor's function is called with: the arity a Family's functions must take
_ARITY = {"config_from_hf": 1, "load_weights": 2, "host_spec": 3, "default_max_context": 2}


def _checked(module_name: str, module) -> Family:
    """The module's FAMILY, checked against REGISTRY (where a family is registered, the one-line error names it)."""
    fam = getattr(module, "FAMILY", None)
    where = f"vlmrt.families.{module_name}"
    if not isinstance(fam, Family):
        raise FamilyContractError(f"{where} is registered as a family but has no FAMILY = families.Family(...)")
    if fam.name != module_name:
        raise FamilyContractError(f"{where}: FAMILY.name is {fam.name!r}, not its module's name {module_name!r}")
    mine = {t for t, m in REGISTRY.items() if m == module_name}
    if set(fam.model_types) != mine or not mine:
        raise FamilyContractError(f"{where}: FAMILY.model_types {sorted(fam.model_types)} are not the model types "
                                  f"families.REGISTRY sends to it {sorted(mine)}")
    for field, arity in _ARITY.items():
        fn = getattr(fam, field)
        try:
            inspect.signature(fn).bind(*range(arity))
        except (TypeError, ValueError):
            raise FamilyContractError(f"{where}: FAMILY.{field} must be a function of {arity} argument(s)") from None
    return fam


def family_for(config: dict[str, Any]) -> Family:
    """The family that exports a checkpoint's config.json."""
    model_type = config.get("model_type")
    if model_type not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownFamily(f"unknown model type {model_type!r} in config.json; vlmrt exports: {known}")
    name = REGISTRY[model_type]
    return _checked(name, importlib.import_module(f"{__name__}.{name}"))


def registered() -> list[Family]:
    """Every registered family, checked (the conformance test runs over these)."""
    names = sorted(set(REGISTRY.values()))
    return [_checked(n, importlib.import_module(f"{__name__}.{n}")) for n in names]
