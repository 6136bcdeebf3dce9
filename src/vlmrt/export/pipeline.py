"""`vlmrt export`: checkpoint -> bundle folder, written into a temporary folder and renamed at the end."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from .. import __version__
from .. import manifest as mf
from ..progress import Progress
from ..families import family_for
from . import graphs, quantize
from . import htp as htp_mod
from .chat_template import prompt_templates
from .checkpoint import Checkpoint, CheckpointError, resolve

DTYPES = {"fp32": "float32", "fp16": "float16"}
# CPU decoder graphs take any cache length; a step reads the prefix rounded up to this many slots: at most
# max_context / 64 shapes per graph for ORT to plan and the host to bind (not tuned: 32 would read up to 32
# fewer slots per step, exact lengths a new shape every token)
DEFAULT_CONTEXT_STEP = 64


class ExportError(ValueError):
    pass


def _eos_ids(ckpt: Checkpoint, tok_json: dict) -> list[int]:
    gen = ckpt.json("generation_config.json", {})
    eos = gen.get("eos_token_id", ckpt.config.get("eos_token_id", ckpt.config.get("text_config", {}).get("eos_token_id")))
    if eos is None:
        tc = ckpt.json("tokenizer_config.json", {})
        name = tc.get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        eos = next((t["id"] for t in tok_json.get("added_tokens", []) if t["content"] == name), None)
    if eos is None:
        raise ExportError("cannot find the EOS token id (generation_config.json, config.json or tokenizer_config.json)")
    return [eos] if isinstance(eos, int) else list(eos)


def _pad_id(ckpt: Checkpoint, vocab: int) -> int:
    for src in (ckpt.json("generation_config.json", {}), ckpt.config, ckpt.config.get("text_config", {})):
        if isinstance(src.get("pad_token_id"), int):
            return src["pad_token_id"]
    return vocab - 1


def _special_strings(ckpt: Checkpoint) -> dict[str, str]:
    tc = ckpt.json("tokenizer_config.json", {})
    out = {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = tc.get(k)
        out[k] = (v.get("content") if isinstance(v, dict) else v) or ""
    return out


def export(src: str, out: str | Path, *, prefill_ar: int = 32, max_seq_len: int | None = None, dtype: str = "fp32",
           quant: str | None = None, target: str = "cpu", htp_weights: int = 8, calibration: list | None = None,
           soc_model: str | None = None, htp_arch: str | None = None, context_step: int | None = None, force: bool = False, progress: bool = True) -> Path:
    """Export checkpoint src (folder or hub id) to bundle folder out; see `vlmrt export --help`.

    dtype is the graphs' I/O (and KV cache) type; quant the weight precision, overall or per graph.
    target "htp": static QDQ graphs (16-bit activations, htp_weights-bit weights) with a uint8 KV cache,
    calibrated on `calibration` [(image or None, prompt)] (default: vlmrt's sample set).
    context_step: CPU decoder graphs with a symbolic cache length; a step reads the cache prefix rounded up to a
    multiple of context_step (default DEFAULT_CONTEXT_STEP; 0 = static graphs over the whole cache, as the HTP
    target has)."""
    if target not in ("cpu", "htp"):
        raise ExportError(f"unknown target {target!r}; choose cpu or htp")
    if target == "htp" and (quant or dtype != "fp32"):
        raise ExportError("--target htp sets its own precisions (16-bit activations, --htp-weights); drop --quant/--dtype")
    if htp_weights not in (4, 8):
        raise ExportError("--htp-weights must be 8 or 4")
    if context_step is None and target == "htp":
        context_step = 0  # (otherwise None: the default, once the max context is known)
    elif context_step and target == "htp":
        raise ExportError("--context-step (a symbolic cache length) is for CPU graphs; --target htp exports static "
                          "graphs (leave --context-step out or pass 0)")
    elif context_step is not None and (context_step < 0 or context_step == 1):
        raise ExportError("--context-step must be 0 (static) or at least 2")
    p = Progress(9 if target == "htp" else 8, progress)
    try:
        return _export(src, Path(out), p, prefill_ar=prefill_ar, max_seq_len=max_seq_len, dtype=dtype, quant=quant,
                       force=force, context_step=context_step, htp=dict(weights=htp_weights, calibration=calibration, soc_model=soc_model,
                                             htp_arch=htp_arch) if target == "htp" else None)
    except BaseException:
        p.failed()
        raise


def _export(src: str, out: Path, p: Progress, *, prefill_ar: int, max_seq_len: int | None, dtype: str,
            quant: str | None, force: bool, context_step: int | None, htp: dict | None) -> Path:
    import json

    import torch

    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    prec = quantize.parse(quant, default=dtype)
    head = prec.get("lm_head")
    for g in ("prefill", "decode"):
        h = head or prec[g]
        if h in graphs.TORCH_DTYPES and h != graphs.compute_dtype(prec[g], dtype):
            raise ExportError(f"lm_head={h} under {g}={prec[g]}: a float lm head must match its graph; use a weight-only one")
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")

    p.start("reading checkpoint")
    ckpt = Checkpoint.open(resolve(src))
    family = family_for(ckpt.config)
    try:
        cfg = family.config_from_hf(ckpt.config)
    except KeyError as e:
        raise ExportError(f"config.json lacks {e}") from None
    tok_path = ckpt.path / "tokenizer.json"
    if not tok_path.is_file():
        raise ExportError("the checkpoint has no tokenizer.json (a fast tokenizer is required)")
    tok_json = json.loads(tok_path.read_text())
    host = family.host_spec(ckpt, cfg, tok_json)
    ctx_note = "from --max-seq-len"
    if max_seq_len is None:
        max_seq_len, ctx_note = family.default_max_context(cfg, host)
    if prefill_ar < 1 or max_seq_len < 2 or prefill_ar > max_seq_len:
        raise ExportError("need 1 <= --prefill-ar <= --max-seq-len")
    if context_step is None:
        context_step = min(DEFAULT_CONTEXT_STEP, max_seq_len)
    if context_step > max_seq_len:
        raise ExportError(f"--context-step {context_step} is larger than the max context {max_seq_len}")
    template = ckpt.chat_template()
    if not template:
        raise ExportError("the checkpoint has no chat template (chat_template.json / .jinja / tokenizer_config.json)")
    special = _special_strings(ckpt)
    conversation = {"chat_template": template, "template_strings": special, "content_format": "parts",
                    "image_placeholder": host.image_placeholder, "system_prompt": host.system_prompt}
    try:
        tmpl_image, tmpl_text = prompt_templates(template, host.image_placeholder, special, host.system_prompt)
    except ValueError:
        if not host.image_in_text_fallback:
            raise
        placeholder, in_text = host.image_in_text_fallback
        tmpl_image, tmpl_text = prompt_templates(template, placeholder, special, host.system_prompt, in_text)
        conversation.update(content_format="string", image_placeholder=placeholder, image_in_text=in_text)
    torch.manual_seed(0)
    vision, decoder, embed = family.load_weights(cfg, ckpt.tensors())
    p.done(f"({ckpt.path}; max context {max_seq_len} tokens: {ctx_note})")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        t = cfg.text
        kv_dim = t.kv_heads * t.head_dim
        p.start(f"vision graph (1 tile = {cfg.patches_per_tile} patches -> {cfg.tokens_per_tile} tokens, {prec['vision']})")
        graphs.export_vision(vision, cfg.patches_per_tile, 3 * cfg.vision.patch_size**2, dtype, prec["vision"], tmp / "vision.onnx")
        p.done()
        decoder_graphs = []  # (graph name, file stem)
        # one graph for both when nothing tells prefill and decode apart: a symbolic AR as well as a symbolic cache
        # length; one session then holds the only prepacked copy of the weights
        one_graph = bool(context_step) and htp is None and prec["prefill"] == prec["decode"] and prefill_ar > 1
        for name, ar in (("prefill", prefill_ar), ("decode", 1)):
            h = head or prec[name]
            if one_graph and name == "decode":
                decoder_graphs.append(("decode", "decoder"))
                continue
            cdesc = f"any context <= {max_seq_len} in steps of {context_step}" if context_step else f"context {max_seq_len}"
            what = f"prefill + decode graph (AR=1..{ar}" if one_graph else f"{name} graph (AR={ar}"
            p.start(f"{what}, {cdesc}, {t.layers} layers, {prec[name]}, lm head {h})")
            stem = "decoder" if one_graph else name
            graphs.export_decoder(decoder, ar=ar, max_context=max_seq_len, hidden=t.hidden, kv_dim=kv_dim, layers=t.layers,
                                  io_dtype=dtype, precision=prec[name], head=h, path=tmp / f"{stem}.onnx",
                                  cpu=htp is None, dynamic_context=context_step > 0, dynamic_ar=one_graph)
            decoder_graphs.append((name, stem))
            p.done()
        stems = sorted({stem for _, stem in decoder_graphs})
        p.start("sharing weights between graphs")
        graphs.share_weights(tmp, ["vision.onnx"], "vision.data")
        graphs.share_weights(tmp, [f"{g}.onnx" for g in stems], "decoder.data")
        p.done()
        p.start("embedding table + tokenizer")
        dec_precs = {prec["prefill"], prec["decode"], head or prec["decode"]}
        files = ["vision.onnx", "vision.data", *[f"{g}.onnx" for g in stems], "decoder.data", "embed.npy",
                 "tokenizer.json"]
        scale_file = None
        if dec_precs & set(quantize.WEIGHT_ONLY_BITS):  # host table per-row int8 (a lookup touches a few rows)
            q, scale = quantize.int8_rows(embed.numpy())
            np.save(tmp / "embed.npy", q)
            np.save(tmp / "embed_scale.npy", scale)
            scale_file = "embed_scale.npy"
            files.append(scale_file)
            embed_dtype = "int8"
        else:
            embed_dtype = "float16" if dec_precs == {"fp16"} else DTYPES[dtype]
            np.save(tmp / "embed.npy", embed.numpy().astype(embed_dtype))
        shutil.copyfile(tok_path, tmp / "tokenizer.json")
        p.done()

        p.start("manifest")
        gspecs = {}
        for name, stem in [("vision", "vision"), *decoder_graphs]:
            ins, outs = graphs.io_specs(tmp / f"{stem}.onnx")
            weights = {"block_size": quantize.BLOCK_SIZE, "symmetric": True} if prec[name] in quantize.WEIGHT_ONLY_BITS else {}
            if name != "vision":
                weights["lm_head"] = head or prec[name]
                if prec[name] in quantize.MIX_OF:
                    weights["8bit"] = {"precision": quantize.MIX_OF[prec[name]], "matmuls": list(quantize.MIXED_8BIT)}
            gspecs[name] = mf.GraphSpec(file=f"{stem}.onnx", precision=prec[name], inputs=ins, outputs=outs, weights=weights)
        m = mf.Manifest(
            model={"family": family.__name__.rsplit(".", 1)[-1], "model_type": ckpt.config.get("model_type"),
                   "source": str(src), "exported_by": f"vlmrt {__version__}",
                   "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            graphs=gspecs,
            tokenizer_file="tokenizer.json",
            image=mf.ImageSpec(**host.image),
            prompt=mf.PromptSpec(template_image=tmpl_image, template_text=tmpl_text, expansion=host.prompt_expansion,
                                 tokens_per_tile=cfg.tokens_per_tile, add_special_tokens=True, params=host.prompt_params,
                                 **conversation),
            special_tokens=mf.SpecialTokens(image_token_id=host.image_token_id, eos_token_ids=_eos_ids(ckpt, tok_json),
                                            pad_token_id=_pad_id(ckpt, t.vocab)),
            kv=mf.KVSpec(layers=t.layers, dim=kv_dim, max_context=max_seq_len, dtype=DTYPES[dtype],
                         key_input="past_key_{layer}", value_input="past_value_{layer}",
                         key_output="new_key_{layer}", value_output="new_value_{layer}"),
            decoder=mf.DecoderSpec(hidden_size=t.hidden, vocab_size=t.vocab, prefill_ar=prefill_ar,
                                   embeds_input="inputs_embeds", positions_input="position_ids",
                                   mask_input="attention_mask", logits_output="logits",
                                   embedding_file="embed.npy", embedding_dtype=embed_dtype,
                                   embedding_scale_file=scale_file,
                                   mask_value=htp_mod.HTP_MASK_VALUE if htp else None,
                                   context_step=context_step,
                                   dynamic_ar=one_graph, last_logits=one_graph),
            vision=mf.VisionSpec(patches_input="pixel_patches", embeds_output="image_embeds"),
            generate={"default_mode": "hybrid", "modes": ["kv", "hybrid"]},
            files=mf.list_files(tmp, files),
        )
        leftovers = sorted(set(os.listdir(tmp)) - set(files))
        if leftovers:
            raise ExportError(f"export left unlisted files: {leftovers}")
        mf.save(m, tmp)
        mf.load(tmp)  # what we wrote must read back
        p.done()

        if htp:
            p.start(f"HTP: calibrating and quantizing (16-bit activations, {htp['weights']}-bit weights, uint8 KV)")
            from ..eval.samples import default_samples

            float_dir, tmp = tmp, out.parent / f".{out.name}.htp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                m = htp_mod.quantize_bundle(float_dir, tmp, htp["calibration"] or default_samples(), weight_bits=htp["weights"],
                                            soc_model=htp["soc_model"], htp_arch=htp["htp_arch"])
                mf.save(m, tmp)
                mf.load(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                shutil.rmtree(float_dir, ignore_errors=True)
            p.done()

        p.start(f"writing {out}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        p.done()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["export", "ExportError", "CheckpointError"]
