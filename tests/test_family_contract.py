"""The family contract (vlmrt/families/__init__.py) is checked: a family module that breaks it is refused in one line
naming the family, where it is looked up or before any graph is traced, instead of failing deep in the export or at
run time. Each check is shown failing on a family broken on purpose (the registered families pass them all:
test_family_conformance.py exports every one)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from vlmrt import families  # noqa: E402
from vlmrt.families import FamilyContractError, Weights, decoder, smolvlm  # noqa: E402

CONFIG = {  # a small SmolVLM config.json: no checkpoint needed to build its modules
    "model_type": "smolvlm", "image_token_id": 3, "scale_factor": 2,
    "vision_config": {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 32,
                      "image_size": 16, "patch_size": 4},
    "text_config": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                    "intermediate_size": 64, "vocab_size": 40},
}


def modules(cfg):
    return smolvlm.VisionEncoder(cfg).eval(), decoder.build(cfg.text).eval(), torch.zeros(cfg.text.vocab, cfg.text.hidden)


def with_weights(make):
    """SmolVLM's family with load_weights replaced by one that returns make(cfg)."""
    return dataclasses.replace(smolvlm.FAMILY, load_weights=lambda cfg, tensors: make(cfg))


def test_registered_families_meet_the_contract():
    fams = families.registered()
    assert [f.name for f in fams] == ["gemma4", "internvl", "lfm2_vl", "qwen_vl", "smolvlm"]
    for f in fams:
        assert all(families.family_for({"model_type": t}) is f for t in f.model_types)
    cfg = smolvlm.FAMILY.config(CONFIG)
    w = with_weights(modules).weights(cfg, {})
    assert isinstance(w, Weights) and len(w.decoder.layers) == 2
    with pytest.raises(FamilyContractError, match="the decoder's layers / hidden / vocab 2 / 32 / 40 are not the "
                                                  "config's 3 / 32 / 40"):
        deeper = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, layers=3))
        with_weights(lambda c: modules(cfg)).weights(deeper, {})


def test_registry_and_family_must_agree(monkeypatch):
    monkeypatch.setitem(families.REGISTRY, "smolvlm2", "smolvlm")  # sent to a family that does not claim it
    with pytest.raises(FamilyContractError, match=r"model_types \['idefics3', 'smolvlm'\] are not .*'smolvlm2'"):
        families.family_for({"model_type": "smolvlm"})
    monkeypatch.setitem(families.REGISTRY, "smolvlm2", "vit")  # a module that is no family
    with pytest.raises(FamilyContractError, match="vlmrt.families.vit is registered as a family but has no FAMILY"):
        families.family_for({"model_type": "smolvlm2"})
    monkeypatch.delitem(families.REGISTRY, "smolvlm2")
    monkeypatch.setattr(smolvlm, "FAMILY", dataclasses.replace(smolvlm.FAMILY, load_weights=lambda cfg: None))
    with pytest.raises(FamilyContractError, match="FAMILY.load_weights must be a function of 2 argument"):
        families.family_for({"model_type": "idefics3"})
    with pytest.raises(families.UnknownFamily, match="unknown model type 'llava'"):
        families.family_for({"model_type": "llava"})


def test_config_must_give_the_fields_the_exporter_reads():
    bad = dataclasses.replace(smolvlm.FAMILY, config_from_hf=lambda c: dataclasses.replace(
        smolvlm.SmolVLMConfig.from_hf(c), tie_word_embeddings=1))
    with pytest.raises(FamilyContractError, match="family smolvlm: config.tie_word_embeddings must be a bool"):
        bad.config(CONFIG)


def test_decoder_must_be_the_causal_decoder_with_hf_llama_names():
    cfg = smolvlm.FAMILY.config(CONFIG)

    class OwnDecoder(torch.nn.Module):
        pass

    with pytest.raises(FamilyContractError, match="family smolvlm: load_weights gave a OwnDecoder decoder; the exporter "
                                                  "traces, quantizes and calibrates a families.DecoderModule only"):
        with_weights(lambda c: (modules(c)[0], OwnDecoder(), modules(c)[2])).weights(cfg, {})

    def renamed(c):  # the MLP under another name: the quantizer's mixed precisions would find no down_proj
        v, d, e = modules(c)
        d.layers[1].ffn = d.layers[1].mlp
        del d.layers[1].mlp
        return v, d, e

    with pytest.raises(FamilyContractError, match="the decoder has no module layers.1.mlp.gate_proj"):
        with_weights(renamed).weights(cfg, {})


