"""A short run of the property-based fuzzing in tests/fuzz_targets.py (derandomized: the same cases every run, a few
seconds per property); benchmarks/fuzz.py is the long run."""

from __future__ import annotations

import json
import shutil

from fuzz_targets import image_property, manifest_property, prepare_bundle_copy, scratch


def test_manifest_loader_works_or_raises_bundle_error(default_bundle):
    original = (default_bundle.bundle / "manifest.json").read_bytes()
    base = json.loads(original)
    root = scratch()
    try:
        manifest_property(base, prepare_bundle_copy(default_bundle.bundle, root / "bundle"), max_examples=150)()
    finally:
        shutil.rmtree(root)
    assert (default_bundle.bundle / "manifest.json").read_bytes() == original  # the fixture other tests use is intact


def test_image_loader_works_or_raises_image_error():
    root = scratch()
    try:
        image_property(root, max_examples=400)()
    finally:
        shutil.rmtree(root)
