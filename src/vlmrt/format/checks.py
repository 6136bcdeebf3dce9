"""The manifest's cross-field checks of the decoder: its tensor names are its graphs', its kind's options fit together
(manifest.load runs them; stdlib only)."""

from __future__ import annotations

from .errors import BundleError

EMBEDDING_DTYPES = ("float32", "float16", "int8")  # DecoderSpec.embedding_dtype


def _malformed(what: str) -> BundleError:
    return BundleError(f"manifest.json is malformed: {what}")


def check_decoder(m) -> None:
    """m: a manifest.Manifest whose sections were read."""
    d, k = m.decoder, m.decoder.kind
    if d.embedding_dtype not in EMBEDDING_DTYPES or (d.embedding_dtype == "int8") != bool(d.embedding_scale_file):
        raise _malformed(f"decoder.embedding_dtype {d.embedding_dtype[:20]!r} is not one of {', '.join(EMBEDDING_DTYPES)} "
                         "(int8 with, and only with, an embedding_scale_file)")
    if d.positions.rows < 1:
        raise _malformed("decoder.positions.rows must be at least 1")
    if not m.kv.layers:
        raise _malformed("kv.layers is empty")
    for i, layer in enumerate(m.kv.layers):
        if layer.kind == "attention" and (layer.kv_heads <= 0 or layer.head_dim <= 0):
            raise _malformed(f"kv.layers[{i}]: kv_heads and head_dim must be positive")
        if layer.kind == "conv" and (layer.channels <= 0 or layer.width <= 0):
            raise _malformed(f"kv.layers[{i}]: channels and width must be positive")
    if k.name == "gqa_in_place":
        if bool(k.token_rows_input) != bool(k.token_scales_input) or (k.token_rows_input and not d.embedding_scale_file):
            raise _malformed("decoder.kind.token_rows_input and token_scales_input go together, with an int8 embedding "
                             "table (embedding_scale_file)")
    if k.name in ("rows_dynamic", "rows_static") and k.context_step < 0:
        raise _malformed("decoder.kind.context_step must not be negative")
    if k.name == "rows_dynamic" and k.context_step == 0:
        raise _malformed("decoder kind rows_dynamic needs context_step > 0 (symbolic cache length)")
    verify_ar = k.verify_ar if k.name == "rows_static" else 0
    hidden = k.hidden_output if k.name == "rows_static" else None
    if ("verify" in m.graphs) != (verify_ar > 0) or (verify_ar and verify_ar < 2):
        raise _malformed("graphs.verify and decoder.kind.verify_ar (>= 2, kind rows_static) go together")
    if ("head" in m.graphs) != bool(hidden):
        raise _malformed("a head graph and decoder.kind.hidden_output (kind rows_static) go together")
    if verify_ar and hidden:
        raise _malformed("a verify graph (decoder.kind.verify_ar) needs every row's logits, which a head graph "
                         "(decoder.kind.hidden_output, one row) does not give")
    check_io_names(m)


def kind_inputs(k) -> list[str]:
    """The decoder kind's own graph inputs (beside embeds, positions and the cache)."""
    return [n for n in (getattr(k, f, None) for f in ("mask_input", "seqlens_input", "total_length_input",
                                                      "logit_rows_input", "token_rows_input", "token_scales_input")) if n]


def check_io_names(m) -> None:
    """Every tensor name the manifest's vision/decoder/kv sections use is an input or output of its graphs."""
    v, d, k = m.vision, m.decoder, m.decoder.kind
    for t in (v.patches_input, *v.extra_inputs.values()):
        m.graphs["vision"].input(t)
    for t in (v.embeds_output, *v.row_outputs):
        m.graphs["vision"].output(t)
    if bool(v.row_outputs) != (d.row_input is not None) or (d.row_input and d.row_input.width != len(v.row_outputs) * d.hidden_size):
        raise _malformed("vision.row_outputs and decoder.row_input (width = outputs × hidden_size) go together")
    hidden = getattr(k, "hidden_output", None)
    if "head" in m.graphs:
        m.graphs["head"].input(hidden or "")
        m.graphs["head"].output(d.logits_output)
    for name, g in m.graphs.items():
        if name in ("vision", "head"):
            continue
        for t in (d.embeds_input, d.positions.input, *kind_inputs(k), *m.kv.state_inputs(),
                  *([d.row_input.input] if d.row_input else [])):
            g.input(t)
        for t in (hidden or d.logits_output, *([k.argmax_output] if getattr(k, "argmax_output", None) else []),
                  *m.kv.state_outputs()):
            g.output(t)
        shape = g.input(d.positions.input).shape
        if len(shape) != 2 or shape[0] != d.positions.rows:
            raise _malformed(f"graphs.{name}: input {d.positions.input!r} must be [{d.positions.rows}, ar] "
                             f"(decoder.positions.rows), not {shape}")
