"""Gemma 4's token rows (the embedding and the per-layer rows side by side, families/gemma4/language.py) in each of
the table's stored forms (runtime/table_rows.py, `vlmrt export --table`), against the float16 table: teacher-forced
top-1 agreement and KL(float16 ‖ form) of the next-token distributions, on the float16 table's own greedy answers;
and with one part of the row (the embedding, or the per-layer rows) in a form, the other float16.

    python -m benchmarks.gemma4_table_rows tiny            # the decoder tests' "shared" and "plain" checkpoints
    python -m benchmarks.gemma4_table_rows bundle DIR [--hidden 1536]   # a bundle (its float16 / float32 table)
    python -m benchmarks.gemma4_table_rows rewrite DIR OUT --table FORM [--hidden 1536]  # DIR's bundle, its table in FORM
    (tiny / bundle: --forms A,B,... measures those forms only)
    python -m benchmarks.gemma4_table_rows table CKPT OUT --table FORM [--hidden 1536]   # a checkpoint's token table alone
    python -m benchmarks.gemma4_table_rows rss OUT pread|mmap|in_ram [--rows 331]        # its RSS, rows read one by one

`table` writes the table a Gemma 4 checkpoint's export would (its embedding × sqrt(hidden) beside its per-layer
table × sqrt(per_layer), a block of rows at a time: export/pipeline.py's writer) with the decoder fields that name
its form (table.json); `rss`, in a fresh process, opens it as the runtime does (runtime/bundle.py _token_table:
`pread`), through np.load's memory map, or np.load'ed whole, then reads `--rows` distinct random rows (a 256-row
prompt's lookup, the rest one row at a time as decode steps read them) and prints RSS from /proc/self/status
before, after opening, after the rows, and the peak, and the mean µs of a one-row read.

`tiny` quantizes the float32 table the export would quantize; `bundle` the bundle's float16 rows (a bundle's
float16 rows quantized again: the float16 step's error, 4e-4 of a row's range, is inside every form's). Each form's
rows are table_rows.dequantize(table_rows.quantize(rows)), what the runtime reads. Random weights: these bound the
error a form adds on rows of these magnitudes, not what a released checkpoint loses."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from vlmrt.runtime import table_rows

FORMS = ["float16", "int8", "int8g64", "int4g32", "int4g64", "float16+int8g64", "float16+int4g32", "float16+int4g64"]
# one part of the row in a form, the other float16: "F@embedding" (the first `hidden` columns), "F@per_layer" (the rest)
PARTS = ["int8g64@embedding", "int8g64@per_layer", "int4g32@embedding", "int4g32@per_layer"]
TEXTS = ["Describe the picture in one sentence.", "What is the capital of France? Answer briefly.",
         "Write a short poem about the sea and the wind.", "List three prime numbers and explain why they are prime."]


def stored(rows: np.ndarray, form: str, hidden: int) -> np.ndarray:
    """float32 rows as `form` gives them back (a FORMS name, or one of PARTS: that part only, the other float16)."""
    form, _, part = form.partition("@")
    f16 = rows.astype(np.float16).astype(np.float32)
    if table_rows.split_of(form):  # the split forms' stored rows (what runtime/table_rows.py PartRows reads)
        parts = table_rows.parts_of(form, hidden, rows.shape[1])
        return table_rows.unpack(table_rows.pack(rows, parts), parts)
    if not part:
        return table_rows.dequantize(*table_rows.quantize(rows, form), form, rows.shape[1])
    cols = slice(0, hidden) if part == "embedding" else slice(hidden, None)
    x = rows[:, cols]
    f16[:, cols] = table_rows.dequantize(*table_rows.quantize(x, form), form, x.shape[1])
    return f16


class FormRows:
    """rows by token id of a float table, as a stored form gives them (quantized and dequantized per row)."""

    def __init__(self, table, form: str, hidden: int):
        self.table, self.form, self.hidden = table, form, hidden
        self.shape, self.dtype = table.shape, np.dtype(np.float32)

    def __getitem__(self, ids):
        rows = np.asarray(self.table[np.asarray(ids, np.int64).reshape(-1)], np.float32)
        return stored(rows, self.form, self.hidden)

    def row(self, token: int):
        return self[[token]][0]


def compare(scheduler_for, prompts: list[list[int]], n: int, forms: list[str]) -> dict:
    """form -> {top1, kl_mean, kl_max, positions}: each prompt's float16 greedy answer of n tokens, teacher-forced."""
    ref = scheduler_for("float16")
    answers, ref_logits = [], []
    for ids in prompts:
        ans = list(ref.generate(ref.embed(ids), mode="hybrid", max_new_tokens=n, ignore_eos=True))
        answers.append(ans)
        ref_logits.append(ref.rows[0].score(ref.embed(ids), ans))
    out = {}
    for form in forms:
        sched = scheduler_for(form)
        top, kls = [], []
        for ids, ans, want in zip(prompts, answers, ref_logits):
            got = sched.rows[0].score(sched.embed(ids), ans)
            top.append(got.argmax(-1) == want.argmax(-1))
            p, q = _log_softmax(want), _log_softmax(got)
            kls.append((np.exp(p) * (p - q)).sum(-1))
        top, kls = np.concatenate(top), np.concatenate(kls)
        out[form] = {"top1": float(top.mean()), "kl_mean": float(kls.mean()), "kl_max": float(kls.max()),
                     "positions": int(top.size)}
        print(f"  {form:18s} top-1 {out[form]['top1']:.4f}  KL mean {out[form]['kl_mean']:.2e}  max "
              f"{out[form]['kl_max']:.2e}  ({top.size} positions)", flush=True)
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def tiny(only: list[str] | None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torchvision_ops

    torchvision_ops.declare()
    import test_gemma4_decoder as t

    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in ("shared", "plain"):
            folder = Path(d) / name
            folder.mkdir()
            model, config = t._checkpoint(name, folder)
            ex = t.Exported(model, config, folder / "decoder.onnx")
            fp32 = ex.table.copy()
            print(f"{name}: table {fp32.shape}", flush=True)

            def scheduler_for(form, ex=ex, fp32=fp32):
                ex.table = stored(fp32, form, ex.text.hidden)
                return ex.scheduler()

            forms = [f for f in FORMS + PARTS if ex.text.per_layer or not ("@" in f or "+" in f)]
            results[name] = {"table": list(fp32.shape), "forms": compare(scheduler_for, t.PROMPTS, 32,
                                                                         [f for f in forms if f in (only or forms)])}
    return results


def bundle(path: Path, n: int, hidden: int, only: list[str] | None) -> dict:
    from vlmrt.runtime.bundle import Bundle
    from vlmrt.runtime.vlm import VLM

    b = Bundle.open(path, threads=2)
    base = b.embed_table
    prompts = [b.tokenizer.encode(text).ids for text in TEXTS]
    print(f"{path}: table {base.shape} {b.manifest.decoder.embedding_dtype}", flush=True)

    def scheduler_for(form):
        b.embed_table = FormRows(base, form, hidden)
        return VLM.scheduler_for(b, 1)

    t0 = time.time()
    out = compare(scheduler_for, prompts, n, only or FORMS + PARTS)
    print(f"  ({time.time() - t0:.0f} s)")
    return {"table": list(base.shape), "forms": out}


def rewrite(src: Path, out: Path, form: str, hidden: int) -> None:
    """The bundle src with its token table in another stored form (its other files hard-linked): src's rows
    quantized a block at a time (export/pipeline.py's writers), the manifest's table fields and files updated. For
    measuring a form without exporting again (a table quantized from float16 rows: `bundle` above says what that
    differs by)."""
    import dataclasses
    import os

    from vlmrt.export import pipeline
    from vlmrt.format import manifest as mf

    m = mf.load(src, verify=False)
    out.mkdir(parents=True)
    for name in m.files:
        if name not in (m.decoder.embedding_file, m.decoder.embedding_scale_file, "tokenizer.json"):
            os.link(src / name, out / name)
    table = np.load(src / m.decoder.embedding_file, mmap_mode="r")
    vocab, width = table.shape

    class Blocks:  # TokenTable.blocks over the float rows
        shape = table.shape

        def blocks(self):
            step = max(1, (64 << 20) // (4 * width))
            for start in range(0, vocab, step):
                yield start, np.asarray(table[start:start + step], np.float32)

    plan = SimpleNamespace(table_form=form, ckpt=SimpleNamespace(path=src),
                           cfg=SimpleNamespace(text=SimpleNamespace(hidden=hidden)))
    _, scale_file = pipeline._write_host_files(plan, Blocks(), out, pipeline.Progress(1, False))
    dtype, group = table_rows.manifest_of(form)
    parts = table_rows.parts_of(form, hidden, width)
    files = [n for n in m.files if n not in (m.decoder.embedding_file, m.decoder.embedding_scale_file)]
    files += [m.decoder.embedding_file] + ([scale_file] if scale_file else [])
    dec = dataclasses.replace(m.decoder, embedding_dtype=dtype, embedding_group=group, embedding_scale_file=scale_file,
                              embedding_parts=parts and [mf.TablePart(c, *table_rows.manifest_of(f)) for f, c in parts])
    mf.save(dataclasses.replace(m, decoder=dec, files=mf.list_files(out, files)), out)
    mf.load(out)
    print(out, {n: (out / n).stat().st_size for n in (m.decoder.embedding_file, scale_file) if n})


def table(ckpt: Path, out: Path, form: str, hidden: int) -> None:
    import json as _json

    from vlmrt.export import pipeline
    from vlmrt.families.checkpoint import Checkpoint
    from vlmrt.families.token_table import TokenTable

    ck = Checkpoint.open(ckpt)
    text = ck.config.get("text_config", ck.config)
    tensors = ck.tensors()
    prefix = "model.language_model."
    per_layer = text["hidden_size_per_layer_input"]
    embed = TokenTable([(tensors[prefix + "embed_tokens.weight"], text["hidden_size"] ** 0.5),
                        (tensors[prefix + "embed_tokens_per_layer.weight"], per_layer ** 0.5)], text["vocab_size"])
    assert text["hidden_size"] == hidden, (text["hidden_size"], hidden)
    out.mkdir(parents=True)
    plan = SimpleNamespace(table_form=form, ckpt=SimpleNamespace(path=ckpt),
                           cfg=SimpleNamespace(text=SimpleNamespace(hidden=hidden)))
    t0 = time.time()
    _, scale_file = pipeline._write_host_files(plan, embed, out, pipeline.Progress(1, False))
    dtype, group = table_rows.manifest_of(form)
    parts = table_rows.parts_of(form, hidden, embed.shape[1])
    (out / "table.json").write_text(_json.dumps({
        "embedding_file": "embed.npy", "embedding_dtype": dtype, "embedding_group": group,
        "embedding_scale_file": scale_file, "hidden_size": embed.shape[1], "vocab_size": embed.shape[0],
        "embedding_parts": parts and [{"columns": c, "dtype": table_rows.manifest_of(f)[0],
                                       "group": table_rows.FORMS[f][1] or None} for f, c in parts]}))
    print(out, embed.shape, {n.name: n.stat().st_size for n in out.glob("*.npy")}, f"{time.time() - t0:.0f} s")


class ArrayRows:
    """An ndarray (memory-mapped or whole) read as runtime/weights.py EmbeddingRows reads: rows by ids, one row."""

    def __init__(self, arr: np.ndarray):
        self.arr, self.shape, self.dtype = arr, arr.shape, arr.dtype

    def __getitem__(self, ids):
        return self.arr[ids]

    def row(self, token: int):
        return self.arr[token]


def rss(folder: Path, how: str, rows: int) -> None:
    import json as _json
    import resource

    from vlmrt.format.manifest import TablePart
    from vlmrt.runtime.bundle import _token_table
    from vlmrt.runtime.decode.embedding import TokenEmbedding

    def mb():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    spec = _json.loads((folder / "table.json").read_text())
    spec["embedding_parts"] = spec["embedding_parts"] and [TablePart(**p) for p in spec["embedding_parts"]]
    before = mb()
    t, scale = _token_table(folder, SimpleNamespace(**spec))
    if how != "pread":  # the stored rows through a memory map, or whole in RAM, dequantized as the runtime does
        arr = np.load(folder / spec["embedding_file"], mmap_mode="r" if how == "mmap" else None)
        reader = ArrayRows(arr.view(np.ndarray))
        if isinstance(t, table_rows.PartRows):
            t.data = reader
        elif isinstance(t, table_rows.GroupRows):
            raise SystemExit("a whole-row grouped table: pread only here")
        else:
            t = reader
    opened = mb()
    emb = TokenEmbedding(t, scale, np.float32)
    ids = np.random.default_rng(0).choice(np.arange(300, spec["vocab_size"]), rows, replace=False)
    prompt = min(256, rows)
    emb.embed(ids[:prompt])
    out = np.empty(spec["hidden_size"], np.float32)
    t0 = time.perf_counter()
    for token in ids[prompt:].tolist():
        emb.into(token, out)
    per_row = (time.perf_counter() - t0) / max(1, rows - prompt) * 1e6
    print(_json.dumps({"how": how, "file_mb": round((folder / spec["embedding_file"]).stat().st_size / 2**20, 1),
                       "rss_before_mb": round(before, 1), "rss_opened_mb": round(opened, 1),
                       "rss_after_rows_mb": round(mb(), 1), "rows": rows, "us_per_row": round(per_row, 1),
                       "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["tiny", "bundle", "rewrite", "table", "rss"])
    ap.add_argument("path", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--table", default="int4g32")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1536, help="bundle / rewrite: the embedding part's width (E2B: 1536)")
    ap.add_argument("--forms", default=None, help="measure these forms only (comma-separated)")
    ap.add_argument("--rows", type=int, default=331, help="rss: rows read (256 as a prompt, the rest one by one)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    if a.what == "rewrite":
        rewrite(Path(a.path), Path(a.out), a.table, a.hidden)
        return
    if a.what == "table":
        table(Path(a.path), Path(a.out), a.table, a.hidden)
        return
    if a.what == "rss":
        rss(Path(a.path), a.out, a.rows)
        return
    only = a.forms.split(",") if a.forms else None
    res = tiny(only) if a.what == "tiny" else bundle(Path(a.path), a.tokens, a.hidden, only)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
