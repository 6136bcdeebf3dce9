"""The test side of each family's registration: for every family in vlmrt.families.REGISTRY, the tiny checkpoints
the shared runner (test_family_conformance.py) exports and compares with transformers, and how transformers runs
them (oracle.OracleFamily). A family registered in vlmrt but missing here fails test_every_registered_family_is_tested.

SmolVLM's cases (conftest.CASES, conftest.exported) stay in conftest, where most tests take them from; InternVL's are
here (test_internvl.py and the tests that cover both families import them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import conftest
from conftest import Exported, export_once


@dataclass(frozen=True)
class Case:
    """An InternVL checkpoint shape: decoder (Qwen2 / Qwen3), tied head, tile / patch sizes, max tiles, vision norm."""

    name: str
    decoder: str
    tie: bool
    image_size: int
    patch: int
    max_tiles: int
    prefill_ar: int
    vision_norm: str = "layer_norm"
    vision_overrides: tuple = ()


CASES = [
    Case("internvl3-qwen2-untied", "qwen2", tie=False, image_size=28, patch=7, max_tiles=6, prefill_ar=16),
    Case("internvl3.5-qwen3-tied", "qwen3", tie=True, image_size=56, patch=7, max_tiles=4, prefill_ar=32),
    Case("qwen3-rmsnorm-vit-qknorm", "qwen3", tie=False, image_size=28, patch=7, max_tiles=12, prefill_ar=8,
         vision_norm="rms_norm", vision_overrides=(("use_qk_norm", True),)),
]


def exported(case: Case, tmp_path_factory, nested: dict | None = None) -> Exported:
    """An InternVL case's checkpoint, exported once per test session."""
    from fixtures_internvl import INTERNVL, make_internvl_checkpoint

    def make(folder):
        return make_internvl_checkpoint(
            folder, decoder=case.decoder, tie_word_embeddings=case.tie, image_size=case.image_size,
            patch_size=case.patch, max_tiles=case.max_tiles, vision_norm=case.vision_norm,
            vision_overrides=dict(case.vision_overrides), seed=CASES.index(case) + 3,  # per case, not per test order
        )

    return export_once(case, tmp_path_factory, make, INTERNVL, nested, prefill_ar=case.prefill_ar)


@dataclass(frozen=True)
class Lfm2Case:
    """An LFM2-VL checkpoint shape: its layer_types (conv / full_attention), the decoder kind the export takes
    (attention gqa: gqa_in_place, portable: rows_dynamic; context_step 0: rows_static), prefill AR (blocks that cut
    the conv windows), tied head, and the checkpoint's other options."""

    name: str
    layer_types: tuple[str, ...]
    prefill_ar: int
    attention: str | None = None
    context_step: int | None = None
    tie: bool = True
    options: tuple = ()


LFM2_CASES = [
    # two conv layers in a row, a conv layer last; the CPU default kind (GroupQueryAttention beside the conv rows)
    Lfm2Case("lfm2-conv-attn-conv-conv-gqa", ("conv", "full_attention", "conv", "conv"), prefill_ar=8),
    # attention first and last, conv biases, an untied head; rows_dynamic
    Lfm2Case("lfm2-attn-conv-conv-attn-conv-rows", ("full_attention", "conv", "conv", "full_attention", "conv"),
             prefill_ar=5, attention="portable", tie=False, options=(("conv_bias", True),)),
    # LFM2's adjusted FFN width; static graphs (rows_static: a padded last block)
    Lfm2Case("lfm2-conv-conv-attn-static", ("conv", "conv", "full_attention"), prefill_ar=16, context_step=0,
             options=(("auto_adjust_ff", True), ("intermediate", 192))),
]


def lfm2_exported(case: Lfm2Case, tmp_path_factory, nested: dict | None = None) -> Exported:
    """An LFM2-VL case's checkpoint, exported once per test session."""
    from fixtures_lfm2_vl import LFM2_VL, make_lfm2_vl_checkpoint

    def make(folder):
        return make_lfm2_vl_checkpoint(folder, layer_types=case.layer_types, tie_word_embeddings=case.tie,
                                       seed=LFM2_CASES.index(case), **dict(case.options))

    return export_once(case, tmp_path_factory, make, LFM2_VL, nested, prefill_ar=case.prefill_ar,
                       attention=case.attention, context_step=case.context_step)


