"""Compile an HTP bundle's QDQ graphs into QNN context binaries (ONNX Runtime EPContext models).

For each graph the QNN EP (HTP backend; on x86-64 the compile runs in the SDK's host tools) builds and
finalizes the graph for one Hexagon arch and writes `<graph>_ctx.onnx` (one EPContext node) + the
`<graph>_ctx_qnn.bin` it names (session options `ep.context_enable=1`, `ep.context_embed_mode=0`,
`ep.context_file_path`). `vlmrt run --device htp` then loads the binary instead of compiling at load.
A binary is pinned to the arch it was compiled for.

shared=True compiles prefill and decode into one context (`ep.share_ep_contexts=1`, the last with
`ep.stop_share_ep_contexts=1`): one .bin, one copy of the decoder weights. The x86-64 HTP simulator
crashes loading such a binary (docs/npu-deploy.md), so it is a flag, unverified here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# SoC name -> (QNN soc_model id, HTP arch); ids from the QAIRT SDK's QnnTypes.h (as ExecuTorch's qc_schema.py lists them)
SOCS = {
    "SM8850": (87, 81),  # Snapdragon 8 Elite Gen 5
    "SM8750": (69, 79),  # Snapdragon 8 Elite
    "SM8650": (57, 75),  # Snapdragon 8 Gen 3
    "SM8550": (43, 73),  # Snapdragon 8 Gen 2
    "SC8380XP": (60, 73),  # Snapdragon X Elite (Windows on Snapdragon)
}
DEFAULT_SOC = "SM8750"  # a current flagship


class TargetError(ValueError):
    pass


def resolve_target(soc_model: str | int | None, htp_arch: str | int | None) -> dict:
    """--soc-model (a name in SOCS or a QNN id) / --htp-arch -> {"soc_model": id, "soc_name", "htp_arch"}; neither: DEFAULT_SOC."""
    if soc_model is None and htp_arch is None:
        soc_model = DEFAULT_SOC
    ids = {v[0]: (k, v[1]) for k, v in SOCS.items()}
    name, soc_id, arch = None, 0, None
    if soc_model is not None:
        s = str(soc_model).upper()
        if s in SOCS:
            name, (soc_id, arch) = s, SOCS[s]
        elif s.isdigit() and int(s) in ids:
            soc_id, (name, arch) = int(s), ids[int(s)]
        elif s.isdigit():
            soc_id = int(s)
        else:
            raise TargetError(f"unknown --soc-model {soc_model!r}; give a QNN soc model id or one of {', '.join(SOCS)}")
    if htp_arch is not None:
        a = str(htp_arch).lower().lstrip("v")
        if not a.isdigit():
            raise TargetError(f"--htp-arch must be a number such as 75 or 79, not {htp_arch!r}")
        if arch is not None and int(a) != arch:
            raise TargetError(f"--htp-arch {a} disagrees with --soc-model {name} (htp_arch {arch})")
        arch = int(a)
    if arch is None:
        raise TargetError(f"--soc-model {soc_id} is not one vlmrt knows ({', '.join(SOCS)}): give --htp-arch too")
    return {"soc_model": soc_id, "soc_name": name, "htp_arch": arch}


def compile_graphs(folder: Path, graphs: list[str], target: dict, shared: bool = False,
                   options: dict[str, dict] | None = None) -> dict[str, dict]:
    """folder/<g>.onnx (QDQ or float, with its data files) -> folder/<g>_ctx.onnx + its .bin for each g in graphs,
    options[g]: more QNN provider options for g (GraphSpec.qnn_options). Returns g -> {"file", "binary", "sdk", "seconds"}; with shared, prefill and decode (in that order, last)
    go into one context."""
    import onnx
    import onnxruntime as ort

    from ...runtime.sessions import qnn_devices

    devs, backend = qnn_devices()
    opts = {"backend_path": backend, "htp_arch": str(target["htp_arch"])}
    if target.get("soc_model"):
        opts["soc_model"] = str(target["soc_model"])
    share = [g for g in graphs if shared and g in ("prefill", "decode")]
    out, keep = {}, []  # (shared sessions must stay open until the last one has written the context)
    for g in graphs:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_embed_mode", "0")
        so.add_session_config_entry("ep.context_file_path", str(folder / f"{g}_ctx.onnx"))
        if g in share:
            so.add_session_config_entry("ep.share_ep_contexts", "1")
            if g == share[-1]:
                so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
        so.add_provider_for_devices(devs, {**opts, **(options or {}).get(g, {})})
        t = time.perf_counter()
        try:
            keep.append(ort.InferenceSession(str(folder / f"{g}.onnx"), sess_options=so))
        except Exception as e:  # ORT's own exception types
            raise TargetError(f"the QNN EP cannot compile the {g} graph for htp_arch {target['htp_arch']}: "
                              f"{str(e).splitlines()[0]}") from None
        out[g] = {"file": f"{g}_ctx.onnx", "seconds": time.perf_counter() - t}
        if g not in share:
            keep.clear()
    keep.clear()
    for g, o in out.items():  # the binary the EPContext node names (ORT picks the file name)
        node = onnx.load(str(folder / o["file"])).graph.node
        if len(node) != 1 or node[0].op_type != "EPContext":
            raise TargetError(f"the QNN EP did not compile the whole {g} graph into one context (nodes: "
                              f"{sorted({n.op_type for n in node})})")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node[0].attribute}
        o["binary"] = attrs["ep_cache_context"].decode()
        o["sdk"] = attrs.get("ep_sdk_version", b"").decode()
        if not (folder / o["binary"]).is_file() or os.path.dirname(o["binary"]):
            raise TargetError(f"the {g} context names a binary {o['binary']!r} that is not next to it")
    return out


QDQ_FILES = {"vision": ("vision.onnx", "vision.data"), "prefill": ("prefill.onnx", "decoder.data"),
             "decode": ("decode.onnx", "decoder.data"), "verify": ("verify.onnx", "decoder.data"),
             "head": ("head.onnx", "head.data")}


def compile_bundle(folder: Path, gspecs: dict, files: list[str], target: dict, keep_qdq: bool, shared: bool):
    """The HTP bundle in folder gains a context per graph; without keep_qdq its QDQ graphs and their data files
    are removed. Returns (graph specs, file names, target's QNN fields: qnn_sdk, shared_context)."""
    import dataclasses

    from ...format import manifest as mf

    ctx = compile_graphs(folder, list(gspecs), target, shared, {g: s.qnn_options for g, s in gspecs.items()})
    gspecs = {g: dataclasses.replace(s, context=mf.QnnContext(file=ctx[g]["file"], binary=ctx[g]["binary"]))
              for g, s in gspecs.items()}
    files = list(files) + sorted({f for c in ctx.values() for f in (c["file"], c["binary"])})
    if not keep_qdq:
        qdq = {f for g in gspecs for f in QDQ_FILES[g]}
        for f in sorted(qdq):
            os.remove(folder / f)
        files = [f for f in files if f not in qdq]
        gspecs = {g: dataclasses.replace(s, file=None, data_files=[], mapped_weights=[], load_only_weights=[])
                  for g, s in gspecs.items()}
    sdk = sorted({c["sdk"] for c in ctx.values()})
    return gspecs, files, {"qnn_sdk": ",".join(sdk), "shared_context": shared,
                           "compile_s": {g: round(c["seconds"], 3) for g, c in ctx.items()}}
