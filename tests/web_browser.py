"""Headless Debian Chromium through Playwright for the browser-runtime tests (tests/test_web*.py): a static folder
served on 127.0.0.1 by vlmrt web's own server, and a page of it. Never `playwright install`: Playwright drives
/usr/bin/chromium (scripts/setup test installs it)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# no GPU here: WASM only. --disable-background-networking etc.: the browser itself makes no requests of its own
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STATIC = Path(__file__).resolve().parents[1] / "src" / "vlmrt" / "web" / "static"


def need_browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (scripts/setup test installs Debian's chromium)")
    return sync_api


# WebGPU on SwiftShader (Chromium's software Vulkan: no GPU here), for the WebGPU experiments only
SWIFTSHADER_WEBGPU = ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--enable-features=Vulkan",
                      "--use-vulkan=swiftshader", "--use-angle=swiftshader"]


@contextlib.contextmanager
def browser(profile: Path, extra_args: tuple[str, ...] = ()):
    """A persistent Chromium profile (its Cache Storage survives a reload, as a user's does)."""
    sync_api = need_browser()
    args = [a for a in CHROMIUM_ARGS if not (extra_args and a == "--disable-gpu")] + list(extra_args)
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield ctx
        finally:
            ctx.close()


@contextlib.contextmanager
def served(folder: Path):
    """folder on http://127.0.0.1:<free port>/ (vlmrt.web.server, with its COOP / COEP headers)."""
    from vlmrt.web.server import serve_in_thread

    srv = serve_in_thread(folder, 0)
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
