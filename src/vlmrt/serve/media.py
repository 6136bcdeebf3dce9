"""image_url parts -> decoded RGB images, before a request is queued (so that a slow URL never holds the model).

A url is a data:image/...;base64, URI, an http(s) URL (fetched within runtime.sources' limits) or, only when the
server was started with a media folder, a path inside that folder. Every failure is a 400 naming the image (a 413 /
503 over the decoded-pixel budgets: serve/pixel_budget.py).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from ..runtime.conversation import is_unicode
from ..runtime.image import ImageError, TooManyPixels
from ..runtime.sources import FetchLimits, read_image
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


def _local(url: str, media_dir: Path | None) -> str:
    if re.match(r"(?i)[a-z][a-z0-9+.-]*:", url) and not re.match(r"[A-Za-z]:[\\/]", url):
        raise bad_request(f"image url {url[:60]!r}: only data:image URIs, http(s) URLs and media-folder paths",
                          "invalid_image")
    if media_dir is None:
        raise bad_request("image paths are refused: this server was started without --media-dir "
                          "(send a data URI or an http(s) URL)", "invalid_image")
    if not is_unicode(url):
        raise bad_request(f"image path {url!r} is not valid Unicode", "invalid_image")
    root = media_dir.resolve()
    p = (root / url).resolve()
    if not p.is_relative_to(root):
        raise bad_request(f"image path {url!r} is outside the media folder", "invalid_image")
    return str(p)


def load_images(urls: list[str], media_dir: Path | None, limits: FetchLimits, pixels=None):
    """The decoded images, in order (blocking: fetches URLs; run it in a worker thread). pixels: the request's
    Reservation of decoded pixels (serve/pixel_budget.py): every image's header is read, the request's pixels
    reserved (413 / 503 if they cannot be), then the images decoded."""
    sources, heads = [], []
    spec = pixels.budget.spec if pixels is not None else None
    for i, url in enumerate(urls):
        src = url if url.startswith("data:") or re.match(r"(?i)https?://", url) else _local(url, media_dir)
        try:
            sources.append(read_image(src, limits))
            heads.append(sources[-1].header(spec))
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
    """The videos opened (runtime/video.py Clip: fetched, header read; frames are decoded when the model samples them),
    in order (blocking: run it in a worker thread). A folder of frames is refused (a request gives no frame rate)."""
    from ..runtime.video import VideoError, open_source

    out = []
    for i, url in enumerate(urls):
        local = not (url.startswith("data:") or re.match(r"(?i)https?://", url))
        src = _local(url, media_dir) if local else url
        if local and Path(src).is_dir():
            raise bad_request(f"video {i + 1}: a folder of frames cannot be sent (send a video file)", "invalid_image")
        try:
            out.append(open_source(src, None, limits))
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

    return [{"role": m["role"], "content": [part(p) for p in m["content"]] if isinstance(m["content"], list)
             else m["content"]} for m in messages]
