"""`vlmrt export`'s default prefill block (--prefill-ar): the one-graph CPU decoder takes any block from 1 to it (a
symbolic AR, so a larger block costs no bundle size) and prefills long prompts faster in larger blocks
(docs/performance.md "Long prompts"); a fixed-AR prefill graph pads its last block to the full AR and keeps a short one."""

from __future__ import annotations

import pytest

from conftest import CASES, exported

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return exported(CASES[0], tmp_path_factory)


@pytest.mark.parametrize("quant, context_step, max_seq_len, block", [
    (None, None, 320, 128),  # the one-graph decoder: PREFILL_AR["one_graph"]
    (None, None, 96, 96),  # ... at most the max context
    (None, 0, 320, 32),  # static graphs (--context-step 0): PREFILL_AR["fixed_ar"]
    ("prefill=fp32,decode=w8a16", None, 320, 32),  # two graphs, the prefill graph at a fixed AR
])
def test_the_default_prefill_block_is_the_graphs(tiny, quant, context_step, max_seq_len, block):
    from vlmrt.export import pipeline

    prec = pipeline._precisions(quant, "fp32")
    plan = pipeline._plan(str(tiny.ckpt), prec, prefill_ar=None, max_seq_len=max_seq_len, dtype="fp32",
                          context_step=context_step, attention=None, htp=None)
    assert plan.prefill_ar == block and plan.one_graph == (block > 32)
    given = pipeline._plan(str(tiny.ckpt), prec, prefill_ar=8, max_seq_len=max_seq_len, dtype="fp32",
                           context_step=context_step, attention=None, htp=None)
    assert given.prefill_ar == 8  # a given block is kept
