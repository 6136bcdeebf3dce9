"""The manifest's cross-field checks of the decoder: its tensor names are its graphs', its options fit together
(manifest.load runs them; stdlib only)."""

from __future__ import annotations

from .bundle_error import BundleError


def check_decoder(m) -> None:
    """m: a manifest.Manifest whose sections were read."""
    if m.kv.layout not in KV_LAYOUTS:
        raise BundleError(f"bundle KV layout {m.kv.layout[:40]!r} is not known to this vlmrt; upgrade vlmrt")
    d = m.decoder
    if d.embedding_dtype not in EMBEDDING_DTYPES or (d.embedding_dtype == "int8") != bool(d.embedding_scale_file):
        raise BundleError(f"manifest.json is malformed: decoder.embedding_dtype {d.embedding_dtype[:20]!r} is not one of "
                          f"{', '.join(EMBEDDING_DTYPES)} (int8 with, and only with, an embedding_scale_file)")
    if bool(d.token_rows_input) != bool(d.token_scales_input) or (d.token_rows_input and not (
            d.embedding_scale_file and d.dynamic_ar)):
        raise BundleError("manifest.json is malformed: decoder.token_rows_input and token_scales_input go together, "
                          "with an int8 embedding table (embedding_scale_file) and dynamic_ar")
    check_io_names(m)
    if m.decoder.last_logits and not m.decoder.dynamic_ar:
        raise BundleError("manifest.json is malformed: decoder.last_logits needs decoder.dynamic_ar")
    if m.decoder.logit_rows_input and (m.decoder.last_logits or not m.decoder.dynamic_ar):
        raise BundleError("manifest.json is malformed: decoder.logit_rows_input needs dynamic_ar, not last_logits")
    d = m.decoder
    if ("verify" in m.graphs) != (d.verify_ar > 0) or (d.verify_ar and (d.verify_ar < 2 or d.dynamic_ar)):
        raise BundleError("manifest.json is malformed: graphs.verify and decoder.verify_ar (>= 2, static graphs) go "
                          "together")
    if m.decoder.hidden_output and ("head" not in m.graphs or m.decoder.dynamic_ar or m.decoder.argmax_output):
        raise BundleError("manifest.json is malformed: decoder.hidden_output needs a head graph and static decoder "
                          "graphs without argmax_output")
    if "head" in m.graphs and not m.decoder.hidden_output:
        raise BundleError("manifest.json is malformed: a head graph needs decoder.hidden_output")
    if d.verify_ar and d.hidden_output:
        raise BundleError("manifest.json is malformed: a verify graph (decoder.verify_ar) needs every row's logits, "
                          "which a head graph (decoder.hidden_output, one row) does not give")
    if m.kv.layout == "in_place" and (m.kv.heads * m.kv.head_dim != m.kv.dim or m.kv.heads <= 0
                                      or not m.decoder.dynamic_ar):  # (a padded block would land in the cache)
        raise BundleError("manifest.json is malformed: kv.layout in_place needs kv.heads * kv.head_dim = kv.dim "
                          "and decoder.dynamic_ar")


KV_LAYOUTS = ("rows", "in_place")  # KVSpec.layout
EMBEDDING_DTYPES = ("float32", "float16", "int8")  # DecoderSpec.embedding_dtype


def check_io_names(m) -> None:
    """Every tensor name the manifest's vision/decoder/kv sections use is an input or output of its graphs."""
    m.graphs["vision"].input(m.vision.patches_input)
    m.graphs["vision"].output(m.vision.embeds_output)
    if "head" in m.graphs:
        m.graphs["head"].input(m.decoder.hidden_output or "")
        m.graphs["head"].output(m.decoder.logits_output)
    for name, g in m.graphs.items():
        if name in ("vision", "head"):
            continue
        d = m.decoder
        step = (d.seqlens_input, d.total_length_input) if m.kv.layout == "in_place" else (d.positions_input, d.mask_input)
        for t in (d.embeds_input, *step):
            g.input(t or "")
        for t in (d.logit_rows_input, d.token_rows_input, d.token_scales_input):
            if t:
                g.input(t)
        g.output(d.hidden_output or d.logits_output)
        if m.decoder.argmax_output:
            g.output(m.decoder.argmax_output)
        for i in range(m.kv.layers):
            try:
                names = [f.format(layer=i) for f in (m.kv.key_input, m.kv.value_input, m.kv.key_output, m.kv.value_output)]
            except (KeyError, IndexError, ValueError):
                raise BundleError("manifest.json is malformed: kv tensor names must use only {layer}") from None
            g.input(names[0]), g.input(names[1]), g.output(names[2]), g.output(names[3])
