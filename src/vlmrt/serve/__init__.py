"""`vlmrt serve`: an OpenAI-compatible HTTP server over the conversation API (docs/server.md).

    command.py    the `vlmrt serve` arguments and launch (bind, load in the background, uvicorn)
    app.py        the Starlette app: routes, body limit, JSON errors, server-sent events
    request.py    an OpenAI chat request -> messages + generation options, checked (400s)
    media.py      image_url parts -> decoded images (data URIs, http(s) URLs, paths under the media folder)
    scheduler.py  N slots (one VLM each: its own KV and prefix cache) over one bundle's sessions, one thread
    responses.py  completion objects, stream chunks, usage and the vlmrt timings field
    errors.py     APIError: the {"error": {"message", "type", "code"}} answers
    page.html     the chat page served at / (no build step, no CDN)

Nothing in vlmrt.runtime imports this package; it needs the `serve` extra (starlette, uvicorn).
"""
