"""`vlmrt serve`: an OpenAI-compatible HTTP server over the conversation API (docs/server.md).

    command.py    the `vlmrt serve` launch (bind, load in the background, uvicorn; --ray: ray_app.py)
    arguments.py  its arguments (the CLI's and a Serve config's)
    prepare.py    what the arguments set up: the bundle checked, the load function, the app's Config, API keys
    app.py        the Starlette app: routes, body limit and deadline, JSON errors, server-sent events
    access.py     who may talk to it: the Host check (DNS rebinding), CORS, the Origin check, API keys
    protocol.py   the HTTP/1.1 connection: uvicorn's h11 protocol with a deadline for each request's head
    limits.py     the limits on slow and abusive clients (timeouts, head size, connections)
    request.py    an OpenAI chat request -> messages + generation options, checked (400s)
    media.py      image_url parts -> decoded images (data URIs, http(s) URLs of public addresses, paths under the
                  media folder)
    scheduler.py  N slots (one VLM each: its own KV and prefix cache) over one bundle's sessions, one thread
    ray_app.py    --ray: the app as a Ray Serve ingress over Model replicas (a Scheduler each), the conversation router
    responses.py  completion objects, stream chunks, usage and the vlmrt timings field
    responses_api.py  POST /v1/responses: the request translated into a chat request; its response and events
    errors.py     APIError: the {"error": {"message", "type", "code"}} answers
    metrics.py    GET /metrics: requests, tokens, latencies, queue and caches in Prometheus' text format
    page.html     the chat page served at / (no build step, no CDN)

Nothing in vlmrt.runtime imports this package; it needs the `serve` extra (starlette, uvicorn, prometheus_client),
--ray the `serve-ray` extra (ray[serve]).
"""
