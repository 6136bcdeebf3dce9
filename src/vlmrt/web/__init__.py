"""`vlmrt web`: a bundle as a static site that answers in the browser, on the user's device (docs/browser.md).

    vlmrt web [BUNDLE] --out DIR [--serve [--port P]]

site.py writes the site (the chat page, the JavaScript runtime in static/, its vendored dependencies from
node_modules/, the bundle's files); server.py serves a folder on 127.0.0.1 with the cross-origin isolation headers
WASM threads need; command.py is the CLI. The runtime never imports this package.
"""
