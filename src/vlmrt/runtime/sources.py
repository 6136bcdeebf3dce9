"""Where an image comes from: a file path, an http(s) URL, a `data:image/...;base64,` URI or a PIL image.

    img = read_image("https://example.org/cat.jpg")   # or a path, a data URI, a PIL.Image
    img.digest   # sha256 of the bytes (of the pixels for a PIL image): the image embedding cache's key
    img.image    # RGB PIL image, decoded on first use

Fetching is bounded: a timeout per connection and read, a deadline for the whole fetch (a server that drips its bytes
is cut off), a byte cap, a redirect cap, http(s) only (a redirect elsewhere is refused), and the bytes must decode as
an image. Every failure is one ImageError naming the source.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .image import MAX_IMAGE_BYTES, ImageError, decode_image, is_pil_image, to_rgb

if TYPE_CHECKING:
    from PIL import Image

URL_TIMEOUT_S = 10.0
URL_MAX_BYTES = 32 * 1024 * 1024
URL_MAX_REDIRECTS = 3
URL_TOTAL_S = 30.0
_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?(;[^,;]*)*?;base64,(.*)", re.S)


@dataclass(frozen=True)
class FetchLimits:
    timeout_s: float = URL_TIMEOUT_S
    max_bytes: int = URL_MAX_BYTES
    max_redirects: int = URL_MAX_REDIRECTS
    total_s: float = URL_TOTAL_S  # the whole fetch (give or take one read's timeout_s)


@dataclass
class SourceImage:
    digest: str  # sha256 hex of the source bytes (PIL images: of mode, size and pixels)
    label: str  # for messages: the path, the URL, "data URI", "PIL image"
    data: bytes | None = None
    _image: Image.Image | None = None

    @property
    def image(self) -> Image.Image:
        """The RGB image, decoded on first use (an image whose embeddings are cached is never decoded)."""
        if self._image is None:
            self._image = decode_image(self.data, self.label)
            self.data = None
        return self._image


def describe(source) -> str:
    if is_pil_image(source):
        return "PIL image"
    s = str(source)
    return "data URI" if s.startswith("data:") else s


def read_image(source, limits: FetchLimits = FetchLimits()) -> SourceImage:
    """An image from a path, an http(s) URL, a data URI or a PIL image (see the module docstring)."""
    if is_pil_image(source):
        im = to_rgb(source)
        h = hashlib.sha256(f"{im.mode}{im.size}".encode())
        h.update(im.tobytes())
        return SourceImage(h.hexdigest(), "PIL image", _image=im)
    s = str(source)
    if s.startswith("data:"):
        data, label = decode_data_uri(s), "data URI"
    elif re.match(r"(?i)https?://", s):
        data, label = fetch_url(s, limits), s
    elif re.match(r"(?i)[a-z][a-z0-9+.-]*://", s):
        raise ImageError(f"image source {s!r}: only file paths, http(s):// URLs and data:image URIs are supported")
    else:
        path = Path(s)
        if not path.is_file():
            raise ImageError(f"image not found: {path}")
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ImageError(f"image {path} is {path.stat().st_size / 2**20:.0f} MiB; vlmrt reads images up to "
                             f"{MAX_IMAGE_BYTES >> 20} MiB")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ImageError(f"cannot read image {path}: {e.strerror or e}") from None
        label = str(path)
    return SourceImage(hashlib.sha256(data).hexdigest(), label, data)


def decode_data_uri(uri: str) -> bytes:
    m = _DATA_URI.fullmatch(uri.strip())
    if not m or not m.group(1):
        raise ImageError("data URI: expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(re.sub(r"\s+", "", m.group(3)), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URI: bad base64 ({e})") from None


def fetch_url(url: str, limits: FetchLimits = FetchLimits()) -> bytes:
    """The body of an http(s) GET, at most limits.max_bytes, following at most limits.max_redirects redirects."""
    import http.client  # here, not at the top: a run without URLs does not pay for loading them (cold start)
    import urllib.error
    import urllib.request

    class Redirects(urllib.request.HTTPRedirectHandler):
        def __init__(self, limit: int):
            self.limit, self.count = limit, 0

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            self.count += 1
            if self.count > self.limit:
                raise ImageError(f"cannot fetch image {url}: more than {self.limit} redirects")
            if not re.match(r"(?i)https?://", newurl):
                raise ImageError(f"cannot fetch image {url}: redirected to a non-http(s) URL")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    cap, start = limits.max_bytes, time.monotonic()
    try:
        opener = urllib.request.build_opener(Redirects(limits.max_redirects))
        req = urllib.request.Request(url, headers={"User-Agent": "vlmrt", "Accept": "image/*"})  # ValueError: bad URL
        with opener.open(req, timeout=limits.timeout_s) as r:
            size = r.headers.get("Content-Length")
            if size and size.isdigit() and int(size) > cap:
                raise ImageError(f"cannot fetch image {url}: {int(size)} bytes is more than the {cap}-byte limit")
            chunks, n = [], 0
            while n <= cap:
                if time.monotonic() - start > limits.total_s:
                    raise ImageError(f"cannot fetch image {url}: not received within {limits.total_s:g} s")
                c = r.read1(1 << 16)  # what has arrived (at most one socket read): the deadline is checked between
                if not c:
                    break
                chunks.append(c)
                n += len(c)
            data = b"".join(chunks)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"cannot fetch image {url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise ImageError(f"cannot fetch image {url}: {e.reason}") from None
    except (TimeoutError, OSError, ValueError, http.client.HTTPException) as e:  # read timeouts, resets, malformed URLs
        raise ImageError(f"cannot fetch image {url}: {e or type(e).__name__}") from None
    if len(data) > cap:
        raise ImageError(f"cannot fetch image {url}: more than the {cap}-byte limit")
    return data
