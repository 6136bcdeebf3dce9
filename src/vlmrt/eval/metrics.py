"""How close a bundle's next-token distributions are to the reference's (numpy only)."""

from __future__ import annotations

import numpy as np


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray) -> dict:
    """ref/got [positions, vocab] -> first-token match, top-1 agreement, mean KL(ref‖got)."""
    n = min(len(ref), len(got))
    ref, got = ref[:n], got[:n]
    lr, lg = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(-1)
    agree = ref.argmax(-1) == got.argmax(-1)
    return {"positions": n, "first_token_match": bool(agree[0]), "top1": float(agree.mean()), "kl": float(kl.mean()),
            "agree_count": int(agree.sum()), "kl_sum": float(kl.sum())}
