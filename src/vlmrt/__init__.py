"""vlmrt: small vision-language models as static ONNX graphs + a lean host runtime."""

__version__ = "0.1.0"


def load(path, device: str = "cpu", threads: int | None = None, lookahead: int = 0):
    """Open an exported bundle for generation (see vlmrt.runtime.pipeline.VLM); lookahead: draft length of
    lookahead decoding for greedy answers (0 = off)."""
    from .runtime.pipeline import VLM

    return VLM.load(path, device=device, threads=threads, lookahead=lookahead)
