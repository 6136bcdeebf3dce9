"""The server's limits on slow and abusive clients, in one place (docs/server.md, "Limits"); the `vlmrt serve`
options that change them say so."""

BODY_TIMEOUT_S = 30.0  # --body-timeout: the whole request body (app.read_body; else 408, connection closed)
HEAD_TIMEOUT_S = 10.0  # --head-timeout: the request line and headers (protocol.py; else 408, connection closed)
HEAD_MAX_BYTES = 16 * 1024  # the request line and headers together (h11's max_incomplete_event_size; else 400)
MAX_CONNECTIONS = 512  # --max-connections: uvicorn's limit_concurrency (connections and requests; past it 503)
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this (uvicorn's timeout_keep_alive)
BACKLOG = 128  # connections the kernel queues before the server accepts them
FETCH_THREADS = 16  # requests whose images include an http(s) URL are decoded on these threads (app.py), so that
# slow URLs never hold the threads that decode the other requests' data URIs
# decoded pixels (serve/pixel_budget.py): a request's images together (--max-request-pixels; over: 413), and every
# request's between its decode and its answer (--max-pixels-in-flight; over: 503 with Retry-After). 64 MP: a 48 MP
# photo, or five 12 MP ones, in one request (Pillow's RGB, 4 bytes a pixel: 256 MB); 256 MP: four such requests
MAX_REQUEST_PIXELS = 64_000_000
MAX_PIXELS_IN_FLIGHT = 256_000_000