@dataclass(frozen=True)
class QwenCase:
    """A Qwen-VL checkpoint (tests/fixtures_qwen.py TINY[kind]): Qwen2.5-VL (windows, Qwen2 decoder) or Qwen3-VL
    (DeepStack, Qwen3 decoder), prefill blocks of prefill_ar, the decoder kind the export takes (attention None / gqa:
    gqa_in_place, M-RoPE's rows gathered before the op; portable: rows_dynamic)."""

    name: str
    kind: str
    prefill_ar: int
    seed: int  # weights whose 24-token answers are not degenerate on the runner's images (measured)
    attention: str | None = None
    layer_types: tuple[str, ...] = ()  # Qwen3.5: text_config.layer_types (empty: fixtures_qwen.TINY's)


QWEN_CASES = [QwenCase("qwen2.5-vl", "qwen2_5_vl", prefill_ar=16, seed=11),
              QwenCase("qwen3-vl", "qwen3_vl", prefill_ar=16, seed=16),
              # the same weights as the first, on the host-written rows contract
              QwenCase("qwen2.5-vl-rows", "qwen2_5_vl", prefill_ar=16, seed=11, attention="portable"),
              # Qwen3.5: Gated DeltaNet layers beside gated attention (fixtures_qwen.TINY: linear, full, linear,
              # linear), blocks of 8 that cut the images and carry the recurrent state across many blocks
              QwenCase("qwen3.5", "qwen3_5", prefill_ar=8, seed=3),
              # the same weights on the host-written rows contract (rows_dynamic: --attention portable)
              QwenCase("qwen3.5-rows", "qwen3_5", prefill_ar=8, seed=3, attention="portable"),
              # two DeltaNet layers first and attention last, blocks of 5
              QwenCase("qwen3.5-lla", "qwen3_5", prefill_ar=5, seed=4,
                       layer_types=("linear_attention", "linear_attention", "full_attention"))]


def qwen_exported(case: QwenCase, tmp_path_factory, nested: dict | None = None) -> Exported:
    """A Qwen-VL case's checkpoint, exported once per test session (its own default patch budget: the processor's
    max_pixels, 256 patches)."""
    from fixtures_qwen import make_full_checkpoint, oracle_family

    def make(folder):
        overrides = {"layer_types": list(case.layer_types), "num_hidden_layers": len(case.layer_types)}
        return make_full_checkpoint(case.kind, folder, seed=case.seed, overrides=overrides if case.layer_types else None)

    return export_once(case, tmp_path_factory, make, oracle_family(case.kind), nested, prefill_ar=case.prefill_ar,
                       attention=case.attention)


@dataclass(frozen=True)
class Gemma4Case:
    """The Gemma 4 checkpoint (tests/fixtures_gemma4.py: sliding / full / kv-shared layers, per-layer rows, k_eq_v,
    soft-capping; the pooling tower at max_soft_tokens 70), prefill blocks of prefill_ar (they split its images)."""

    name: str
    prefill_ar: int


GEMMA4_CASES = [Gemma4Case("gemma4-shared-kv", prefill_ar=16)]


def gemma4_exported(case: Gemma4Case, tmp_path_factory, nested: dict | None = None) -> Exported:
    """The Gemma 4 checkpoint, exported once per test session (test_gemma4_vlm.py uses the same export)."""
    from fixtures_gemma4 import GEMMA4, make_gemma4_checkpoint

    return export_once(case, tmp_path_factory, make_gemma4_checkpoint, GEMMA4, nested, prefill_ar=case.prefill_ar,
                       max_seq_len=256)


_BIDIRECTIONAL: dict = {}


def gemma4_bidirectional_exported(tmp_path_factory) -> tuple:
    """(checkpoint, bundle): the Gemma 4 checkpoint with use_bidirectional_attention "vision" (the same weights),
    exported with prefill blocks of 32 (a span input: decoder.span_input), once per test session (test_gemma4_vlm.py,
    test_web_gemma4.py)."""
    if not _BIDIRECTIONAL:
        import json
        import shutil

        from vlmrt.export.pipeline import export

        base = gemma4_exported(GEMMA4_CASES[0], tmp_path_factory)
        tmp = tmp_path_factory.mktemp("gemma4_bidir")
        ckpt = tmp / "ckpt"
        shutil.copytree(base.ckpt, ckpt)
        config = json.loads((ckpt / "config.json").read_text())
        config["text_config"]["use_bidirectional_attention"] = "vision"
        (ckpt / "config.json").write_text(json.dumps(config))
        _BIDIRECTIONAL["export"] = ckpt, export(str(ckpt), tmp / "bundle", prefill_ar=32, max_seq_len=256,
                                                progress=False)
    return _BIDIRECTIONAL["export"]


