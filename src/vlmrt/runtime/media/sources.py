"""Where an image comes from: a file path, an http(s) URL, a `data:image/...;base64,` URI or a PIL image.

    img = read_image("https://example.org/cat.jpg")   # or a path, a data URI, a PIL.Image
    img.digest   # sha256 of the bytes (of the pixels for a PIL image): the image embedding cache's key
    img.image    # RGB PIL image, decoded on first use

Fetching is bounded: a timeout per connection and read, a deadline for the whole fetch (a server that drips its bytes
is cut off), a byte cap, a redirect cap, http(s) only (a redirect elsewhere is refused), and the bytes must decode as
an image. Every failure is one ImageError naming the source; it never quotes what the remote host sent (only an HTTP
status number).

Where the URLs come from someone else (vlmrt serve's clients, vlmrt batch's records), FetchLimits.addresses is an
AddressPolicy (url_policy.py): the host's addresses are checked after DNS resolution and the connection is made to a
checked address, for the URL and for every redirect; URLs with credentials (user:pass@host) and proxies from the
environment are not used then. FetchLimits(urls=False) refuses http(s) URLs altogether. `vlmrt run` and the Python API
fetch any address (FetchLimits() has no policy): the user names their own images there.
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

from .image import (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, SOURCE_SIZE, Header, ImageError, decode_image, is_pil_image,
                    probe_image, to_rgb)
from .url_policy import AddressPolicy

if TYPE_CHECKING:
    from PIL import Image

URL_TIMEOUT_S = 10.0
URL_MAX_BYTES = 32 * 1024 * 1024
URL_MAX_REDIRECTS = 3
URL_TOTAL_S = 30.0
URL_SHOWN = 200  # characters of a URL quoted in a message
_DATA_URI = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?(;[^,;]*)*?;base64,(.*)", re.S)


@dataclass(frozen=True)
class FetchLimits:
    timeout_s: float = URL_TIMEOUT_S
    max_bytes: int = URL_MAX_BYTES
    max_redirects: int = URL_MAX_REDIRECTS
    total_s: float = URL_TOTAL_S  # the whole fetch (give or take one read's timeout_s)
    addresses: AddressPolicy | None = None  # which addresses a URL may reach (None: any; see url_policy.py)
    urls: bool = True  # False: http(s) URLs are refused (vlmrt serve --no-image-urls)
    # decoded pixels of one prompt's images together, and so of each (vlmrt run --max-pixels; docs/limits.md)
    max_pixels: int = MAX_IMAGE_PIXELS


@dataclass
class SourceImage:
    digest: str  # sha256 hex of the source bytes (PIL images: of mode, size and pixels)
    label: str  # for messages: the path, the URL, "data URI", "PIL image"
    data: bytes | None = None
    _image: Image.Image | None = None

    @property
    def image(self) -> Image.Image:
        """The RGB image, decoded whole on first use (an image whose embeddings are cached is never decoded)."""
        return self.decode()

    def header(self, spec=None, max_pixels: int = MAX_IMAGE_PIXELS) -> Header:
        """What decoding it for spec's processor will cost (image.Header; no pixel decoded). An image already
        decoded (a PIL image given) costs nothing: 0 pixels."""
        if self._image is not None:
            return Header(self._image.size, (0, 0), None)
        return probe_image(self.data, self.label, spec, max_pixels)

    def decode(self, spec=None, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
        """The RGB image, decoded on first use; a JPEG that spec's processor shrinks enough is decoded smaller
        (image.draft_request)."""
        if self._image is None:
            self._image = decode_image(self.data, self.label, spec, max_pixels)
            self.data = None
        return self._image


def describe(source) -> str:
    if is_pil_image(source):
        return "PIL image"
    s = str(source)
    return "data URI" if s.startswith("data:") else shown(s)


def shown(url: str) -> str:
    """A URL as messages quote it: at most URL_SHOWN characters."""
    return url if len(url) <= URL_SHOWN else url[:URL_SHOWN] + "..."


def read_image(source, limits: FetchLimits = FetchLimits()) -> SourceImage:
    """An image from a path, an http(s) URL, a data URI or a PIL image (see the module docstring)."""
    if is_pil_image(source):
        # an RGB image as it is (no copy: it is only read); its pixels hashed a strip at a time (not copied whole)
        im = source if source.mode == "RGB" and source.info.get("transparency") is None else to_rgb(source)
        h = hashlib.sha256(f"{im.mode}{im.size}".encode())
        if SOURCE_SIZE in im.info:  # decoded smaller than its source (a JPEG draft): the processor's sizes differ
            h.update(f"{tuple(im.info[SOURCE_SIZE])}".encode())
        rows = max(1, (1 << 22) // (3 * im.width))
        for y in range(0, im.height, rows):
            h.update(im.crop((0, y, im.width, min(y + rows, im.height))).tobytes())
        return SourceImage(h.hexdigest(), "PIL image", _image=im)
    s = str(source)
    if s.startswith("data:"):
        data, label = decode_data_uri(s), "data URI"
    elif re.match(r"(?i)https?://", s):
        if not limits.urls:
            raise ImageError(f"image {shown(s)}: image URLs are turned off here (--no-image-urls); send the image "
                             "as a data URI")
        data, label = fetch_url(s, limits), shown(s)
    elif re.match(r"(?i)[a-z][a-z0-9+.-]*://", s):
        raise ImageError(f"image source {s!r}: only file paths, http(s):// URLs and data:image URIs are supported")
    else:
        label = shown(s)
        data = read_file(Path(s), label, "image", MAX_IMAGE_BYTES, ImageError)
    return SourceImage(hashlib.sha256(data).hexdigest(), label, data)


def read_file(path: Path, label: str, kind: str, max_bytes: int, error: type[ValueError]) -> bytes:
    """A local image or video file's bytes, at most max_bytes; every failure (missing, too big, a name too long, a NUL
    byte, no permission) one `error` naming label."""
    try:
        if not path.is_file():
            raise error(f"{kind} not found: {label}")
        size = path.stat().st_size
        if size > max_bytes:
            raise error(f"{kind} {label} is {size / 2**20:.0f} MiB; vlmrt reads {kind}s up to {max_bytes >> 20} MiB")
        return path.read_bytes()
    except error:
        raise
    except (OSError, ValueError) as e:
        raise error(f"cannot read {kind} {label}: {getattr(e, 'strerror', None) or e}") from None


def decode_data_uri(uri: str) -> bytes:
    m = _DATA_URI.fullmatch(uri.strip())
    if not m or not m.group(1):
        raise ImageError("data URI: expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(re.sub(r"\s+", "", m.group(3)), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URI: bad base64 ({e})") from None


def _opener(limits: FetchLimits, url: str):
    """urllib's opener for one fetch: the redirect cap, and under an address policy connections only to checked
    addresses (http.client's connection factory is the policy's connect) and no proxies from the environment."""
    import http.client
    import urllib.request
    from urllib.parse import urljoin

    class Redirects(urllib.request.HTTPRedirectHandler):
        def __init__(self, limit: int):
            self.limit, self.count = limit, 0

        def http_error_302(self, req, fp, code, msg, headers):  # before urllib's own scheme check (its HTTPError)
            target = headers.get("location") or headers.get("uri") or ""
            if target and not re.match(r"(?i)https?://", urljoin(req.full_url, target.strip())):
                raise ImageError(f"cannot fetch image {shown(url)}: redirected to a non-http(s) URL")
            return super().http_error_302(req, fp, code, msg, headers)

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            self.count += 1
            if self.count > self.limit:
                raise ImageError(f"cannot fetch image {shown(url)}: more than {self.limit} redirects")
            if not re.match(r"(?i)https?://", newurl):
                raise ImageError(f"cannot fetch image {shown(url)}: redirected to a non-http(s) URL")
            if limits.addresses is not None:
                _no_credentials(newurl, url)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    policy = limits.addresses
    if policy is None:
        return urllib.request.build_opener(Redirects(limits.max_redirects))

    def pinned(cls):
        def make(host, **kw):
            conn = cls(host, **kw)
            conn._create_connection = policy.connect  # every connection: resolve once, check, connect to that
            return conn
        return make

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(pinned(http.client.HTTPConnection), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(pinned(http.client.HTTPSConnection), req, context=self._context,
                                check_hostname=self._check_hostname)

    no_proxies = urllib.request.ProxyHandler({})
    return urllib.request.build_opener(no_proxies, HTTP(), HTTPS(), Redirects(limits.max_redirects))


def ascii_url(url: str) -> str:
    """url as http.client can send it: an international host name in its IDNA form (the resolver's name too),
    other characters past ASCII and spaces percent-encoded (as a browser sends them). ValueError if it cannot be."""
    from urllib.parse import quote, urlsplit, urlunsplit

    if url.isascii() and " " not in url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        ascii_host = host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        raise ValueError("the host name is not a valid international domain name") from None
    netloc = parts.netloc.rsplit("@", 1)
    hostport = netloc[-1].lower().replace(host, ascii_host, 1) if not host.isascii() else netloc[-1]
    netloc = "@".join(netloc[:-1] + [hostport])

    def enc(s: str) -> str:
        return re.sub(r"[^\x21-\x7e]", lambda m: quote(m.group(), safe=""), s)

    return urlunsplit((parts.scheme, enc(netloc), enc(parts.path), enc(parts.query), enc(parts.fragment)))


def _no_credentials(target: str, url: str) -> None:
    from urllib.parse import urlsplit

    try:
        userinfo = "@" in (urlsplit(target).netloc or "")
    except ValueError:
        raise ImageError(f"cannot fetch image {shown(url)}: not a valid URL") from None
    if userinfo:
        raise ImageError(f"cannot fetch image {shown(url)}: URLs with credentials (user@host) are refused here")


def fetch_url(url: str, limits: FetchLimits = FetchLimits()) -> bytes:
    """The body of an http(s) GET, at most limits.max_bytes, following at most limits.max_redirects redirects;
    under limits.addresses, only from addresses that policy allows (see the module docstring)."""
    import http.client  # here, not at the top: a run without URLs does not pay for loading them (cold start)
    import urllib.error
    import urllib.request

    cap, start, label = limits.max_bytes, time.monotonic(), shown(url)
    if limits.addresses is not None:
        _no_credentials(url, url)
    try:
        opener = _opener(limits, url)
        headers = {"User-Agent": "vlmrt", "Accept": "image/*"}
        req = urllib.request.Request(ascii_url(url), headers=headers)  # ValueError: a bad URL
        with opener.open(req, timeout=limits.timeout_s) as r:
            size = r.headers.get("Content-Length")
            if size and size.isdigit() and int(size) > cap:
                raise ImageError(f"cannot fetch image {label}: {int(size)} bytes is more than the {cap}-byte limit")
            chunks, n = [], 0
            while n <= cap:
                if time.monotonic() - start > limits.total_s:
                    raise ImageError(f"cannot fetch image {label}: not received within {limits.total_s:g} s")
                c = r.read1(1 << 16)  # what has arrived (at most one socket read): the deadline is checked between
                if not c:
                    break
                chunks.append(c)
                n += len(c)
            data = b"".join(chunks)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:  # the status number only: the reason phrase and body are the remote's text
        raise ImageError(f"cannot fetch image {label}: HTTP {e.code}") from None
    except urllib.error.URLError as e:
        reason = _os(e.reason) if isinstance(e.reason, OSError) else e.reason
        raise ImageError(f"cannot fetch image {label}: {reason}") from None
    except (TimeoutError, OSError, ValueError, http.client.HTTPException) as e:  # read timeouts, resets, malformed URLs
        why = _os(e) if isinstance(e, OSError) else e or type(e).__name__
        raise ImageError(f"cannot fetch image {label}: {why}") from None
    if len(data) > cap:
        raise ImageError(f"cannot fetch image {label}: more than the {cap}-byte limit")
    return data


def _os(e: OSError) -> str:
    """An OSError as one short line: its strerror (and errno), never a raw repr."""
    if isinstance(e, TimeoutError):
        return "timed out"
    if e.strerror:
        return f"[Errno {e.errno}] {e.strerror}" if e.errno else e.strerror
    return str(e) or type(e).__name__
