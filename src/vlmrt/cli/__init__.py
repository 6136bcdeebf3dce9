"""vlmrt command line: a thin layer over vlmrt.export, vlmrt.runtime and vlmrt.batch.

One module per command (cli/<command>.py: add_parser + run), as serve/command.py."""

from __future__ import annotations

import argparse
import os
import sys

from . import export, run, chat, batch, eval, bench


class Parser(argparse.ArgumentParser):
    """argparse's, with a usage error (an unknown flag, a bad value) in one line, exit status 2; the usage itself is
    --help's. The commands' parsers are of this class too (add_subparsers makes its own class's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="vlmrt", description="Export and run small vision-language models as static ONNX graphs.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    export.add_parser(sub)
    run.add_parser(sub)
    chat.add_parser(sub)
    batch.add_parser(sub)
    eval.add_parser(sub)
    bench.add_parser(sub)
    from ..serve.command import add_parser as add_serve  # argparse only: the server's modules load when it runs
    add_serve(sub)
    from ..web.command import add_parser as add_web  # argparse only, as serve's
    add_web(sub)
    return ap


def _check_utf8(args) -> None:
    """A prompt that is not valid UTF-8 (Python keeps such argv bytes as lone surrogates) is refused up front
    (paths may be any bytes: those are left alone)."""
    prompts = getattr(args, "prompt", None)
    for s in prompts if isinstance(prompts, list) else [prompts]:
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("--prompt is not valid UTF-8") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..format.manifest import BundleError

    # (CheckpointError and ImageError are ValueErrors: importing them here would load the export and PIL for a
    # text-only run)
    expected = (BundleError, ValueError, OSError, KeyError)
    try:
        _check_utf8(args)
        return args.fn(args)
    except KeyboardInterrupt:
        print("vlmrt: interrupted", file=sys.stderr)
        return 130
    except expected as e:
        if os.environ.get("VLMRT_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"vlmrt: error: {msg}", file=sys.stderr)
        return 1