def test_embedding_table_and_vision_output_are_checked():
    cfg = smolvlm.FAMILY.config(CONFIG)
    with pytest.raises(FamilyContractError, match=r"embedding table must be a \[vocab, row width\] = \[40, 32\] tensor, "
                                                  r"not \(40, 31\)"):
        with_weights(lambda c: (*modules(c)[:2], torch.zeros(40, 31))).weights(cfg, {})

    def wide(c):  # a connector to the wrong width
        v, d, e = modules(c)
        v.proj = torch.nn.Linear(v.proj.in_features, 33, bias=False)
        return v, d, e

    with pytest.raises(FamilyContractError, match=r"the vision module maps one tile \[16, 48\] to \[4, 33\], not "
                                                  r"\[tokens_per_tile, row width\] = \[4, 32\]"):
        with_weights(wide).weights(cfg, {})


def test_row_width_is_not_the_decoders_hidden():
    """Gemma 4's token rows carry per-layer rows beside the embedding: the table and the vision graph's rows are
    hidden + layers × per_layer wide (16 + 2 × 4 here), the decoder's norm hidden; a table or a tower of the
    decoder's hidden alone is refused (on main every check compared against hidden: the family could not register)."""
    from vlmrt.families.gemma4 import FAMILY, language, vision

    text = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "hidden_size": 16, "intermediate_size": 24, "vocab_size": 40, "hidden_size_per_layer_input": 4,
            "global_head_dim": 8, "layer_types": ["sliding_attention", "full_attention"]}
    v = {"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 8,
         "patch_size": 2, "pooling_kernel_size": 2, "position_embedding_size": 16, "rms_norm_eps": 1e-6}
    cfg = FAMILY.config({"model_type": "gemma4", "text_config": text, "vision_config": v, "image_token_id": 39})
    cfg.max_soft_tokens = 4
    assert (cfg.text.hidden, cfg.text.row_width) == (16, 24)

    def gemma4(table_width, pad_width):
        def make(c):
            tower = vision.Gemma4Vision(v, 16, torch.zeros(pad_width), c.patches_per_tile)
            return tower, language.Gemma4Decoder(c.text).eval(), torch.zeros(40, table_width)
        return dataclasses.replace(FAMILY, load_weights=lambda c, tensors: make(c))

    w = gemma4(24, 8).weights(cfg, {})
    assert w.decoder.norm.weight.shape[0] == 16
    with pytest.raises(FamilyContractError, match=r"\[vocab, row width\] = \[40, 24\] tensor, not \(40, 16\)"):
        gemma4(16, 8).weights(cfg, {})
    with pytest.raises(FamilyContractError, match=r"to \[4, 16\], not \[tokens_per_tile, row width\] = \[4, 24\]"):
        gemma4(24, 0).weights(cfg, {})


def host(image_edit=None, **edit) -> families.HostSpec:
    """A SmolVLM host plan for CONFIG, edited."""
    image = families.ImageSpec(**{**dict(tiling="longest_edge_grid", tile_size=16, patch_size=4, resample="lanczos",
                                         rescale_factor=1 / 255, mean=[0.5] * 3, std=[0.5] * 3), **(image_edit or {})})
    return families.HostSpec(**{**dict(image=image, prompt_expansion="grid_markers", prompt_params={},
                                       image_placeholder="<image>", image_token_id=3), **edit})


@pytest.mark.parametrize("spec, message", [
    (host({"tiling": "square_grid"}), "tiling 'square_grid' is not a host op of the runtime"),
    (host(prompt_expansion="markers"), "prompt expansion 'markers' is not a host op of the runtime"),
    (host(positions_op="rope3d"), "positions op 'rope3d' is not a host op of the runtime"),
    (host({"patch_size": 8}), "the host unfolds patches of 8 pixels, the vision tower takes 4"),
    (host(image_token_id=40), "image_token_id 40 is not a token of the 40-token vocabulary"),
    (host(image={"tiling": "longest_edge_grid"}), "host_spec must give a HostSpec whose image is a manifest.ImageSpec"),
    (host(video={"sampling": "keyframes"}), "video sampling 'keyframes' is not a host op of the runtime"),
    (host(video={"frames": "crop"}), "video frames 'crop' is not a host op of the runtime"),
    (host(video={"frames": "image_tiling", "frame_image": host({"tiling": "square_grid"}).image}),
     "the video's frame tiling 'square_grid' is not a host op of the runtime"),
])
def test_host_ops_must_exist_in_the_runtime(spec, message):
    cfg = smolvlm.FAMILY.config(CONFIG)
    assert dataclasses.replace(smolvlm.FAMILY, host_spec=lambda ckpt, c, tok: host()).host(None, cfg, {}) == host()
    with pytest.raises(FamilyContractError, match=f"family smolvlm: {message}"):
        dataclasses.replace(smolvlm.FAMILY, host_spec=lambda ckpt, c, tok: spec).host(None, cfg, {})


