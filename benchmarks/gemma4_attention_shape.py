"""A random Gemma 4 checkpoint at the E2B attention shape (hidden 512, 8 heads of 256, one KV head, window 512, global
head_dim 512, 4 sliding layers and a full one, per-layer inputs 64), built with transformers' own classes through the
tests' fixture (tests/fixtures_gemma4.py): the checkpoint benchmarks/gemma4_window.py and gemma4_bidirectional.py time."""

from __future__ import annotations

import sys
from pathlib import Path


def make_checkpoint(d: Path, max_position_embeddings: int) -> Path:
    """The checkpoint written to d (config.json as transformers saves it); returns d."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torchvision_ops

    torchvision_ops.declare()
    import fixtures_gemma4 as fx

    fx.TEXT = dict(fx.TEXT, hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=1,
                   head_dim=256, num_hidden_layers=5, sliding_window=512, global_head_dim=512,
                   num_global_key_value_heads=1, layer_types=["sliding_attention"] * 4 + ["full_attention"],
                   num_kv_shared_layers=0, hidden_size_per_layer_input=64,
                   max_position_embeddings=max_position_embeddings)
    return fx.make_gemma4_checkpoint(d)
