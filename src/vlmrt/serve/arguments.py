"""`vlmrt serve`'s arguments (add_arguments), apart from the launch (command.py) and the setup from them
(prepare.py), so that the Ray Serve application (ray_app.py) parses a Serve config's arguments as the CLI does."""

from __future__ import annotations

from .limits import (BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_CONNECTIONS, MAX_PIXELS_IN_FLIGHT, MAX_REQUEST_PIXELS)


def add_arguments(s) -> None:
    """The arguments of `vlmrt serve` on parser s."""
    s.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder (default: the offline easy-VQA demo model, exported on first use)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    s.add_argument("--slots", type=int, default=4,
                   help="concurrent conversations, each with its own KV rows and prefix cache; a bundle whose decoder "
                        "takes a batch decodes them together, one decoder call per step (default 4)")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot; more get 503 (default 16)")
    s.add_argument("--media-dir", default=None,
                   help="a folder image_url paths may name (default: none; only data URIs and http(s) URLs)")
    s.add_argument("--max-images", type=int, default=8, help="images per request (default 8)")
    s.add_argument("--max-body-mb", type=float, default=32, help="request body limit in MiB (default 32; over: 413)")
    s.add_argument("--max-request-pixels", type=float, default=MAX_REQUEST_PIXELS / 1e6, metavar="MP",
                   help=f"decoded pixels of one request's images together, in millions, read from their headers "
                        f"before decoding (a large JPEG counts at the size it is decoded to); over: 413 (default "
                        f"{MAX_REQUEST_PIXELS / 1e6:g}; each image also at most 120)")
    s.add_argument("--max-pixels-in-flight", type=float, default=MAX_PIXELS_IN_FLIGHT / 1e6, metavar="MP",
                   help=f"decoded pixels of all requests from their decode to their answer, in millions; a request "
                        f"that would pass it gets 503 with Retry-After (default {MAX_PIXELS_IN_FLIGHT / 1e6:g})")
    s.add_argument("--image-cache-mb", type=float, default=64, help="image embedding cache, all slots (default 64)")
    s.add_argument("--mode", choices=["kv", "hybrid"], default=None,
                   help="prompt feeding (default: the bundle's, hybrid). A follow-up reuses the KV rows of full "
                        "prefill blocks only in hybrid mode, every row in kv mode")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"])
    s.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    s.add_argument("--lookahead", type=int, default=0, metavar="N",
                   help="lookahead decoding of greedy answers, up to N drafted tokens per step (default 0: off)")
    s.add_argument("--no-batch-padding", action="store_true",
                   help="a request decoding alone runs one-row calls even where they round apart from multi-row ones "
                        "(w4a16 everywhere, w4a8 on AVX2-only CPUs; docs/server.md#continuous-batching): faster alone "
                        "(w4a16: 2.6x), but an answer can then depend on the load")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = s.add_argument_group("Ray Serve (docs/server.md#serving-on-ray; pip install 'vlmrt[serve-ray]')")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="serve as a Ray Serve application: replicas of the model behind Serve's HTTP proxy on "
                        "--host/--port, each follow-up routed to the replica holding its conversation; ADDRESS: a "
                        "cluster to join (ray://HEAD:10001, auto), none: a local cluster on 127.0.0.1")
    r.add_argument("--replicas", default="1", metavar="N|MIN..MAX",
                   help="model replicas (each loads the bundle once, runs --slots slots): N, or MIN..MAX to "
                        "autoscale on ongoing requests, --slots per replica (default 1)")
    r.add_argument("--pin-cores", action="store_true",
                   help="pin each replica to its own --threads cores of its node (by its rank there)")
    g = s.add_argument_group("security (docs/server.md#security)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but / and /health (repeatable: any of "
                        "them; default: $VLMRT_API_KEY, which other users cannot see in the process list)")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="HOST[,HOST]",
                   help="Host header values answered besides the loopback names (NAME, NAME:PORT, *.DOMAIN, *): the "
                        "name a reverse proxy passes on. Without it a server bound to loopback answers only "
                        "Host: localhost / *.localhost / 127.x / [::1], any port (DNS rebinding)")
    g.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="grant this origin (https://app.example.com; * for any) CORS, preflight included "
                        "(repeatable; default: none, and browsers' cross-origin requests are refused)")
    url_policy_args(g, "requests'")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="requests' control-token strings (<|im_start|>, <end_of_utterance>, ...) become those tokens, "
                        "as transformers tokenizes them: a client can then forge turns (default: plain text)")
    g.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help=f"a request body must arrive whole within S seconds, else 408 (default {BODY_TIMEOUT_S:g})")
    g.add_argument("--head-timeout", type=float, default=HEAD_TIMEOUT_S, metavar="S",
                   help=f"a request's line and headers must arrive within S seconds, else 408 (default "
                        f"{HEAD_TIMEOUT_S:g})")
    g.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help=f"open connections and requests in progress; past it requests get 503 (default "
                        f"{MAX_CONNECTIONS})")


def url_policy_args(g, whose: str) -> None:
    """--allow-local-urls and --no-image-urls on parser (group) g: the image URL policy of `vlmrt serve`'s requests
    and `vlmrt batch`'s records (runtime/media/url_policy.py); whose: "requests'" / "records'"."""
    g.add_argument("--allow-local-urls", action="store_true",
                   help=f"let {whose} image URLs reach loopback, private and link-local addresses (a trusted "
                        "network; default: public addresses only)")
    g.add_argument("--no-image-urls", action="store_true",
                   help=f"refuse {whose} http(s) image URLs altogether")


def check_url_policy(a) -> None:
    if a.allow_local_urls and a.no_image_urls:
        raise ValueError("--allow-local-urls and --no-image-urls contradict each other")
