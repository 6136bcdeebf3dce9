"""`vlmrt export`: checkpoint -> bundle folder, written into a temporary folder and renamed at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..format import manifest as mf
from ..format import staging
from ..families import Family, FamilyConfig, HostSpec, family_for, vision_examples, vision_row_outputs
from ..progress import Laps, Progress
from . import cache_kinds, graphs
from .decoder_inputs import ROW_INPUT, SPAN_INPUT, VALID_ROWS
from .htp import precisions as htp_precisions, qnn_context
from .cpu import kv_quant, quantize
from .htp import bundle as htp_mod
from .chat_template import renders_one_image
from ..families.checkpoint import Checkpoint, CheckpointError, resolve
from ..families.token_table import TokenTable
from ..runtime import table_rows

DTYPES = {"fp32": "float32", "fp16": "float16"}
# CPU decoder graphs take any cache length; a step reads the prefix rounded up to this many slots: at most
# max_context / 64 shapes per graph for ORT to plan and the host to bind (not tuned: 32 would read up to 32
# fewer slots per step, exact lengths a new shape every token)
DEFAULT_CONTEXT_STEP = 64
# --prefill-ar's default: the one-graph CPU decoder takes any block up to it (a symbolic AR: no bundle-size cost), and a
# long prompt prefills faster in larger blocks (docs/performance.md "Long prompts": TTFT at 1000 / 4000 tokens per
# block; 128 rather than more: a follow-up re-prefills up to a block of the kept prompt, and the server's chunked
# prefill delays running answers by a block per step); a prefill graph at a fixed AR (the HTP target, --context-step 0,
# prefill and decode at different precisions) pads its last block to the full AR, so it keeps a short one
PREFILL_AR = {"one_graph": 128, "fixed_ar": 32}


class ExportError(ValueError):
    pass


def export(src: str, out: str | Path, *, prefill_ar: int | None = None, max_seq_len: int | None = None, dtype: str = "fp32",
           quant: str | None = None, target: str = "cpu", calibration: list | None = None,
           soc_model: str | None = None, htp_arch: str | None = None, keep_qdq: bool = False, shared_context: bool = False,
           context_step: int | None = None, attention: str | None = None, lookahead_ar: int = 0, force: bool = False,
           max_patches: int | None = None, kv_cache: str = "fp32", table: str | None = None,
           progress: bool = True) -> Path:
    """Export checkpoint src (folder or hub id) to bundle folder out; see `vlmrt export --help`.

    prefill_ar: tokens per prefill block (default PREFILL_AR: the one-graph CPU decoder's, else a fixed-AR graph's).
    dtype is the graphs' I/O (and KV cache) type; quant the weight precision, overall or per graph.
    target "htp": static graphs with a uint8 KV cache, each QDQ (16-bit activations, 8- or 4-bit weights) or float
    (fp16 on the HTP) as quant says (export/htp/precisions.py; default w8a16),
    calibrated on `calibration` [(image or None, prompt)] (default: eval.samples.htp_calibration_samples), then compiled by the QNN EP
    into context binaries for soc_model / htp_arch (qnn_context.resolve_target; default a current flagship);
    keep_qdq also keeps the QDQ graphs (what the CPU EP runs); shared_context compiles prefill and decode into one
    context (one copy of the decoder weights; the x86-64 simulator cannot load it).
    context_step: CPU decoder graphs with a symbolic cache length; a step reads the cache prefix rounded up to a
    multiple of context_step (default DEFAULT_CONTEXT_STEP; 0 = static graphs over the whole cache, as the HTP
    target has).
    attention: "gqa", the one-graph CPU decoder's attention as ORT's GroupQueryAttention over a cache it updates in
    place (the default where the graph is one and head_dim a multiple of 16, what the CPU kernel takes), or
    "portable" (the graphs' own attention ops, the host writing the new K/V rows: what static graphs always have).
    lookahead_ar: --target htp: also a static lookahead verify graph of that AR (`--lookahead K-1` at run time):
    the decode graph at AR = lookahead_ar, with decode's weights, activation and KV encodings (htp/verify.py).
    max_patches: the vision graph's patch budget, for a native-resolution image op (Qwen-VL's smart_resize: an image
    the processor makes larger is resized to fit; default: the family's, see the export's first line).
    kv_cache: "fp32" (the I/O dtype's cache), "int8" or "int4": the CPU decoder's GroupQueryAttention stores the cache
    quantized, scales calibrated here on `calibration`'s prompts (default: GPTQ's calibration prompts;
    export/cpu/kv_quant.py).
    table: the token table's stored form (runtime/table_rows.py FORMS: float32, float16, int8 rows, int8 / 4-bit
    row groups; SPLIT_FORMS, E+P: rows whose per-layer columns (Gemma 4's) are stored in P, their embedding in E);
    None: the precisions' default (Plan.table_form)."""
    if table is not None and table not in table_rows.FORMS and table not in table_rows.SPLIT_FORMS:
        raise ExportError(f"unknown --table {table!r}; choose one of {table_rows.names()}")
    if kv_cache not in kv_quant.KV_CACHES:
        raise ExportError(f"unknown --kv-cache {kv_cache!r}; choose one of {', '.join(kv_quant.KV_CACHES)}")
    if kv_cache != "fp32" and (target != "cpu" or attention == "portable" or dtype != "fp32"):
        raise ExportError(f"--kv-cache {kv_cache} is the CPU decoder's GroupQueryAttention cache (--target cpu, "
                          "--attention gqa, --dtype fp32); the HTP target's cache is uint8 anyway")
    if attention not in (None, "gqa", "portable"):
        raise ExportError(f"unknown attention {attention!r}; choose gqa or portable")
    if target not in ("cpu", "htp"):
        raise ExportError(f"unknown target {target!r}; choose cpu or htp")
    if target == "htp" and dtype != "fp32":
        raise ExportError("--target htp sets its own I/O types (float32 at the graph edges, a uint8 KV cache); drop --dtype")
    if context_step is None and target == "htp":
        context_step = 0  # (otherwise None: the default, once the max context is known)
    elif context_step and target == "htp":
        raise ExportError("--context-step (a symbolic cache length) is for CPU graphs; --target htp exports static "
                          "graphs (leave --context-step out or pass 0)")
    elif context_step is not None and (context_step < 0 or context_step == 1):
        raise ExportError("--context-step must be 0 (static) or at least 2")
    qnn_target = htp_prec = None
    if target == "htp":
        try:
            qnn_target = qnn_context.resolve_target(soc_model, htp_arch)
            htp_prec = htp_precisions.parse(quant)  # checked now; resolved again with the checkpoint (_plan)
        except (qnn_context.TargetError, quantize.QuantError) as e:
            raise ExportError(str(e)) from None
        if "fp16" in htp_prec.values() and not qnn_target["soc_model"]:
            raise ExportError("fp16 graphs need --soc-model (the QNN EP takes its fp16 precision flag only with a soc model)")
        htp_spec, quant = quant, None  # the float bundle the HTP graphs are made from
        if lookahead_ar < 0 or lookahead_ar == 1:
            raise ExportError("--lookahead-ar is the verify graph's AR: the current token and its drafts, at least 2")
        if lookahead_ar and "head" in htp_prec:
            raise ExportError("--lookahead-ar and --quant head=... exclude each other: the verify graph needs every "
                              "row's logits and the head graph maps one row")
    elif keep_qdq or shared_context or soc_model is not None or htp_arch is not None or lookahead_ar:
        raise ExportError("--soc-model, --htp-arch, --keep-qdq, --htp-shared-context and --lookahead-ar are for "
                          "--target htp (the CPU decoder verifies lookahead drafts itself)")
    p = Progress((9 if target == "htp" else 8) + _uses_gptq(quant) + bool(lookahead_ar) + (kv_cache != "fp32"), progress)
    try:
        return _export(src, Path(out), p, prefill_ar=prefill_ar, max_seq_len=max_seq_len, dtype=dtype, quant=quant,
                       force=force, context_step=context_step, attention=attention, max_patches=max_patches,
                       kv_bits=kv_quant.KV_CACHES[kv_cache], calibration=calibration, table=table,
                       htp=dict(precisions=htp_prec, spec=htp_spec, calibration=calibration, target=qnn_target, keep_qdq=keep_qdq,
                                shared_context=shared_context, lookahead_ar=lookahead_ar) if target == "htp" else None)
    except (qnn_context.TargetError, kv_quant.KVQuantError) as e:
        p.failed()
        raise ExportError(str(e)) from None
    except OSError as e:
        p.failed()
        if _disk_full(e):  # _export removed its work folder: nothing is left at or next to OUT
            raise ExportError(f"no space left on device while exporting to {out}; nothing was written there. "
                              "Free some space (the bundle needs about twice its size while exporting) and retry") from None
        raise
    except BaseException:
        p.failed()
        raise


@dataclass
class Plan:
    """What one export writes, decided from the options and the checkpoint before any graph is traced."""

    src: str
    ckpt: Checkpoint
    family: Family
    cfg: FamilyConfig  # the family's config dataclass
    host: HostSpec
    tok_json: dict
    prec: dict[str, str]  # graph -> precision (export.cpu.quantize.parse)
    head: str | None  # lm_head precision if named apart from its graph
    dtype: str  # graph I/O and KV cache: fp32 | fp16
    prefill_ar: int
    max_seq_len: int
    context_step: int  # > 0: symbolic cache length; 0: static graphs
    htp: dict | None  # the HTP target's options, None for the CPU target
    attention: str  # the decoder graphs' attention kind (families/layers.py ATTENTION_KINDS; --attention, the target)
    prompt: mf.PromptSpec  # the chat template and how it takes images, the expansion op
    kv_bits: int = 0  # --kv-cache: 8 / 4, the GroupQueryAttention cache quantized; 0: the float cache
    table: str | None = None  # --table: the token table's stored form (runtime/table_rows.py); None: table_form's

    @property
    def one_graph(self) -> bool:
        """One decoder graph for prefill and decode when nothing tells them apart: a symbolic AR as well as a
        symbolic cache length; one session then holds the only prepacked copy of the weights."""
        return bool(self.context_step) and self.htp is None and self.prec["prefill"] == self.prec["decode"] \
            and self.prefill_ar > 1

    @property
    def table_form(self) -> str:
        """The token table's stored form (runtime/table_rows.py): --table, else int8 rows (one scale per row) under
        weight-only decoders where a row is the embedding alone; rows that carry per-layer rows beside the embedding
        (Gemma 4) split there, the embedding float16 and the per-layer columns 4-bit in groups of 32
        (float16+int4g32: docs/gemma4.md, "The token table's stored forms": what each form costs); float16 under
        fp16 graphs, else the I/O dtype."""
        if self.table:
            return self.table
        precs = {self.prec["prefill"], self.prec["decode"], self.head or self.prec["decode"]}
        if precs & set(quantize.WEIGHT_ONLY_BITS):
            return "int8" if self.cfg.text.row_width == self.cfg.text.hidden else "float16+int4g32"
        return "float16" if precs == {"fp16"} else DTYPES[self.dtype]

    @property
    def token_rows(self) -> bool:
        """The in-place (gqa_in_place) decoder scales an int8 embedding row itself (token_rows_input): an int8 table
        with one scale per row whose rows are the embedding alone."""
        return graphs.LAYOUTS[self.attention].in_place and self.table_form == "int8" \
            and self.cfg.text.row_width == self.cfg.text.hidden


def _precisions(quant: str | None, dtype: str) -> dict[str, str]:
    """graph -> precision, checked (before anything is read)."""
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    prec = quantize.parse(quant, default=dtype)
    for g in ("prefill", "decode"):
        h = prec.get("lm_head") or prec[g]
        if h in graphs.TORCH_DTYPES and h != graphs.compute_dtype(prec[g], dtype):
            raise ExportError(f"lm_head={h} under {g}={prec[g]}: a float lm head must match its graph; use a weight-only one")
    return prec


def _plan(src: str, prec: dict[str, str], *, prefill_ar: int | None, max_seq_len: int | None, dtype: str,
          context_step: int | None, attention: str | None, htp: dict | None, max_patches: int | None = None) -> Plan:
    head = prec.get("lm_head")
    ckpt = Checkpoint.open(resolve(src))
    family = family_for(ckpt.config)
    try:
        cfg = family.config(ckpt.config)
    except KeyError as e:
        raise ExportError(f"config.json lacks {e}") from None
    tok_path = ckpt.path / "tokenizer.json"
    if not tok_path.is_file():
        raise ExportError("the checkpoint has no tokenizer.json (a fast tokenizer is required)")
    tok_json = json.loads(tok_path.read_text())
    # a native-resolution image op's patch budget (image.params.max_patches): the family's config field max_patches,
    # which host_spec reads (the option) and decides (the option, its default or the processor's own maximum)
    budgeted = dataclasses.is_dataclass(cfg) and any(f.name == "max_patches" for f in dataclasses.fields(cfg))
    if max_patches is not None:
        if max_patches < 1:
            raise ExportError("--max-patches must be positive")
        if budgeted:
            cfg = dataclasses.replace(cfg, max_patches=max_patches)
    host = family.host(ckpt, cfg, tok_json)
    chosen = host.image.params.get("max_patches")
    if max_patches is not None and chosen != max_patches:
        raise ExportError(f"--max-patches is the patch budget of a native-resolution image op; family {family.name}'s "
                          f"tiling ({host.image.tiling}) has none")
    if budgeted and chosen is not None:
        cfg = dataclasses.replace(cfg, max_patches=int(chosen))
    if htp is not None:  # the head's own graph by default where it is untied (htp_precisions.parse)
        htp = {**htp, "precisions": htp_precisions.parse(htp["spec"], untied=not cfg.tie_word_embeddings,
                                                         lookahead=bool(htp["lookahead_ar"]))}
        t = cfg.text
        htp_precisions.check_blocks(htp["precisions"], t.hidden, t.heads * t.head_dim, t.intermediate)
    if max_seq_len is None:
        max_seq_len, _ = family.max_context(cfg, host)
    if context_step is None:
        context_step = min(DEFAULT_CONTEXT_STEP, max_seq_len)
    if prefill_ar is None:  # (Plan.one_graph's condition, at a block > 1)
        one = bool(context_step) and htp is None and prec["prefill"] == prec["decode"]
        prefill_ar = min(PREFILL_AR["one_graph" if one else "fixed_ar"], max_seq_len)
    if prefill_ar < 1 or max_seq_len < 2 or prefill_ar > max_seq_len:
        raise ExportError("need 1 <= --prefill-ar <= --max-seq-len")
    cfg.text.rope.check_context(max_seq_len)  # a table of RoPE rows must hold the scaling up to the max context
    if context_step > max_seq_len:
        raise ExportError(f"--context-step {context_step} is larger than the max context {max_seq_len}")
    template = ckpt.chat_template()
    if not template:
        raise ExportError("the checkpoint has no chat template (chat_template.json / .jinja / tokenizer_config.json)")
    special = ckpt.special_strings()
    # the checkpoint's template itself, rendered at run time (runtime/prompt/conversation.py)
    prompt = mf.PromptSpec(chat_template=template, expansion=host.prompt_expansion,
                           tokens_per_tile=cfg.tokens_per_tile, add_special_tokens=True,
                           image_placeholder=host.image_placeholder, params=host.prompt_params,
                           template_strings=special, system_prompt=host.system_prompt,
                           video=mf.VideoSpec(**host.video) if host.video else None)
    if not renders_one_image(prompt):
        if not host.image_in_text_fallback:
            raise ExportError("the chat template does not render one image and one text item as expected")
        placeholder, in_text = host.image_in_text_fallback
        prompt = dataclasses.replace(prompt, content_format="string", image_placeholder=placeholder,
                                     image_in_text=in_text)
        if not renders_one_image(prompt):
            raise ExportError("the chat template does not render one image and one text item as expected")
    plan = Plan(src, ckpt, family, cfg, host, tok_json, prec, head, dtype, prefill_ar, max_seq_len, context_step,
                htp, "rows_concat" if htp else "rows_copy_free", prompt)
    t = cfg.text
    gqa_fits = plan.one_graph and cfg.text.head_dim % 16 == 0
    if attention == "gqa" and not gqa_fits:
        raise ExportError("--attention gqa needs the one-graph CPU decoder (symbolic cache length, one precision for "
                          "prefill and decode, --prefill-ar > 1) and a head_dim that is a multiple of 16 "
                          f"(this one: {cfg.text.head_dim})")
    if gqa_fits and attention != "portable":
        plan.attention = "gqa_in_place"
    return plan


def _uses_gptq(quant: str | None) -> bool:
    """Whether --quant names a GPTQ precision (one more export step: the calibration)."""
    try:
        return bool(set(quantize.parse(quant).values()) & set(quantize.GPTQ))
    except quantize.QuantError:
        return False  # _precisions reports it


def _gptq_hessians(plan: Plan, decoder, embed: TokenTable, p: Progress):
    """Hessians.for_weight of the float decoder on the calibration prompts, when a graph's precision is GPTQ's."""
    if not {plan.prec["prefill"], plan.prec["decode"], plan.head} & set(quantize.GPTQ):
        return None
    from .cpu import calibrate_gptq

    if decoder.attention_kinds and "rows_copy_free" not in decoder.attention_kinds:
        raise ExportError(f"the GPTQ precisions calibrate through the rows_copy_free decoder, which family "
                          f"{plan.family.name} does not build ({', '.join(decoder.attention_kinds)} only); choose "
                          "another --quant")
    return calibrate_gptq.prompt_hessians(decoder, embed, plan.tok_json, plan.prompt, p).for_weight


def _kv_quant(plan: Plan, decoder, embed: TokenTable, kv_layers: list, calibration: list | None, p: Progress) -> list:
    """kv_layers with their quantized cache's scales (--kv-cache int8 / int4: export/cpu/kv_quant.py), calibrated on
    the float decoder over the calibration prompts (calibration's, as text, where given; else GPTQ's) each followed by
    its greedy answer; unchanged for the float cache."""
    if not plan.kv_bits:
        return kv_layers
    from tokenizers import Tokenizer

    from ..eval.samples import CALIBRATION_PROMPTS
    from ..runtime.prompt.build import text_prompt
    from .cpu.calibrate_gptq import TOKENS

    prompts = list(dict.fromkeys(q for _, q in calibration)) if calibration else CALIBRATION_PROMPTS
    p.start(f"KV cache calibration (int{plan.kv_bits}: {len(prompts)} prompts + {TOKENS} generated tokens each)")
    tok = Tokenizer.from_str(json.dumps(plan.tok_json))
    ids = [text_prompt(plan.prompt, tok, q).ids for q in prompts]
    absmax, rows = kv_quant.calibrate(decoder, embed, ids, TOKENS)
    quants = iter(kv_quant.scales(absmax, rows, plan.kv_bits))
    out = [dataclasses.replace(layer, quant=next(quants)) if isinstance(layer, mf.AttentionLayer) else layer
           for layer in kv_layers]
    for i, layer in enumerate(out):  # (what the bundle's loader would refuse: before anything is written)
        if problem := layer.problem():
            raise kv_quant.KVQuantError(f"--kv-cache int{plan.kv_bits}: kv.layers[{i}] ({layer.kind}): {problem}")
    p.done(f"({rows} rows)")
    return out


def _write_graphs(plan: Plan, modules: dict, tmp: Path, p: Progress, hessian=None,
                  kv_layers: list = (), keep: set[int] = frozenset()) -> list[tuple[str, str]]:
    """The decoder graph(s), then vision.onnx, each with its own data (_share_weights gathers them); returns
    [(graph name, file stem)]. modules: {"vision": tower, "decoder": decoder}, the torch modules, taken out of the
    dict (the caller keeps no other reference): each one's weights are released once traced for the last time
    (release_weights; keep: the checkpoint's own storages), before the last decoder graph's ONNX passes (graphs.
    finish_decoder: the float graph read back and quantized) and the vision graph (export memory: at the E2B shape
    the decoder's are GBs; what torch.export still holds of them: docs/gemma4.md).
    hessian: the GPTQ calibration (_gptq_hessians), None without a GPTQ precision; kv_layers: the manifest's (their
    quant: a quantized cache's scales)."""
    cfg, prec, t = plan.cfg, plan.prec, plan.cfg.text
    decoder = modules.pop("decoder")
    decoder_graphs = []
    verify = plan.htp["lookahead_ar"] if plan.htp else 0
    steps = [(name, ar) for name, ar in (("prefill", plan.prefill_ar), ("decode", 1),
                                         *([("verify", verify)] if verify else []))
             if not (plan.one_graph and name == "decode")]
    for k, (name, ar) in enumerate(steps):
        h = plan.head or prec[_like(name)]
        ctx = plan.max_seq_len
        cdesc = f"any context <= {ctx} in steps of {plan.context_step}" if plan.context_step else f"context {ctx}"
        what = f"prefill + decode graph (AR=1..{ar}" if plan.one_graph else f"{name} graph (AR={ar}"
        p.start(f"{what}, {cdesc}, {t.layers} layers, {prec[_like(name)]}, lm head {h})")
        stem = "decoder" if plan.one_graph else name
        traced = graphs.trace_decoder(decoder, attention=plan.attention, ar=ar, max_context=ctx, hidden=t.row_width,
                                      io_dtype=plan.dtype, precision=prec[_like(name)], head=h, path=tmp / f"{stem}.onnx",
                                      cpu=plan.htp is None, dynamic_context=plan.context_step > 0,
                                      dynamic_ar=plan.one_graph, hessian=hessian, token_rows=plan.token_rows,
                                      kv_quant=[layer for layer in kv_layers
                                                if isinstance(layer, mf.AttentionLayer) and layer.quant])
        if k == len(steps) - 1:
            vision = modules["vision"]  # (traced next: a weight it shares with the decoder is kept)
            release_weights(decoder, keep | {w.untyped_storage().data_ptr() for w in [*vision.parameters(), *vision.buffers()]})
            del vision
            del decoder
            gc.collect()
        graphs.finish_decoder(traced)
        decoder_graphs.append((name, stem))
        if plan.one_graph:
            decoder_graphs.append(("decode", "decoder"))
        p.done()
    budget = "patch budget" if "max_patches" in plan.host.image.params else "1 tile ="
    p.start(f"vision graph ({budget} {cfg.patches_per_tile} patches -> {cfg.tokens_per_tile} tokens, {prec['vision']})")
    vision = modules.pop("vision")  # (after the decoder: its weights, GBs, are gone by now)
    graphs.trace_vision(vision, vision_examples(vision, cfg.patches_per_tile, 3 * cfg.vision.patch_size**2),
                        ["image_embeds", *vision_row_outputs(vision)], plan.dtype, prec["vision"], tmp / "vision.onnx")
    release_weights(vision, keep)
    del vision
    gc.collect()
    graphs.finish_vision(tmp / "vision.onnx", prec["vision"])
    p.done()
    return decoder_graphs


def release_weights(module, keep: set[int]) -> None:
    """Free the memory of a traced module's weights (its parameters' and buffers' storages, resized to 0 bytes), but
    those of storages in keep (the checkpoint's own: a float32 checkpoint's tensors are the module's weights and the
    token table's rows) and those the ONNX exporter made non-resizable (it reads weights through Tensor.numpy()).
    Once its last graph is traced nothing reads them, but torch.export keeps tensors that share their storage alive
    after the trace (graphs.forget_trace drops one holder): what is freed here is freed whatever holds it (at Gemma 4
    E2B's full depth the 1.6 GB float32 tied head among it; export memory: docs/gemma4.md)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in keep and storage.resizable() and tensor.device.type == "cpu":
            storage.resize_(0)


def _share_weights(tmp: Path, decoder_graphs: list[tuple[str, str]], p: Progress) -> None:
    """Each graph family's weights once in its data file; a decoder tensor equal to one of the host files' (a tied lm
    head's re-scored int8 rows and their scales: the int8 embedding table's) is read from that file instead."""
    p.start("sharing weights between graphs")
    graphs.share_weights(tmp, ["vision.onnx"], "vision.data")
    graphs.share_weights(tmp, [f"{g}.onnx" for g in sorted({stem for _, stem in decoder_graphs})], "decoder.data",
                         known=graphs.npy_tensors(tmp, ["embed.npy", "embed_scale.npy"]))
    p.done()


def _disk_full(e: OSError) -> bool:
    """ENOSPC; or numpy's ndarray.tofile failing (onnx_ir writes a graph's external data with it), whose OSError keeps
    no errno: "problem writing element N to file"."""
    return e.errno == errno.ENOSPC or (e.errno is None and str(e).startswith("problem writing element"))


def _like(graph: str) -> str:
    """The graph whose precision a decoder graph has: the verify graph is the decode graph at another AR."""
    return "decode" if graph == "verify" else graph


def _write_host_files(plan: Plan, embed: TokenTable, tmp: Path, p: Progress) -> tuple[str, str | None]:
    """The embedding table in its stored form (Plan.table_form: float rows, or int8 / 4-bit codes + scales: a lookup
    touches a few rows) and the tokenizer; returns (form, scale file or None). The table is converted, quantized and
    written row block by row block (TokenTable.blocks: never whole in memory; each file is np.save's, byte for byte)."""
    form = plan.table_form
    p.start(f"embedding table ({form}) + tokenizer")
    vocab, width = embed.shape
    codes = np.dtype(table_rows.CODE_DTYPES[table_rows.manifest_of(form)[0]])
    parts = table_rows.parts_of(form, plan.cfg.text.hidden, width)
    scale_file = None if parts or table_rows.FORMS[form][0] > 8 else "embed_scale.npy"
    with contextlib.ExitStack() as files:
        table = _npy_writer(files, tmp / "embed.npy", codes,
                            (vocab, table_rows.row_bytes(parts) if parts else table_rows.code_width(form, width)))
        if scale_file:
            group = table_rows.FORMS[form][1]
            scales = _npy_writer(files, tmp / scale_file, np.dtype(np.float16 if group else np.float32),
                                 (vocab, table_rows.scale_width(form, width)) if group else (vocab,))
        for _, rows in embed.blocks():
            if parts:  # a split form: each row one run of bytes, its parts side by side
                table.write(table_rows.pack(rows, parts).tobytes())
                continue
            q, s = table_rows.quantize(rows, form)
            table.write(q.tobytes())
            if scale_file:
                scales.write(s.tobytes())
    shutil.copyfile(plan.ckpt.path / "tokenizer.json", tmp / "tokenizer.json")
    p.done()
    return form, scale_file


def _npy_writer(files: contextlib.ExitStack, path: Path, dtype: np.dtype, shape: tuple):
    """An open file with np.save's header for a C-ordered array of dtype and shape; its data is written next."""
    f = files.enter_context(open(path, "wb"))
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": shape})
    return f


def _graph_spec(plan: Plan, name: str, path: Path) -> mf.GraphSpec:
    prec = plan.prec[_like(name)]
    ins, outs = graphs.io_specs(path)
    weights = ({"block_size": quantize.BLOCK_SIZE, "symmetric": prec not in (*quantize.OFFSETS, *quantize.GPTQ)}
               if prec in quantize.WEIGHT_ONLY_BITS else {})
    if name == "vision" and prec == "w8a8" and plan.dtype == "fp32":  # quantize.int8_matmuls
        weights = {"per_channel": True, "symmetric": True, "activations": "uint8, one scale per tensor at run time"}
    if name != "vision":
        weights["lm_head"] = plan.head or prec
        if prec in quantize.MIX_OF:
            weights["8bit"] = {"precision": quantize.MIX_OF[prec], "matmuls": list(quantize.MIXED_8BIT)}
    return mf.GraphSpec(file=path.name, precision=prec, inputs=ins, outputs=outs, weights=weights,
                        **graphs.weight_table(path))


def _manifest(plan: Plan, tmp: Path, decoder_graphs: list[tuple[str, str]], table_form: str,
              scale_file: str | None, kv_layers: list, batched: bool, extra_inputs: list, row_outputs: list,
              valid_rows: bool, spans: bool = False) -> mf.Manifest:
    """The manifest of the files in tmp (all of them: a file it does not list is an error). kv_layers: the decoder's
    cache layers (cache_kinds.kv_layers); batched: whether its gqa_in_place graph takes a batch; extra_inputs: the
    vision graph's inputs after the patch rows, by role; row_outputs: its outputs after the embeddings (the decoder's
    row input); valid_rows: the static decoder graphs take valid_rows (graphs.static_valid_rows); spans: the decoder
    takes each row's image span (decoder.span_input)."""
    t, host = plan.cfg.text, plan.host
    embed_dtype, embed_group = table_rows.manifest_of(table_form)
    parts = table_rows.parts_of(table_form, t.hidden, t.row_width)
    gspecs = {name: _graph_spec(plan, name, tmp / f"{stem}.onnx") for name, stem in [("vision", "vision"), *decoder_graphs]}
    files = sorted({"vision.data", "decoder.data", "embed.npy", "tokenizer.json", *(g.file for g in gspecs.values())}
                   | ({scale_file} if scale_file else set()))
    leftovers = sorted(set(os.listdir(tmp)) - set(files))
    if leftovers:
        raise ExportError(f"export left unlisted files: {leftovers}")
    return mf.Manifest(
        model={"family": plan.family.name, "model_type": plan.ckpt.config.get("model_type"),
               "source": str(plan.src), "exported_by": f"vlmrt {__version__}",
               "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        graphs=gspecs,
        tokenizer_file="tokenizer.json",
        image=host.image,
        prompt=plan.prompt,
        special_tokens=mf.SpecialTokens(image_token_id=host.image_token_id, eos_token_ids=plan.ckpt.eos_ids(plan.tok_json),
                                        pad_token_id=plan.ckpt.pad_id(t.vocab)),
        kv=mf.KVSpec(max_context=plan.max_seq_len, dtype=DTYPES[plan.dtype], layers=kv_layers),
        decoder=mf.DecoderSpec(hidden_size=t.row_width, vocab_size=t.vocab, prefill_ar=plan.prefill_ar,
                               embeds_input="inputs_embeds",
                               positions=mf.PositionsSpec(input="position_ids", rows=host.positions_rows,
                                                          op=host.positions_op),
                               logits_output="logits", kind=_decoder_kind(plan, batched, valid_rows),
                               embedding_file="embed.npy", embedding_dtype=embed_dtype, embedding_group=embed_group,
                               embedding_scale_file=scale_file, embedding_parts=parts and [
                                   mf.TablePart(columns, *table_rows.manifest_of(name)) for name, columns in parts],
                               row_input=_row_input(plan, row_outputs), span_input=SPAN_INPUT if spans else None),
        vision=mf.VisionSpec(patches_input="pixel_patches", embeds_output="image_embeds", tile_inputs=host.tile_inputs,
                             extra_inputs={role: role for role in extra_inputs}, params=_tile_params(plan),
                             row_outputs=list(row_outputs)),
        generate={"default_mode": "hybrid", "modes": ["kv", "hybrid"]},
        files=mf.list_files(tmp, files),
    )


def _tile_params(plan: Plan) -> dict:
    """The tile-inputs op's parameters; an additive mask's value for hidden rows (mask_value) is the HTP's there (a
    small 16-bit range), else the family's (float32's lowest)."""
    params = dict(plan.host.tile_params or {})
    if plan.htp and "mask_value" in params:
        params["mask_value"] = htp_mod.HTP_MASK_VALUE
    return params


def _row_input(plan: Plan, row_outputs: list[str]) -> mf.RowInputSpec | None:
    """The decoder's per-token row input: the vision graph's row outputs side by side (DeepStack)."""
    return mf.RowInputSpec(input=ROW_INPUT, width=len(row_outputs) * plan.cfg.text.hidden) if row_outputs else None


def _decoder_kind(plan: Plan, batched: bool, valid_rows: bool) -> mf.GqaInPlaceKind | mf.RowsDynamicKind | mf.RowsStaticKind:
    """The decoder graphs' kind (manifest.DECODER_KINDS) with its tensor names, as the export wrote them (batched: a
    gqa_in_place graph whose layers' cache kinds take a batch, cache_kinds.batchable)."""
    if graphs.LAYOUTS[plan.attention].in_place:
        return mf.GqaInPlaceKind(name="gqa_in_place", seqlens_input="seqlens_k", total_length_input="total_sequence_length",
                                 logit_rows_input="logit_rows", argmax_output="next_token",
                                 batched=batched,
                                 **({"token_rows_input": "token_rows", "token_scales_input": "token_scales"}
                                    if plan.token_rows else {}))
    if plan.one_graph:
        return mf.RowsDynamicKind(name="rows_dynamic", mask_input="attention_mask", context_step=plan.context_step,
                                  logit_rows_input="logit_rows")
    return mf.RowsStaticKind(name="rows_static", mask_input="attention_mask", context_step=plan.context_step,
                             mask_value=htp_mod.HTP_MASK_VALUE if plan.htp else None,
                             verify_ar=plan.htp["lookahead_ar"] if plan.htp else 0,
                             valid_rows_input=VALID_ROWS if valid_rows else None)


def _span_blocks(plan: Plan, asked: int | None) -> None:
    """Static decoder graphs with a span input (an image's rows see each other both ways: runtime/decode/spans.py):
    a prompt block holds the whole of every span it starts, so the prefill graph's AR must hold the longest span, an
    image's rows (tokens_per_tile: one tile an image where a decoder takes spans). The default AR is raised to it;
    an AR asked for (--prefill-ar) below it is refused."""
    longest = plan.cfg.tokens_per_tile
    if plan.prefill_ar >= longest:
        return
    if asked is not None or longest > plan.max_seq_len:
        raise ExportError(f"this checkpoint's image tokens attend to their whole image (bidirectional vision "
                          f"attention), so a static prefill block must hold an image's {longest} tokens: "
                          f"--prefill-ar {longest} or more (this export: {plan.prefill_ar}, max context "
                          f"{plan.max_seq_len})")
    plan.prefill_ar = longest


def _export(src: str, out: Path, p: Progress, *, prefill_ar: int | None, max_seq_len: int | None, dtype: str,
            quant: str | None, force: bool, context_step: int | None, attention: str | None, htp: dict | None,
            max_patches: int | None = None, kv_bits: int = 0, calibration: list | None = None,
            table: str | None = None) -> Path:
    import torch

    prec = _precisions(quant, dtype)
    if out.exists() and not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    p.start("reading checkpoint")
    plan = _plan(src, prec, prefill_ar=prefill_ar, max_seq_len=max_seq_len, dtype=dtype, context_step=context_step,
                 attention=attention, htp=htp, max_patches=max_patches)
    if kv_bits and not graphs.LAYOUTS[plan.attention].in_place:
        raise ExportError(f"--kv-cache int{kv_bits} needs the GroupQueryAttention decoder, which this export cannot "
                          "have (one graph for prefill and decode, --prefill-ar > 1, a head_dim multiple of 16)")
    plan.kv_bits, plan.table = kv_bits, table
    if table in table_rows.SPLIT_FORMS and plan.cfg.text.row_width == plan.cfg.text.hidden:
        raise ExportError(f"--table {table} stores a row's per-layer columns apart from its embedding; "
                          f"{plan.family.name}'s rows are the embedding alone: choose one of {', '.join(table_rows.FORMS)}")
    torch.manual_seed(0)
    tensors = plan.ckpt.tensors()
    checkpoint_storages = {t.untyped_storage().data_ptr() for t in tensors.values()}  # (release_weights keeps them)
    vision, decoder, embed = plan.family.weights(plan.cfg, tensors)
    del tensors
    row_outputs = vision_row_outputs(vision)
    rope_rows, levels = decoder.rope_rows, decoder.row_levels  # (families.DecoderModule, checked by Family.weights)
    spans = decoder.span_input
    if spans and not plan.one_graph:
        _span_blocks(plan, prefill_ar)
    if rope_rows != plan.host.positions_rows or bool(levels) != bool(row_outputs):
        raise plan.family.fail(f"the decoder takes {rope_rows} rope rows and {levels} row levels; the host plan gives "
                               f"{plan.host.positions_rows} rows and the vision graph {len(row_outputs)} row outputs")
    note = "from --max-seq-len" if max_seq_len is not None else plan.family.max_context(plan.cfg, plan.host)[1]
    budget = (f"; patch budget {plan.cfg.patches_per_tile} patches" + (" (from --max-patches)" if max_patches else "")
              if "max_patches" in plan.host.image.params else "")
    p.done(f"({plan.ckpt.path}; max context {plan.max_seq_len} tokens: {note}{budget})")

    decoder.window_capacity = graphs.window_capacity(decoder, plan.attention, plan.prefill_ar)  # (as the graphs')
    kv = cache_kinds.kv_layers(decoder, plan.cfg.text, graphs.LAYOUTS[plan.attention].out_prefix)
    batched = cache_kinds.batchable(decoder.layer_kinds)
    extra_inputs = [r for r in vision_examples(vision, plan.cfg.patches_per_tile, 3 * plan.cfg.vision.patch_size**2)
                    if r != "patches"]
    with staging.staged(out) as tmp:
        hessian = _gptq_hessians(plan, decoder, embed, p)
        kv = _kv_quant(plan, decoder, embed, kv, calibration, p)
        layer_kinds = decoder.layer_kinds
        modules = {"vision": vision, "decoder": decoder}
        del vision, decoder  # (_write_graphs frees them once traced: the torch weights, GBs at the E2B shape)
        decoder_graphs = _write_graphs(plan, modules, tmp, p, hessian, kv, checkpoint_storages)
        table_form, scale_file = _write_host_files(plan, embed, tmp, p)
        _share_weights(tmp, decoder_graphs, p)
        del embed, hessian
        gc.collect()
        p.start("manifest")
        valid = graphs.static_valid_rows(layer_kinds, plan.attention, plan.one_graph)
        m = _manifest(plan, tmp, decoder_graphs, table_form, scale_file, kv, batched, extra_inputs, row_outputs,
                      valid, spans)
        mf.save(m, tmp)
        mf.load(tmp)  # what we wrote must read back
        p.done()
        htp = plan.htp  # (its precisions resolved with the checkpoint: _plan)
        if htp:
            t = htp["target"]
            prec = ",".join(f"{g}={v}" for g, v in htp["precisions"].items())
            p.start(f"HTP: calibrating and quantizing ({prec}; uint8 KV), "
                    f"compiling QNN context binaries for {t['soc_name'] or t['soc_model']} (htp_arch {t['htp_arch']})")
            from ..eval.samples import htp_calibration_samples

            with staging.staged(out, "htp") as qdir:
                laps = Laps()
                m = htp_mod.quantize_bundle(tmp, qdir, htp["calibration"] or htp_calibration_samples(), target=htp["target"],
                                            precisions=htp["precisions"], keep_qdq=htp["keep_qdq"],
                                            shared_context=htp["shared_context"], progress=laps)
                mf.save(m, qdir)
                mf.load(qdir)
                p.done(f"({laps})")
                p.start(f"writing {out}")
                staging.publish(qdir, out)
        else:
            p.start(f"writing {out}")
            staging.publish(tmp, out)
        p.done()
    return out


__all__ = ["export", "ExportError", "CheckpointError"]
