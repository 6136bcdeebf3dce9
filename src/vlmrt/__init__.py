"""vlmrt: small vision-language models as static ONNX graphs + a lean host runtime."""

import os as _os
import sys as _sys
import warnings as _warnings

__version__ = "0.1.0"

# Nothing leaves the machine unless its user asks (docs/limits.md, "No telemetry"). The libraries vlmrt loads that
# report usage by default are told not to here, before any of them is imported: every vlmrt process (the API, every
# command, `vlmrt serve`, Ray's batch workers, `vlmrt web`) imports this package first, and the processes they start
# inherit the environment. A variable the environment already sets is left as it is (setting one is asking).
TELEMETRY_OFF = {
    # onnxruntime's 1DS uploader, on by default in PyPI's builds: looks up mobile.events.data.microsoft.com about
    # 9.5 s after onnxruntime is imported, then every 5-8 s. Read once, when onnxruntime is imported.
    "ORT_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",  # huggingface_hub's usage pings (transformers' loads, `vlmrt export`)
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray's usage reports from a cluster (`vlmrt batch --workers N`)
}
if "onnxruntime" in _sys.modules and "ORT_DISABLE_TELEMETRY" not in _os.environ:
    _warnings.warn("onnxruntime was imported before vlmrt, so its telemetry uploader is already running (vlmrt "
                   "turns off its events; to stop the uploader, set ORT_DISABLE_TELEMETRY=1 before importing "
                   "onnxruntime)", RuntimeWarning, stacklevel=2)
for _name, _value in TELEMETRY_OFF.items():
    _os.environ.setdefault(_name, _value)


def load(path, device: str = "cpu", threads: int | None = None, lookahead: int = 0):
    """Open an exported bundle for generation (see vlmrt.runtime.vlm.VLM); lookahead: draft length of
    lookahead decoding for greedy answers (0 = off)."""
    from .runtime.vlm import VLM

    return VLM.load(path, device=device, threads=threads, lookahead=lookahead)
