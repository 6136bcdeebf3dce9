"""`vlmrt chat`: an interactive conversation over VLM.chat, one line per user turn.

    /image PATH|URL   attach an image to the next turn (repeatable)
    /video PATH|URL   attach a video to the next turn (SmolVLM2 and Gemma 4 bundles; a folder of frames: --fps on the command line)
    /reset            start a new conversation (the caches stay: a repeated image is not encoded again)
    /stats            the last turn's statistics in full
    /quit             leave (so does end of input)
Answers stream to stdout; a one-line summary of each turn (reused tokens, vision skipped, TTFT) goes to stderr, after
the turn's log probabilities when `--logprobs N` asks for them.
"""

from __future__ import annotations

import sys

from .format.manifest import BundleError
from .runtime.prompt.conversation import VideoSource
from .runtime.media.image import ImageError

HELP = "commands: /image PATH|URL, /video PATH|URL (attach to the next turn), /reset, /stats, /quit"


def summary(s) -> str:
    vision = "skipped (cached)" if s.vision_skipped else f"{s.vision_s:.2f} s" if s.images else "-"
    return (f"[{s.prompt_tokens} prompt tokens, {s.reused_prompt_tokens} reused; vision {vision}; "
            f"first token {s.ttft_s:.2f} s; {s.generated_tokens} tokens"
            f"{f', {s.decode_tokens_per_s:.1f} tok/s' if s.generated_tokens > 1 else ''}; "
            f"stop: {s.stop_reason}]")


def repl(vlm, options: dict, images: list[str] = (), system: str | None = None, report=None, stdin=None,
         stdout=None, stderr=None, videos: list = (), logprobs=None) -> int:
    """Run the loop until /quit or end of input; report(result) -> text for /stats; logprobs(entries) -> text after
    each turn's answer (on stderr) when the options ask for them. images, videos (VideoSource): attached to the first
    turn."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if stdin is None:  # started with standard input closed (`<&-`): as an empty input
        return 0
    interactive = hasattr(stdin, "isatty") and stdin.isatty()

    def fresh():
        return [{"role": "system", "content": system}] if system else []

    messages, pending, pending_videos = fresh(), list(images), list(videos)
    fps = next((v.fps for v in videos if v.fps is not None), None)  # --fps: for folders given by /video too
    last = None  # the last answered turn's result (a failed turn leaves vlm.result half made)
    print(HELP, file=stderr)
    while True:
        if interactive:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd == "/quit":
                return 0
            if cmd == "/reset":
                messages, pending, pending_videos = fresh(), [], []
                print("[new conversation]", file=stderr)
            elif cmd == "/image" and arg.strip():
                pending.append(arg.strip())
                print(f"[image {len(pending)} attached to the next turn]", file=stderr)
            elif cmd == "/video" and arg.strip():
                pending_videos.append(VideoSource(arg.strip(), fps))
                print(f"[video {len(pending_videos)} attached to the next turn]", file=stderr)
            elif cmd == "/stats" and last is None:
                print("[no turn answered yet]", file=stderr)
            elif cmd == "/stats":
                print(report(last) if report else last.stats, file=stderr)
                print(f"caches: {vlm.cache_bytes()}", file=stderr)
            else:
                print(HELP, file=stderr)
            continue
        content = ([{"type": "video", "video": v.source, "fps": v.fps} for v in pending_videos]
                   + [{"type": "image_url", "image_url": {"url": p}} for p in pending] + [{"type": "text", "text": line}])
        turn = messages + [{"role": "user", "content": content}]
        try:
            pieces = []
            for piece in vlm.chat(turn, **options):
                pieces.append(piece)
                print(piece, end="", file=stdout, flush=True)
            print(file=stdout, flush=True)
        except (ImageError, BundleError, ValueError, OSError) as e:
            # the turn is dropped (its images too): the conversation goes on as before it
            print(f"vlmrt: error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=stderr)
            pending, pending_videos = [], []
            continue
        last = vlm.result
        messages = turn + [{"role": "assistant", "content": last.text}]
        pending, pending_videos = [], []
        if last.logprobs is not None and logprobs is not None:
            print(logprobs(last.logprobs), file=stderr)
        print(summary(vlm.result.stats), file=stderr)
