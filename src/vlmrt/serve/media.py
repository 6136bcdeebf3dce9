"""image_url parts -> decoded RGB images (video_url parts -> opened clips), before a request is queued (so that a slow
URL never holds the model).

A url is a data:image/...;base64, URI, an http(s) URL (fetched within runtime.media.sources' limits) or, only when the
server was started with a media folder, a path inside that folder: a regular file, read here (the decoders get its
bytes, never a path). Every failure is a 400 naming the image (a 413 / 503 over the decoded-pixel budgets:
serve/pixel_budget.py); a path's message quotes the path as the client sent it (at most PATH_SHOWN characters), never
where the media folder is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
from pathlib import Path

from ..runtime.prompt.conversation import is_unicode
from ..runtime.media.image import MAX_IMAGE_BYTES, ImageError, TooManyPixels
from ..runtime.media.sources import FetchLimits, SourceImage, read_image
from .errors import APIError, bad_request


TINY_PNG = ("data:image/png;base64,"  # 1x1, black
            "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGNgYGAAAAAEAAH2FzhVAAAAAElFTkSuQmCC")


def warm_up(video: bool) -> None:
    """Load what the request path imports on first use, before the server says it is ready (the runtime defers them
    for a fast cold start). A fresh server's first requests decode their media in several threads at once, and a
    module one thread is still importing is seen half made by the others: 1 to 6 of the first 16 concurrent image
    requests answered 500 on every fresh server (`partially initialized module 'PIL.Image'`; tests/
    test_serve_startup.py). video: the bundle takes videos (then PyAV too, when installed: +16 MB that a server
    without videos does not load)."""
    from PIL import Image

    Image.init()  # every format's plugin (Image.open loads the common ones on first use, the others when those fail)
    read_image(TINY_PNG, FetchLimits(urls=False)).image  # noqa: B018 (decodes: the whole data-URI path once)
    import http.client  # noqa: F401  (image URLs: sources.fetch_url imports these on first use)
    import urllib.error  # noqa: F401
    import urllib.request  # noqa: F401

    if video:
        with contextlib.suppress(ImportError):  # without PyAV a video file is one 400 naming the extra
            import av  # noqa: F401


MAX_PATH_CHARS = 4096  # a media-folder path longer than this is refused unread (PATH_MAX)
PATH_SHOWN = 80  # characters of a client's path quoted in a message
# why an OS call on a media-folder path failed, said in the client's terms (never the folder's own path)
_OS_WHY = {errno.ENOENT: "not found", errno.ENOTDIR: "not found (a part of the path is not a folder)",
           errno.ELOOP: "a symbolic link loop", errno.ENAMETOOLONG: "the path or a name in it is too long",
           errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def _said(url: str) -> str:
    """A client's path as messages quote it: its repr (control characters escaped), at most PATH_SHOWN characters."""
    r = repr(url)
    return r if len(r) <= PATH_SHOWN else r[:PATH_SHOWN] + "..."


def _local(url: str, media_dir: Path | None, kind: str = "image") -> Path:
    """The path in the media folder that url names (symbolic links resolved; refused unless inside the folder)."""
    if re.match(r"(?i)[a-z][a-z0-9+.-]*:", url) and not re.match(r"[A-Za-z]:[\\/]", url):
        raise bad_request(f"{kind} url {url[:60]!r}: only data:{kind} URIs, http(s) URLs and media-folder paths",
                          "invalid_image")
    if media_dir is None:
        raise bad_request(f"{kind} paths are refused: this server was started without --media-dir "
                          "(send a data URI or an http(s) URL)", "invalid_image")
    if not is_unicode(url):
        raise bad_request(f"{kind} path {_said(url)} is not valid Unicode", "invalid_image")
    if "\x00" in url:
        raise bad_request(f"{kind} path {_said(url)} holds a NUL byte", "invalid_image")
    if len(url) > MAX_PATH_CHARS:
        raise bad_request(f"{kind} path {_said(url)} is {len(url)} characters; at most {MAX_PATH_CHARS}",
                          "invalid_image")
    root = media_dir.resolve()
    try:  # strict: a loop, a missing or too long part is an error here (non-strict, a loop was left unresolved and
        # the rest of the path joined on as text: 'loop/../link_out' then passed the check below and was read)
        p = Path(os.path.realpath(root / url, strict=True))
    except OSError as e:
        raise bad_request(f"{kind} path {_said(url)}: {_os_why(e)}", "invalid_image") from None
    if not p.is_relative_to(root):
        raise bad_request(f"{kind} path {_said(url)} is outside the media folder", "invalid_image")
    return p


