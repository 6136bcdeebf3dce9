"""vlmrt's sampler against transformers' logits processors: on a fixed logit vector, the frequencies of many seeded
draws match the distribution that transformers' generate samples from (TemperatureLogitsWarper, then
TopKLogitsWarper, then TopPLogitsWarper, the order GenerationMixin._get_logits_processor applies them; then softmax).

The bound: for each token, with p its reference probability and N draws, P(|count/N - p| >= eps) <= delta by
Bernstein's inequality, eps = L/(3N) + sqrt((L/(3N))^2 + 2 p (1 - p) L / N), L = ln(2 / delta). delta is 1e-9 split
over every (config, token) pair (Bonferroni), so the whole test fails by chance with probability under 1e-9 (it is
seeded, so it never flakes at all; the bound says the seed was not picked to pass). Tokens the reference gives
probability 0 must never be drawn. With N = 20,000 eps is about 0.022 at p = 0.25 and 0.01 at p = 0.03: a sampler
that ignores the temperature, applies it after top-p, or top-p before top-k, is many eps off (or draws a token the
reference excludes)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

# 16 logits, unsorted, no ties; a few near each other so that the cut-offs of top-k and top-p fall between them
LOGITS = np.array([1.2, 3.0, -0.5, 2.6, 0.2, 2.2, -3.0, 2.0, 1.5, -1.0, 2.45, 0.5, 1.0, 0.0, -2.0, 1.9], np.float32)
CONFIGS = [
    dict(temperature=0.6),  # temperature alone: sharper than the logits' own softmax
    dict(temperature=1.7, top_k=6),
    dict(temperature=0.7, top_p=0.8),  # the temperature decides top-p's set (fewer tokens than at T = 1)
    dict(temperature=1.5, top_k=8, top_p=0.85),  # top-k first, then top-p over the renormalized 8
]
N = 20_000
DELTA = 1e-9 / (len(CONFIGS) * LOGITS.size)


def reference(temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The probabilities transformers' generate samples from, its warpers built as _get_logits_processor does."""
    procs = lp.LogitsProcessorList()
    if temperature != 1.0:
        procs.append(lp.TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    x = torch.tensor(LOGITS, dtype=torch.float64)[None]
    scores = procs(torch.zeros((1, 1), dtype=torch.long), x)
    return torch.softmax(scores, dim=-1)[0].numpy()


def bernstein_eps(p: np.ndarray, n: int, delta: float) -> np.ndarray:
    L = math.log(2 / delta)
    a = L / (3 * n)
    return a + np.sqrt(a * a + 2 * p * (1 - p) * L / n)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_frequencies_equal_transformers_warpers(cfg):
    want = reference(**cfg)
    assert 2 <= np.count_nonzero(want) <= LOGITS.size  # (a case that samples, and whose cut-offs cut)
    sampler = Sampler(SamplingConfig(seed=1234, **cfg))
    counts = np.bincount([sampler(LOGITS) for _ in range(N)], minlength=LOGITS.size)
    freq = counts / N
    drawn_excluded = [int(i) for i in np.flatnonzero((want == 0) & (counts > 0))]
    assert not drawn_excluded, f"tokens outside transformers' kept set were drawn: {drawn_excluded}"
    eps = bernstein_eps(want, N, DELTA)
    off = np.abs(freq - want)
    assert (off <= eps).all(), {int(i): (round(float(freq[i]), 4), round(float(want[i]), 4), round(float(eps[i]), 4))
                                for i in np.flatnonzero(off > eps)}


def test_the_bound_is_tight_enough_to_tell_the_orders_apart():
    """The alternatives a wrong sampler would sample from are each outside the bound for some token: the test above
    can fail for them (the bound is not vacuous)."""
    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    def top_p_cut(p, top_p):
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(p.size, bool)
        keep[order[np.cumsum(p[order]) - p[order] < top_p]] = True
        q = np.where(keep, p, 0)
        return q / q.sum()

    x = LOGITS.astype(np.float64)
    no_temperature = softmax(x)  # CONFIGS[0] with the temperature ignored
    temperature_after_top_p = top_p_cut(softmax(x), 0.8)  # CONFIGS[2]'s set chosen at T = 1
    p_then_k = top_p_cut(softmax(x / 1.5), 0.85)  # CONFIGS[3] with top-p before top-k
    kth = np.sort(x)[-8]
    p_then_k = np.where(x >= kth, p_then_k, 0)
    p_then_k /= p_then_k.sum()
    for cfg, wrong in ((CONFIGS[0], no_temperature), (CONFIGS[2], temperature_after_top_p), (CONFIGS[3], p_then_k)):
        want = reference(**cfg)
        assert (np.abs(wrong - want) > 2 * bernstein_eps(want, N, DELTA)).any() or ((want == 0) != (wrong == 0)).any()