def test_a_broken_family_fails_the_export_in_one_line(default_bundle, tmp_path, capsys, monkeypatch):
    """Through `vlmrt export`: one line, exit status 1, nothing written (the check runs before any graph is traced)."""
    from vlmrt import cli

    real = smolvlm.FAMILY.host_spec

    def bad_host(ckpt, cfg, tok_json):
        h = real(ckpt, cfg, tok_json)
        return dataclasses.replace(h, image=dataclasses.replace(h.image, tiling="square_grid"))

    monkeypatch.setattr(smolvlm, "FAMILY", dataclasses.replace(smolvlm.FAMILY, host_spec=bad_host))
    capsys.readouterr()
    out = tmp_path / "b"
    assert cli.main(["export", str(default_bundle.ckpt), str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    from vlmrt.runtime.media.image import TILING

    assert err == ["vlmrt: error: family smolvlm: tiling 'square_grid' is not a host op of the runtime "
                   f"({', '.join(TILING)}; runtime/media/image.py TILING) (a bug in "
                   "vlmrt.families.smolvlm, not in the checkpoint)"], err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("opts", [dict(), dict(norm="rms_norm", qkv_bias=False, qk_norm=True, layer_scale=True)],
                         ids=["siglip", "internvit"])
def test_vit_layer_key_mask_hides_padding(opts):
    """vit.ViTLayer's key_mask: real patches padded to a static count (NaFlex tiles) come out as the layer gives them
    unpadded (the padding is attended by none); without a mask the padding changes them."""
    from vlmrt.families.vit import ViTLayer, ViTOptions

    torch.manual_seed(0)
    layer = ViTLayer(16, 2, 32, 1e-6, "gelu", ViTOptions(**opts)).eval()
    for prm in layer.parameters():
        torch.nn.init.normal_(prm, std=0.3)
    real, pad = torch.randn(5, 16), torch.randn(3, 16)
    mask = torch.tensor([0.0] * 5 + [-1e9] * 3)
    with torch.no_grad():
        alone = layer(real)
        masked = layer(torch.cat([real, pad]), mask)[:5]
        unmasked = layer(torch.cat([real, pad]))[:5]
    torch.testing.assert_close(masked, alone, rtol=0, atol=1e-6)
    assert (unmasked - alone).abs().max() > 1e-2


def test_decoder_protocol_members_are_checked():
    """The exporter reads a decoder's protocol members as they are (families.DecoderModule's defaults where a decoder
    has no such part): a value it could not build inputs from is refused before any graph is traced."""
    cfg = smolvlm.FAMILY.config(CONFIG)
    v, d, e = modules(cfg)
    assert (d.rope_rows, d.row_levels, d.layer_kinds) == (1, 0, ("attention", "attention"))  # the defaults
    d.rope_rows = 0
    with pytest.raises(FamilyContractError, match="family smolvlm: the decoder's rope_rows 0 must be a positive int"):
        with_weights(lambda c: (v, d, e)).weights(cfg, {})


def test_every_cache_kind_is_exported():
    """Each cache kind a decoder layer may have (manifest.CACHE_LAYER_KINDS) is registered with the exporter and the
    GPTQ calibration (export/cache_kinds.py), and its names are the ones the runtime's manifest entry lists."""
    from vlmrt.export.cache_kinds import CACHE_KINDS, state_names
    from vlmrt.format.manifest import CACHE_LAYER_KINDS

    assert set(CACHE_KINDS) == set(CACHE_LAYER_KINDS)
    assert state_names(("conv", "attention"), "present") == (["past_conv_0", "past_key_1", "past_value_1"],
                                                             ["new_conv_0", "present_key_1", "present_value_1"])


def test_vision_tower_must_be_a_vision_module():
    """The exporter reads a tower's extra inputs, example inputs and row outputs as VisionModule members (defaults: a
    plain tower's), so a torch module that does not derive from it is refused, whatever its output."""
    cfg = smolvlm.FAMILY.config(CONFIG)

    class Tower(torch.nn.Module):
        def forward(self, patches):
            return torch.zeros(4, 32)

    with pytest.raises(FamilyContractError, match="family smolvlm: load_weights gave a Tower vision tower, not a torch "
                                                  "module derived from families.VisionModule"):
        with_weights(lambda c: (Tower(), *modules(c)[1:])).weights(cfg, {})
    v = modules(cfg)[0]
    assert (v.extra_inputs(), v.row_outputs, list(families.vision_examples(v, 16, 48))) == ({}, (), ["patches"])
