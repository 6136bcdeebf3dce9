"""Gemma 4 (E2B / E4B, issue 45; docs/gemma4.md): config.py (the text config both ways configs are written),
language.py (the decoder: sliding-window, full and kv-shared layers, per-layer inputs in the token rows), vision.py
(the tower + embedder as one static graph over a patch budget). Not registered in families.REGISTRY yet: no FAMILY
(host spec, fixture, shared-runner entry) — `vlmrt export` does not take a Gemma 4 checkpoint."""
