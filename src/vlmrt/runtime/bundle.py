"""A bundle opened for execution: verified manifest, ORT sessions, tokenizer, embedding table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import manifest as mf
from .sessions import Sessions, _graph_files, check_threads
from .weights import EmbeddingRows, SharedWeights, release_freed_heap


@dataclass
class Bundle:
    path: Path
    manifest: mf.Manifest
    sessions: Sessions  # graph name -> session, created on first use
    tokenizer: object  # tokenizers.Tokenizer
    embed_table: EmbeddingRows  # [vocab, hidden], indexed by token ids
    embed_scale: np.ndarray | None = None  # [vocab] row scales of an int8 table
    shared: SharedWeights | None = None  # must outlive the sessions: they read its memory

    @classmethod
    def open(cls, path: str | Path, device: str = "cpu", threads: int | None = None, verify: bool = True,
             htp_arch: str | int | None = None) -> "Bundle":
        """htp_arch: the device's Hexagon arch, if known (`vlmrt run --htp-arch`): a bundle whose context binaries
        were compiled for another one is refused."""
        from tokenizers import Tokenizer

        check_threads(threads)
        path = Path(path)
        m = mf.load(path, verify=verify)
        if device == "htp" and m.target.get("name") != "htp":
            raise mf.BundleError(f"this bundle was exported for {m.target.get('name')}; export with --target htp to run on the HTP")
        graphs, config = _graph_files(m, device, htp_arch)
        try:  # first, so that the heap its parse frees is given back before the sessions' peak
            tok = Tokenizer.from_file(str(path / m.tokenizer_file))
        except Exception as e:
            raise mf.BundleError(f"cannot load tokenizer {m.tokenizer_file}: {e}") from None
        release_freed_heap()
        shared = SharedWeights(path) if device != "htp" else None  # the QNN EP compiles its own copy
        sessions = Sessions(path, m, device, threads, shared, graphs, config)
        for name in ("prefill", "head", "decode"):  # every request needs the decoder; the vision graph only an image's
            # (decode loads last: with shared QNN contexts it stops the sharing)
            if name in m.graphs:
                sessions[name]  # noqa: B018 (loads it)
        release_freed_heap()
        table = EmbeddingRows(path / m.decoder.embedding_file)
        if table.shape != (m.decoder.vocab_size, m.decoder.hidden_size):
            raise mf.BundleError(f"embedding table shape {table.shape} does not match the manifest")
        if str(table.dtype) != m.decoder.embedding_dtype:
            raise mf.BundleError(f"embedding table dtype {table.dtype} is not the manifest's {m.decoder.embedding_dtype}")
        scale = np.load(path / m.decoder.embedding_scale_file) if m.decoder.embedding_scale_file else None
        return cls(path, m, sessions, tok, table, scale, shared)
