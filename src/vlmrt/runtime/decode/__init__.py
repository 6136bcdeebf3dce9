"""Decode and state: sequences and the one scheduler that advances them (sequence.py, scheduler.py), a sequence's
cache rows and calls (cache_row.py), the token embedding (embedding.py), a decoder graph call and its parts (step.py,
step_features.py, decoder_kinds.py), the cache as a container of state kinds (kv_cache.py, state_kinds.py,
cache_layouts.py), sampling, lookahead drafts and the prefix cache (sampler.py, lookahead.py, prefix_cache.py)."""
