"""The tiny SmolVLM fixture bundle (conftest CASES[0], exported once per session) as module fixtures, for the test
modules that share it: `tiny` (its conftest.Exported) and `alone` (a VLM of its own over it, one per module: its
answers are an answer given alone). Imported by name where used (test_grammar.py, test_scheduler.py, and through
serve_client.py the server tests and test_logprobs.py)."""

from __future__ import annotations

import pytest

from conftest import CASES, exported
from vlmrt.runtime.vlm import VLM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return exported(CASES[0], tmp_path_factory)


@pytest.fixture(scope="module")
def alone(tiny):
    return VLM.load(tiny.bundle)
