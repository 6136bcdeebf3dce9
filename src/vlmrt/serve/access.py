"""Who may talk to the server: the Host check (DNS rebinding), CORS, the Origin check, API keys. ASGI middleware
around the Starlette app, outermost first (docs/server.md, "Security"):

    HostCheck   while bound to loopback (or with --allowed-hosts): a Host header that is not a loopback name or
                address (any port: an SSH tunnel's local port differs from the server's), nor an --allowed-hosts
                entry, is a 403. A web page that rebinds its own name to 127.0.0.1 sends its own name as Host, so it
                cannot read the local API.
    Cors        only with --cors-origin: those origins get CORS headers, preflight included (Starlette's
                CORSMiddleware; its refusals answered as JSON errors).
    OriginCheck a request that carries an Origin header (a browser's cross-origin request) is a 403 unless that
                origin is the server's own (the chat page) or an --cors-origin: a page elsewhere cannot make the
                server generate or fetch URLs for it even where it could not read the answer.
    ApiKeys     with --api-key / VLMRT_API_KEY: every route but GET / (the chat page) and /health needs
                `Authorization: Bearer KEY`, else a 401 (OpenAI's error shape). Keys are compared in constant
                time (as SHA-256 digests, so their length does not show either) and never logged.

Before them HeadSize: a request whose line and headers are over HEAD_MAX_BYTES is a 431 (h11 refuses such a head
only when it arrives in pieces).

Each refusal is a JSON {"error": {"message", "type", "code"}} answer; a message quotes at most 100 characters of a
header it refuses.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from .limits import HEAD_MAX_BYTES

OPEN_PATHS = ("/", "/health")  # what ApiKeys lets through without a key (GET and HEAD)
SHOWN = 100


def _refuse(status: int, message: str, type_: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code}}, status_code=status,
                        headers=headers)


def _quote(value: str) -> str:
    return repr(value if len(value) <= SHOWN else value[:SHOWN] + "...")


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header -> (lower-case name or address without brackets or a trailing dot, port or None); None when
    it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] if rest else None
    else:
        name, sep, port = value.rpartition(":")
        if not sep:
            name, port = value, None
        if ":" in name:  # an IPv6 address without brackets
            return None
    if port is not None and not (port.isdigit() and len(port) <= 5 and int(port) <= 65535):
        return None
    name = name.rstrip(".") if name != "." else name
    if not name:
        return None
    return name, int(port) if port is not None else None


def is_loopback_name(name: str) -> bool:
    """localhost, *.localhost (RFC 6761: never sent to DNS) or a loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    return ip.is_loopback or (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
                              and ip.ipv4_mapped.is_loopback)


class HeadSize:
    def __init__(self, app, limit: int = HEAD_MAX_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.limit:
                response = _refuse(431, f"the request line and headers are over the server's limit of {self.limit} "
                                        "bytes", "invalid_request_error", "headers_too_large", {"Connection": "close"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class HostCheck:
    """allowed: --allowed-hosts entries: NAME (any port), NAME:PORT, *.DOMAIN (its subdomains), * (any Host)."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.any = "*" in allowed
        self.names: set[str] = set()
        self.pairs: set[tuple[str, int]] = set()
        self.suffixes: tuple[str, ...] = ()
        for entry in allowed:
            if entry == "*":
                continue
            if entry.startswith("*."):
                self.suffixes += (entry[1:].lower().rstrip("."),)
                continue
            parsed = split_host(entry)
            if parsed is None:
                raise ValueError(f"--allowed-hosts {entry!r}: expected NAME, NAME:PORT, *.DOMAIN or *")
            if parsed[1] is None:
                self.names.add(parsed[0])
            else:
                self.pairs.add(parsed)

    def allows(self, host: str) -> bool:
        parsed = split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        if name in self.names or (name, port) in self.pairs or any(name.endswith(s) for s in self.suffixes):
            return True
        return is_loopback_name(name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        host = Headers(scope=scope).get("host")
        if host is None or not self.allows(host):
            shown = "no Host header" if host is None else f"Host {_quote(host)} is not allowed"
            response = _refuse(403, f"{shown}: this server answers only to its loopback names and addresses "
                                    f"(start it with --allowed-hosts NAME to add a name)", "invalid_request_error",
                               "host_not_allowed")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORSMiddleware for the --cors-origin origins (GET and POST, the Authorization and Content-Type
    headers, Chrome's private-network preflight); a refused preflight is a JSON 400."""

    def __init__(self, app, origins: tuple[str, ...]):
        super().__init__(app, allow_origins=list(origins), allow_methods=["GET", "POST"],
                         allow_headers=["Authorization", "Content-Type"], allow_private_network=True)

    def preflight_response(self, request_headers):
        r = super().preflight_response(request_headers)
        if r.status_code < 400:
            return r
        headers = {k: v for k, v in r.headers.items() if k.lower().startswith(("access-control-", "vary"))}
        what = r.body.decode("utf-8", "replace").removeprefix("Disallowed CORS ")
        return _refuse(400, f"CORS preflight from origin {_quote(request_headers['origin'])} refused ({what}); "
                            "the server grants the origins of its --cors-origin options", "invalid_request_error",
                       "cors_refused", headers)


def _origin_of(value: str) -> str | None:
    """An Origin header's host[:port] (lower case), or None for "null" and anything malformed."""
    try:
        parts = urlsplit(value.strip())
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc or "@" in parts.netloc:
        return None
    return parts.netloc.lower()


class OriginCheck:
    def __init__(self, app, origins: tuple[str, ...] = ()):
        self.app, self.origins, self.any = app, set(origins), "*" in origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or self.any or origin in self.origins:
            return await self.app(scope, receive, send)
        own = _origin_of(origin)
        if own is not None and own == headers.get("host", "").strip().lower():
            return await self.app(scope, receive, send)
        response = _refuse(403, f"Origin {_quote(origin)} is not allowed: not this server's own origin (start it "
                                f"with --cors-origin ORIGIN to let a page elsewhere use it)", "invalid_request_error",
                           "origin_not_allowed")
        await response(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def check_key(key: str, where: str) -> str:
    """A key as given on the command line or in VLMRT_API_KEY: visible ASCII (what a Bearer header can carry)."""
    if not key or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(f"{where}: an API key must be a non-empty string of visible ASCII characters (no spaces)")
    return key


class ApiKeys:
    def __init__(self, app, keys: tuple[str, ...]):
        self.app, self.digests = app, tuple(_digest(k) for k in keys)

    def authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").strip().partition(" ")
        given = _digest(token.strip()) if scheme.lower() == "bearer" else _digest("")
        ok = False
        for d in self.digests:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given, d)
        return ok and scheme.lower() == "bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD")):
            return await self.app(scope, receive, send)
        header = Headers(scope=scope).get("authorization")
        if self.authorized(header):
            return await self.app(scope, receive, send)
        msg = ("You didn't provide an API key: send it as 'Authorization: Bearer KEY'" if not header else
               "Incorrect API key provided")
        response = _refuse(401, msg, "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
