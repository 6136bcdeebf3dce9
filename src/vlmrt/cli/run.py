"""`vlmrt run`: one answer to a prompt with images, or to a conversation's next turn (--messages)."""

from __future__ import annotations

import json
import sys

from .options import (SPECIAL_TOKENS_HELP, _bundle_and_build, _fetch, _generation_args, _grammar, _grammar_args,
                      _image_arg, _logprobs_arg, _options, _videos, logprobs_table, stats_report)


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="ask a question about images or a video, or answer a conversation's next turn")
    _generation_args(r)
    _image_arg(r)
    r.add_argument("--prompt", default=None, help="the question (one user turn: the --image images, then this text)")
    r.add_argument("--messages", default=None, metavar="CONV.json",
                   help="a conversation: a JSON list of OpenAI-style messages (system / user / assistant; content a "
                        "string or text / image_url / video_url parts); answers the next assistant turn")
    r.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, prompt_tokens, stats)")
    r.add_argument("--allow-special-tokens", action="store_true", help=SPECIAL_TOKENS_HELP)
    _grammar_args(r)
    _logprobs_arg(r, "one token a line on stderr before the report (the answer stays stdout's alone; with --json: the "
                     "object's logprobs, OpenAI's shape)")
    r.set_defaults(fn=run)


def run(a) -> int:
    from ..runtime.prompt.conversation import user_turn
    from ..runtime.vlm import VLM

    if (a.messages is None) == (a.prompt is None):
        raise ValueError("give --prompt (with --image / --video ...) or --messages CONV.json")
    if a.messages is not None:
        if a.image or a.video:
            raise ValueError("--messages carries its images and videos (image_url / video_url parts); --image and "
                             "--video do not apply")
        from ..runtime.prompt.conversation import load_messages

        messages = load_messages(a.messages)
    else:
        messages = user_turn(a.prompt, a.image or [], _videos(a))
    opts, fetch = _options(a), _fetch(a)
    opts["response_format"], opts["logprobs"] = _grammar(a), a.logprobs
    # the default model's cache was verified (every file's sha256) by ensure_bundle just now
    if a.htp_arch is not None and a.device != "htp":
        raise ValueError("--htp-arch is for --device htp")
    # the default model's first use builds it in a process of its own: the stats (peak RSS included) stay the answer's,
    # the build's figures are reported beside them
    bundle, build = _bundle_and_build(a.bundle)
    vlm = VLM.load(bundle, device=a.device, threads=a.threads, verify=a.bundle is not None,
                   kv_requant=not a.no_kv_requant, htp_arch=a.htp_arch, lookahead=a.lookahead, fetch=fetch,
                   allow_special_tokens=a.allow_special_tokens)
    # a one-shot run: nothing to reuse, the same as generate(); a bad grammar fails here, before any pixel is read
    if opts["response_format"] is not None:
        vlm.grammars.compile(opts["response_format"])
    gen = vlm.chat(messages, **opts)
    if a.json:
        for _ in gen:
            pass
        out = vlm.result.to_dict()
        if build is not None:
            out["first_use_build"] = build.to_dict()
        print(json.dumps(out))
    else:
        for piece in gen:
            print(piece, end="", flush=True)
        print(flush=True)  # the answer's line ends before the report (stderr) when both go to one pipe
        if vlm.result.logprobs is not None:
            print(logprobs_table(vlm.result.logprobs), file=sys.stderr)
        print(stats_report(vlm.result, build), file=sys.stderr)
    return 0
