"""What `vlmrt serve` (command.py) and its Ray Serve application (ray_app.py) set up from the parsed arguments: the
bundle checked, the load function and the app's Config (prepare), the API keys, the exposure warning."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

from .arguments import check_url_policy


def is_loopback(host: str) -> bool:
    """--host names only loopback addresses (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def exposure_warning(host: str, keys: tuple[str, ...]) -> str | None:
    """The one line `vlmrt serve` prints when it listens beyond loopback without an API key."""
    if keys or is_loopback(host):
        return None
    return (f"vlmrt: warning: listening on {host} (beyond loopback) without --api-key: anyone who can reach the port "
            "can use the model and have it fetch public image URLs")


def _list(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for item in values or () for v in item.split(",") if v.strip())


def api_keys(a) -> tuple[str, ...]:
    from .access import check_key

    if a.api_key:
        return tuple(check_key(k, "--api-key") for k in a.api_key)
    env = os.environ.get("VLMRT_API_KEY")
    return (check_key(env, "VLMRT_API_KEY"),) if env else ()


def prepare(a, bundle: str):
    """(load, config) for parsed arguments a and a bundle folder: load() -> the Scheduler over the bundle (run at
    startup, in a thread), config the app's Config. Bad arguments and an unreadable bundle fail here (ValueError)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ValueError("vlmrt serve needs the serve extra: pip install 'vlmrt[serve]'") from None
    from ..format.manifest import load as load_manifest
    from ..runtime.bundle import Bundle
    from ..runtime.media.sources import FetchLimits
    from ..runtime.media.url_policy import AddressPolicy
    from .app import Config
    from .media import warm_up
    from .scheduler import Scheduler

    sizes_ok = all(math.isfinite(x) for x in (a.max_body_mb, a.image_cache_mb))  # NaN passes the comparisons below
    if not sizes_ok or a.slots < 1 or a.queue < 0 or a.max_images < 1 or a.max_body_mb <= 0 or a.image_cache_mb < 0:
        raise ValueError("--slots, --max-images and --max-body-mb must be > 0, --queue and --image-cache-mb >= 0 "
                         "(finite numbers)")
    if not all(math.isfinite(t) and t > 0 for t in (a.body_timeout, a.head_timeout)) or a.max_connections < 1:
        raise ValueError("--body-timeout and --head-timeout must be finite numbers of seconds > 0, "
                         "--max-connections >= 1")
    pixels = (a.max_request_pixels, a.max_pixels_in_flight)
    if not all(math.isfinite(x) and x > 0 for x in pixels) or a.max_request_pixels > a.max_pixels_in_flight:
        raise ValueError("--max-request-pixels and --max-pixels-in-flight must be numbers of millions of pixels > 0, "
                         "the first at most the second")
    if a.ray is None and (a.replicas != "1" or a.pin_cores):
        raise ValueError("--replicas and --pin-cores serve on Ray: add --ray")
    check_url_policy(a)
    keys = api_keys(a)
    from .access import HostCheck

    allowed_hosts = _list(a.allowed_hosts)
    HostCheck(None, allowed_hosts)  # a malformed entry fails now
    origins = _list(a.cors_origin)
    media = Path(a.media_dir) if a.media_dir else None
    if media is not None and not media.is_dir():
        raise ValueError(f"--media-dir {media}: not a folder")
    from ..runtime.sessions import check_threads
    from ..runtime.decode.cache_row import check_lookahead
    from ..runtime.decode.lookahead import check_exact

    # a missing or unreadable bundle, or a lookahead it cannot verify, fails now, not after the port opens
    check_threads(a.threads)
    m = load_manifest(bundle, verify=False)
    check_lookahead(m.decoder, a.lookahead)
    check_exact(m.graphs["decode"], a.lookahead)
    verify = a.bundle is not None  # the default model's cache was verified by ensure_bundle

    def load():
        import time

        t = time.perf_counter()
        b = Bundle.open(bundle, device=a.device, threads=a.threads, verify=verify)
        warm_up(video=b.manifest.prompt.video is not None)  # before /health turns 200: nothing to import on first use
        # the slots' VLMs get images already decoded; the policy is theirs too, should a URL ever reach one
        return Scheduler(b, a.slots, a.queue, time.perf_counter() - t, pad=not a.no_batch_padding, fetch=fetch,
                         image_cache_bytes=int(a.image_cache_mb * 2**20 / a.slots), lookahead=a.lookahead,
                         allow_special_tokens=a.allow_special_tokens)

    fetch = FetchLimits(addresses=None if a.allow_local_urls else AddressPolicy(), urls=not a.no_image_urls)
    config = Config(model_id=Path(bundle).name, media_dir=media, max_images=a.max_images,
                    max_body=int(a.max_body_mb * 2**20), fetch=fetch, mode=a.mode, body_timeout_s=a.body_timeout,
                    api_keys=keys, host_check=is_loopback(a.host), allowed_hosts=allowed_hosts, cors_origins=origins,
                    head_timeout_s=a.head_timeout, max_connections=a.max_connections,
                    max_request_pixels=max(1, int(a.max_request_pixels * 1e6)),
                    max_pixels_in_flight=max(1, int(a.max_pixels_in_flight * 1e6)), image_spec=m.image)
    return load, config
