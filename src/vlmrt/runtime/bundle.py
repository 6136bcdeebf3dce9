"""A bundle opened for execution: verified manifest, ORT sessions, tokenizer, embedding table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..format import manifest as mf
from ..format.checks import decoder_inputs
from ..format.verify_record import identity
from .decode.decoder_kinds import decoder_kind
from .decode import windowed_state  # noqa: F401  (registers the windowed_attention, sliding_attention and shared_kv kinds)
from .decode.state_kinds import STATE_KINDS, by_kind
from .media.tile_inputs import tile_op
from . import table_rows
from .sessions import Sessions, _graph_files, agree, check_threads
from .weights import EmbeddingRows, SharedWeights, release_freed_heap


def check_numbers(m: mf.Manifest) -> None:
    """The manifest's numbers agree with its own graph specs (which sessions.check_agrees holds to the graph files):
    each cache layer's state inputs (its state kind's shapes in the decoder kind's layout) for the decoder graphs, a tile's patches and
    tokens per tile for the vision graph. A manifest that loads but disagrees would otherwise fail inside ORT, or
    answer from misplaced rows."""
    v = m.graphs["vision"]
    want_in = tile_op(m.vision).patch_shape(m)
    have_in = v.input(m.vision.patches_input).shape
    if m.image.tile_size % m.image.patch_size or not agree(have_in, want_in):
        raise mf.BundleError(f"the manifest's image tile_size {m.image.tile_size} and patch_size {m.image.patch_size} "
                             f"do not fit the vision graph's input {have_in}")
    rows = v.output(m.vision.embeds_output).shape[:1]
    if m.prompt.tokens_per_tile < 1 or not agree(rows, [m.prompt.tokens_per_tile]):
        raise mf.BundleError(f"the manifest's prompt.tokens_per_tile {m.prompt.tokens_per_tile} is not the vision "
                             f"graph's {rows[0] if rows else '?'} rows per tile")
    kv, known = m.kv, set(decoder_inputs(m))
    kind = decoder_kind(m.decoder, kv)
    for name in ("prefill", "decode", "verify"):
        if name not in m.graphs:
            continue
        g = m.graphs[name]
        extra = [t.name for t in g.inputs if t.name not in known]
        if extra:
            raise mf.BundleError(f"graphs.{name} takes inputs that the manifest's decoder and kv do not name: "
                                 f"{', '.join(extra[:3])}")
        for state, layers in by_kind(kv.layers).items():  # each state kind's inputs in the kind's layout
            STATE_KINDS[state].check_graph(layers, g, name, kind.layout, kv.max_context, kind.cache_length(), kind.name)


@dataclass
class Bundle:
    path: Path
    manifest: mf.Manifest
    sessions: Sessions  # graph name -> session, created on first use
    tokenizer: object  # tokenizers.Tokenizer
    embed_table: EmbeddingRows | table_rows.GroupRows | table_rows.PartRows  # [vocab, hidden], indexed by token ids (_token_table)
    embed_scale: np.ndarray | None = None  # [vocab] row scales of an int8 table
    shared: SharedWeights | None = None  # must outlive the sessions: they read its memory
    # the most rows a prefill call should take on the attention kernel the sessions run (Sessions.prefill_rows)
    prefill_rows: int | None = None

    @classmethod
    def open(cls, path: str | Path, device: str = "cpu", threads: int | None = None, verify: bool = True,
             htp_arch: str | int | None = None) -> "Bundle":
        """htp_arch: the device's Hexagon arch, if known (`vlmrt run --htp-arch`): a bundle whose context binaries
        were compiled for another one is refused."""
        from tokenizers import Tokenizer

        check_threads(threads)
        path = Path(path)
        m = mf.load(path, verify=verify)
        check_numbers(m)
        # what was verified, so that a session created later (the vision graph's) checks its files are still those
        verified = {f: identity((path / f).stat()) for f in m.files} if verify else None
        if device == "htp" and m.target.get("name") != "htp":
            raise mf.BundleError(f"this bundle was exported for {m.target.get('name')}; export with --target htp to run on the HTP")
        graphs, config = _graph_files(m, device, htp_arch)
        try:  # first, so that the heap its parse frees is given back before the sessions' peak
            tok = Tokenizer.from_file(str(path / m.tokenizer_file))
        except Exception as e:
            raise mf.BundleError(f"cannot load tokenizer {m.tokenizer_file}: {e}") from None
        release_freed_heap()
        shared = SharedWeights(path) if device != "htp" else None  # the QNN EP compiles its own copy
        sessions = Sessions(path, m, device, threads, shared, graphs, config, verified)
        for name in ("prefill", "head", "decode"):  # every request needs the decoder; the vision graph only an image's
            # (decode loads last: with shared QNN contexts it stops the sharing)
            if name in m.graphs:
                sessions[name]  # noqa: B018 (loads it)
        release_freed_heap()
        table, scale = _token_table(path, m.decoder)
        return cls(path, m, sessions, tok, table, scale, shared, sessions.prefill_rows())


def _token_table(path: Path, d: mf.DecoderSpec):
    """The token table as TokenEmbedding reads it, checked against the manifest: (rows by token id, [vocab] float32
    row scales of an int8 table or None). A grouped table (int8 / int4 codes, a float16 scale per group) is read and
    dequantized per row (table_rows.GroupRows: its scales read per row as well); a table of parts (a split form)
    reads a row's bytes with one pread and dequantizes its parts (table_rows.PartRows)."""
    codes = EmbeddingRows(path / d.embedding_file)
    parts = [(table_rows.form_of(p.dtype, p.group), p.columns) for p in d.embedding_parts or []]
    form = None if parts else table_rows.form_of(d.embedding_dtype, d.embedding_group)
    want = (d.vocab_size, table_rows.row_bytes(parts) if parts else table_rows.code_width(form, d.hidden_size))
    if codes.shape != want:
        raise mf.BundleError(f"embedding table shape {codes.shape} does not match the manifest's {want}")
    if codes.dtype != table_rows.CODE_DTYPES[d.embedding_dtype]:
        raise mf.BundleError(f"embedding table dtype {codes.dtype} is not the manifest's {d.embedding_dtype}")
    if parts:
        return table_rows.PartRows(codes, parts), None
    if not d.embedding_scale_file:
        return codes, None
    if not d.embedding_group:
        scale = np.load(path / d.embedding_scale_file)
        if scale.shape != (d.vocab_size,) or scale.dtype != np.float32:
            raise mf.BundleError(f"{d.embedding_scale_file}: {scale.dtype} {scale.shape}, not float32 ({d.vocab_size},)")
        return codes, scale
    scales = EmbeddingRows(path / d.embedding_scale_file)
    want = (d.vocab_size, table_rows.scale_width(form, d.hidden_size))
    if scales.shape != want or scales.dtype != np.float16:
        raise mf.BundleError(f"{d.embedding_scale_file}: {scales.dtype} {scales.shape}, not float16 {want}")
    return table_rows.GroupRows(codes, scales, form, d.hidden_size), None
