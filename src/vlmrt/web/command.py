"""`vlmrt web [BUNDLE] --out DIR [--force] [--webgpu] [--serve [--port P]]`: write the static site (site.py), and serve it."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    w = sub.add_parser("web", help="a static site that answers with the bundle in the browser, on the user's device "
                                   "(docs/browser.md)")
    w.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder (default: the offline easy-VQA demo model, exported on first use)")
    w.add_argument("--out", required=True, metavar="DIR", help="the site's folder to write")
    w.add_argument("--force", action="store_true", help="replace DIR if it exists")
    w.add_argument("--webgpu", action="store_true",
                   help="also ship onnxruntime-web's WebGPU build (27 MB); the page uses it with ?ep=webgpu "
                        "(experimental: docs/browser.md#webgpu)")
    w.add_argument("--serve", action="store_true",
                   help="also serve DIR on 127.0.0.1 with the COOP / COEP headers WASM threads need (Ctrl-C stops)")
    w.add_argument("--port", type=int, default=8000, help="--serve: the port (default 8000; 0 = any free port)")
    w.set_defaults(fn=run)


def run(a) -> int:
    from .server import make_server
    from .site import vendor_sources, write_site

    vendor_sources(a.webgpu)  # missing npm packages: said before the default model's first-use build, not after
    server = make_server(a.out, a.port) if a.serve else None  # a taken port fails before the site is written
    try:
        if a.bundle is None:
            from ..demo.default_model import ensure_bundle

            bundle = ensure_bundle(progress=True)
        else:
            bundle = a.bundle
        out = write_site(bundle, a.out, force=a.force, webgpu=a.webgpu)
        print(out)
        if server is None:
            return 0
        host, port = server.server_address[:2]
        print(f"vlmrt: serving {out} at http://{host}:{port}/ (Ctrl-C stops)", file=sys.stderr, flush=True)
        server.serve_forever()
    finally:
        if server is not None:
            server.server_close()
    return 0