def _os_why(e: OSError) -> str:
    return _OS_WHY.get(e.errno, e.strerror or type(e).__name__)


def _read_local(url: str, media_dir: Path | None, kind: str, max_bytes: int) -> bytes:
    """The bytes of a regular file in the media folder, at most max_bytes; every failure a 400 quoting url only."""
    p = _local(url, media_dir, kind)
    root = media_dir.resolve()

    def refuse(why: str):
        return bad_request(f"{kind} path {_said(url)}: {why}", "invalid_image")

    try:
        st = os.stat(p)
        if stat.S_ISDIR(st.st_mode):
            raise refuse("a folder of frames cannot be sent (send a video file)" if kind == "video" else "a folder")
        if not stat.S_ISREG(st.st_mode):
            raise refuse("not a regular file")
        # O_NONBLOCK: a FIFO swapped in after the stat does not block the open; fstat checks what was opened
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise refuse("not a regular file")
            opened = f"/proc/self/fd/{f.fileno()}"  # what was opened, should a link have changed since the check
            if os.path.exists(opened) and not Path(os.readlink(opened)).is_relative_to(root):
                raise bad_request(f"{kind} path {_said(url)} is outside the media folder", "invalid_image")
            if st.st_size > max_bytes:
                raise refuse(f"{st.st_size / 2**20:.0f} MiB; this server reads {kind}s up to {max_bytes >> 20} MiB")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise refuse(_os_why(e)) from None
    if len(data) > max_bytes:
        raise refuse(f"over {max_bytes >> 20} MiB; this server reads {kind}s up to {max_bytes >> 20} MiB")
    return data


def load_images(urls: list[str], media_dir: Path | None, limits: FetchLimits, pixels=None):
    """The decoded images, in order (blocking: fetches URLs; run it in a worker thread). pixels: the request's
    Reservation of decoded pixels (serve/pixel_budget.py): every image's header is read, the request's pixels
    reserved (413 / 503 if they cannot be), then the images decoded."""
    sources, heads = [], []
    spec = pixels.budget.spec if pixels is not None else None
    for i, url in enumerate(urls):
        try:
            if url.startswith("data:") or re.match(r"(?i)https?://", url):
                src = read_image(url, limits)
            else:
                data = _read_local(url, media_dir, "image", MAX_IMAGE_BYTES)
                src = SourceImage(hashlib.sha256(data).hexdigest(), _said(url), data)
            sources.append(src)
            heads.append(src.header(spec))
        except TooManyPixels as e:
            raise APIError(413, f"image {i + 1}: {e}", "invalid_request_error", "image_too_large") from None
        except ImageError as e:
            raise bad_request(f"image {i + 1}: {e}", "invalid_image") from None
    if pixels is not None and sources:
        pixels.take([h.pixels for h in heads], [h.size for h in heads])
    out = []
    for i, s in enumerate(sources):
        try:
            out.append(s.decode(spec))
        except ImageError as e:
            raise bad_request(f"image {i + 1}: {e}", "invalid_image") from None
    return out


def load_videos(urls: list[str], media_dir: Path | None, limits: FetchLimits) -> list:
    """The videos opened (runtime/media/video.py Clip: fetched, header read; frames are decoded when the model samples them),
    in order (blocking: run it in a worker thread). A folder of frames is refused (a request gives no frame rate)."""
    from ..runtime.media.video import MAX_VIDEO_BYTES, VideoError, open_source, read_video

    out = []
    for i, url in enumerate(urls):
        try:
            if url.startswith("data:") or re.match(r"(?i)https?://", url):
                out.append(open_source(url, None, limits))
            else:  # read here, so that only bytes (never a path) reach the decoder
                out.append(read_video(None, None, _read_local(url, media_dir, "video", MAX_VIDEO_BYTES), _said(url)))
        except (VideoError, ImageError) as e:
            raise bad_request(f"video {i + 1}: {e}", "invalid_image") from None
    return out


def with_images(messages: list[dict], images: list, videos: list = ()) -> list[dict]:
    """messages with each image_url part replaced, in order, by {"type": "image", "image": <decoded image>} and each
    video_url part by {"type": "video", "video": <opened clip>}."""
    it, vit = iter(images), iter(videos)

    def part(p):
        if p.get("type") == "image_url":
            return {"type": "image", "image": next(it)}
        if p.get("type") == "video_url":
            return {"type": "video", "video": next(vit)}
        return p

    return [{**m, "content": [part(p) for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
            for m in messages]
