"""`vlmrt chat`: an interactive conversation (vlmrt.chat_repl)."""

from __future__ import annotations

from .options import (SPECIAL_TOKENS_HELP, _bundle_or_default, _fetch, _generation_args, _image_arg, _logprobs_arg,
                      _options, _videos, logprobs_table, stats_report)


def add_parser(sub) -> None:
    c = sub.add_parser("chat", help="an interactive conversation (/image PATH|URL, /reset, /stats, /quit)")
    _generation_args(c)
    _image_arg(c)
    c.add_argument("--system", default=None, help="a system message put first")
    c.add_argument("--allow-special-tokens", action="store_true", help=SPECIAL_TOKENS_HELP)
    _logprobs_arg(c, "each turn's, one token a line on stderr after its answer")
    c.set_defaults(fn=run)


def run(a) -> int:
    from ..chat_repl import repl
    from ..runtime.vlm import VLM

    opts, fetch = _options(a), _fetch(a)
    opts["logprobs"] = a.logprobs
    vlm = VLM.load(_bundle_or_default(a.bundle), device=a.device, threads=a.threads, verify=a.bundle is not None,
                   kv_requant=not a.no_kv_requant, htp_arch=a.htp_arch, lookahead=a.lookahead, fetch=fetch,
                   allow_special_tokens=a.allow_special_tokens)
    return repl(vlm, opts, images=a.image or [], videos=_videos(a), system=a.system, report=stats_report,
                logprobs=logprobs_table)