@dataclass(frozen=True)
class PathsCase:
    """The case of a family that test_family_paths.py runs the user commands on (its index in FamilyCases.cases), and
    what that runner's first image (250×160) tiles into there (`vlmrt bench`'s image_tiles)."""

    case: int
    bench_tiles: int


@dataclass(frozen=True)
class FamilyCases:
    """What the shared runner needs of one family."""

    cases: list  # the family's checkpoint shapes (each with a unique .name)
    # (case, tmp_path_factory, nested=None) -> conftest.Exported, once per session; nested: the processor saved as
    # transformers 5 saves it, these stale files left beside it (conftest.export_once)
    exported: Callable
    # {old processor file: (its settings) -> edits}: the first case's old files left beside its processor saved
    # nested, with these edits (which change the test image's prompt): transformers reads the nested settings
    stale: dict[str, Callable[[dict], dict]]
    # measured: the cases whose text-only answer transformers ends with an EOS within 60 tokens, and at which length
    # (so the EOS stop is really exercised, not only the length stop)
    eos_stops: dict[str, int] = field(default_factory=dict)
    paths: PathsCase | None = None  # the user commands' case (test_family_paths.py), if the family has one there
    # (precision, (top-1 floor, mean KL ceiling)) of the paths case exported at that precision against the float
    # reference (test_family_paths.py; measured values beside each family's)
    quant_floors: tuple = ()


FAMILIES = {
    # (SmolVLM's: the nested file alone, as save_pretrained leaves a new folder; the others' over stale old files)
    "smolvlm": FamilyCases(conftest.CASES, conftest.exported, eos_stops={"untied-split": 46}, stale={}),
    "internvl": FamilyCases(CASES, exported, stale={"preprocessor_config.json": lambda pre: {"max_patches": 1}}),
    # the CPU precisions quantize the conv layers' projections too (MatMulNBits), GPTQ calibrating through them
    # (export/cpu/calibrate_gptq.py: conv windows in its state); against the float reference on this hidden-64 random
    # decoder, measured: w8a16 top-1 0.845, KL 0.0012; w4a16g 0.43, KL 0.10 (its 4-bit blocks of 32 are half a row
    # here); w4a16og (GPTQ on the block-offset grid) 0.46, KL 0.093
    "lfm2_vl": FamilyCases(LFM2_CASES, lfm2_exported,
                           stale={"preprocessor_config.json": lambda pre: {"do_image_splitting": False}},
                           paths=PathsCase(0, bench_tiles=7),
                           quant_floors=(("w8a16", (0.8, 0.003)), ("w4a16g", (0.38, 0.13)), ("w4a16og", (0.42, 0.10)))),
    # the GPTQ precisions' calibration runs the float decoder on text prompts: M-RoPE's three position rows and
    # DeepStack's row input (zeros on text) are given as the graphs take them (it raised a shape error on this family
    # before); measured (AVX-512 VNNI): w4a8g top-1 0.548, KL 0.039; w4a16og 0.512, KL 0.029 (int8 compute varies by
    # CPU: w4a8g's floor is the looser)
    "qwen_vl": FamilyCases(QWEN_CASES, qwen_exported,
                           stale={"preprocessor_config.json": lambda pre: {"max_pixels": pre["max_pixels"] // 4}},
                           paths=PathsCase(1, bench_tiles=1),
                           quant_floors=(("w4a8g", (0.45, 0.06)), ("w4a16og", (0.47, 0.033)))),
    "gemma4": FamilyCases(GEMMA4_CASES, gemma4_exported, stale={}, paths=PathsCase(0, bench_tiles=1)),
}


def nested(family: str, tmp_path_factory):
    """The family's first case with its processor saved as transformers 5 saves it, over stale old files
    (FamilyCases.stale), exported once per session."""
    fc = FAMILIES[family]
    return fc.exported(fc.cases[0], tmp_path_factory, nested=fc.stale)


def all_cases() -> list[tuple[str, object]]:
    """(family name, case) for every case of every family: the runner's parameters."""
    return [(name, case) for name, fc in FAMILIES.items() for case in fc.cases]
