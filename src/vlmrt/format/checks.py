"""The manifest's cross-field checks of the decoder: its tensor names are its graphs', its kind's options fit together
(manifest.load runs them; stdlib only)."""

from __future__ import annotations

from .errors import malformed as _malformed

EMBEDDING_DTYPES = ("float32", "float16", "int8", "int4", "parts")  # DecoderSpec.embedding_dtype
EMBEDDING_GROUPS = {"int8": (None, 64), "int4": (32, 64)}  # DecoderSpec.embedding_group (runtime/table_rows.py FORMS)
PART_GROUPS = {"float32": (None,), "float16": (None,), "int8": (64,), "int4": (32, 64)}  # a TablePart's (dtype, group)


def check_decoder(m) -> None:
    """m: a manifest.Manifest whose sections were read."""
    d, k = m.decoder, m.decoder.kind
    if d.embedding_dtype not in EMBEDDING_DTYPES or d.embedding_dtype.startswith("int") != bool(d.embedding_scale_file):
        raise _malformed(f"decoder.embedding_dtype {d.embedding_dtype[:20]!r} is not one of {', '.join(EMBEDDING_DTYPES)} "
                         "(int8 / int4 with, and only with, an embedding_scale_file)")
    if d.embedding_group not in EMBEDDING_GROUPS.get(d.embedding_dtype, (None,)):
        raise _malformed(f"decoder.embedding_group {d.embedding_group!r} is not one of a {d.embedding_dtype} table's "
                         f"({', '.join(map(str, EMBEDDING_GROUPS.get(d.embedding_dtype, (None,))))})")
    parts = d.embedding_parts or []
    if (d.embedding_dtype == "parts") != bool(parts) or (parts and d.embedding_group):
        raise _malformed("decoder.embedding_parts and embedding_dtype 'parts' go together (no embedding_group)")
    for i, part in enumerate(parts):
        if part.columns < 1 or part.group not in PART_GROUPS.get(part.dtype, ()):
            raise _malformed(f"decoder.embedding_parts[{i}]: {part.columns} columns of {part.dtype[:20]!r} in groups of "
                             f"{part.group} is not a part's form (float32, float16; int8 in groups of 64; int4 of 32 "
                             "or 64)")
    if parts and sum(part.columns for part in parts) != d.hidden_size:
        raise _malformed(f"decoder.embedding_parts' columns sum to {sum(p.columns for p in parts)}, not hidden_size "
                         f"{d.hidden_size}")
    if d.positions.rows < 1:
        raise _malformed("decoder.positions.rows must be at least 1")
    if not m.kv.layers:
        raise _malformed("kv.layers is empty")
    for i, layer in enumerate(m.kv.layers):
        problem = layer.problem()
        if problem:
            raise _malformed(f"kv.layers[{i}]: {problem}")
    k.check(m)  # the kind's own fields (manifest.py: each kind's check)
    parts = k.parts()
    if ("verify" in m.graphs) != (parts.verify_ar > 0) or (parts.verify_ar and parts.verify_ar < 2):
        raise _malformed("graphs.verify and decoder.kind.verify_ar (>= 2, kind rows_static) go together")
    if ("head" in m.graphs) != bool(parts.hidden_output):
        raise _malformed("a head graph and decoder.kind.hidden_output (kind rows_static) go together")
    if parts.verify_ar and parts.hidden_output:
        raise _malformed("a verify graph (decoder.kind.verify_ar) needs every row's logits, which a head graph "
                         "(decoder.kind.hidden_output, one row) does not give")
    check_io_names(m)


def decoder_inputs(m) -> list[str]:
    """Every input a decoder graph (prefill, decode, verify) takes: embeds, positions, the kind's own, the row input,
    the cache's."""
    d = m.decoder
    return [d.embeds_input, d.positions.input, *d.kind.parts().inputs(), *m.kv.state_inputs(),
            *([d.row_input.input] if d.row_input else []), *([d.span_input] if d.span_input else [])]


def check_io_names(m) -> None:
    """Every tensor name the manifest's vision/decoder/kv sections use is an input or output of its graphs."""
    v, d, k = m.vision, m.decoder, m.decoder.kind
    for t in (v.patches_input, *v.extra_inputs.values()):
        m.graphs["vision"].input(t)
    for t in (v.embeds_output, *v.row_outputs):
        m.graphs["vision"].output(t)
    if bool(v.row_outputs) != (d.row_input is not None) or (d.row_input and d.row_input.width != len(v.row_outputs) * d.hidden_size):
        raise _malformed("vision.row_outputs and decoder.row_input (width = outputs × hidden_size) go together")
    parts = k.parts()
    if "head" in m.graphs:
        m.graphs["head"].input(parts.hidden_output or "")
        m.graphs["head"].output(d.logits_output)
    for name, g in m.graphs.items():
        if name in ("vision", "head"):
            continue
        for t in decoder_inputs(m):
            g.input(t)
        for t in (*parts.outputs(d.logits_output), *m.kv.state_outputs()):
            g.output(t)
        shape = g.input(d.positions.input).shape
        if len(shape) != 2 or shape[0] != d.positions.rows:
            raise _malformed(f"graphs.{name}: input {d.positions.input!r} must be [{d.positions.rows}, ar] "
                             f"(decoder.positions.rows), not {shape}")
