"""The engine corpus (issue 44 item 5): greedy ids and teacher-forced logits of the decode engine, recorded on main
6bf0bd2 (before the engine refactor) for every family, mode, precision, the batched path, lookahead, a reused chat
prefix, a video and the HTP target on the simulator; tests/test_engine_corpus.py runs the cases again and compares.

    python tests/engine_corpus.py signature          # this machine's kernel signature (the record's key)
    python tests/engine_corpus.py record --dump A.npz                        # every case; this signature's record
    benchmarks/avx2-only python tests/engine_corpus.py record --dump B.npz   # ... as an AVX2-only CPU
    python tests/engine_corpus.py tolerance A.npz B.npz                      # the cross-signature bounds, into CORPUS

(with the repository's sources first: PYTHONPATH=src, the venv's python). Re-record only for a change that is meant to
change answers, and say why in its commit (docs/testing.md#the-engine-corpus).

What a case records (CORPUS, keyed by the signature of the kernels ORT picks on the machine: `signature()`):
  ids      the greedy ids (24 per answer, EOS ignored), or each sequence's ids
  logits   sha256 of the teacher-forced logits' float32 bytes ([steps, vocab]: row i the logits after the prompt and
           ids[:i], the runtime's scoring path, CacheRow.score as `vlmrt eval` runs it); for the batched cases the sha256
           of the logits rows each sequence's picks were made from in the batched decode calls
  margins  per step the top-1 minus top-2 logit of those logits (where a pick could flip under other rounding)
  (and per run kind: the first turn's ids, drafts proposed / accepted, the copying prompt's ids; the bundle's digest)

The runtime is reached only through the "runtime" section below (VLM.load / chat, the teacher-forced scoring, the batch
driver): a refactor that moves these entry points changes that section, keeping what each function returns, and never
the records.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: the suite's helpers (conftest, family_cases) importable
    sys.path.insert(0, str(HERE))

# (conftest first: torchvision's op schemas before transformers imports it, vlmrt's telemetry off)
from conftest import ASSETS, image_file  # noqa: E402

CORPUS = HERE / "data" / "engine_corpus.json"
STEPS = 24
THREADS = 2  # every session's intra-op threads, fixed (not the machine's core count)
PROMPT = "What is in the image? Describe the colours."
IMAGE = "chelsea.png"
FOLLOW_UP = "And what is behind it?"
COPY = "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana."
HTP_PROMPT = "Describe a red square."
HTP_STEPS = 8
MODES = ("kv", "hybrid")
QUANT = ("w4a16", "w4a8")


# --- the machine's kernel signature -------------------------------------------------------------------------------
# cpuid bits (leaf, sub-leaf, register, bit) that ORT's MLAS dispatches on, named as /proc/cpuinfo names them. Read
# from cpuid as this process sees it (not /proc/cpuinfo), so that benchmarks/avx2-only, which answers cpuid as an
# AVX2-only CPU, gives the AVX2-only signature.
FLAGS = {
    "fma": (1, 0, 2, 12), "avx": (1, 0, 2, 28), "f16c": (1, 0, 2, 29),
    "avx2": (7, 0, 1, 5), "avx512f": (7, 0, 1, 16), "avx512dq": (7, 0, 1, 17), "avx512bw": (7, 0, 1, 30),
    "avx512vl": (7, 0, 1, 31), "avx512_vnni": (7, 0, 2, 11), "avx512_bf16": (7, 1, 0, 5), "avx_vnni": (7, 1, 0, 4),
    "avx512_fp16": (7, 0, 3, 23), "amx_bf16": (7, 0, 3, 22), "amx_tile": (7, 0, 3, 24), "amx_int8": (7, 0, 3, 25),
    "avx_vnni_int8": (7, 1, 3, 4), "avx_ne_convert": (7, 1, 3, 5),
}

# void cpuid(uint32 leaf, uint32 sub, uint32 out[4]) (x86-64 System V): push rbx; mov r8, rdx; mov eax, edi;
# mov ecx, esi; cpuid; mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx; mov [r8+12], edx; pop rbx; ret
_CPUID = bytes.fromhex("53 4989d0 89f8 89f1 0fa2 418900 41895804 41894808 4189500c 5b c3".replace(" ", ""))


def _cpuid():
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(_CPUID)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    fn = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32))(addr)

    def cpuid(leaf: int, sub: int = 0) -> list[int]:
        out = (ctypes.c_uint32 * 4)()
        fn(leaf, sub, out)
        return list(out)

    cpuid.keep = buf  # (the code's mapping lives as long as the function)
    return cpuid


def cpu_flags() -> tuple[str, list[str]]:
    """(vendor, the FLAGS this process's cpuid reports)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine(), []
    cpuid = _cpuid()
    top, b, c, d = cpuid(0)
    vendor = b"".join(x.to_bytes(4, "little") for x in (b, d, c)).decode()
    top7 = cpuid(7, 0)[0] if top >= 7 else 0
    regs = {(1, 0): cpuid(1), (7, 0): cpuid(7, 0) if top >= 7 else [0] * 4,
            (7, 1): cpuid(7, 1) if top7 >= 1 else [0] * 4}
    return vendor, [name for name, (leaf, sub, r, bit) in FLAGS.items() if regs[(leaf, sub)][r] >> bit & 1]


def signature() -> str:
    """The key of this machine's record: ORT's version (the distribution that provides it) and the CPU's vendor and
    the kernel-choosing flags."""
    from importlib import metadata

    import onnxruntime

    dists = [d for d in ("onnxruntime", "onnxruntime-qnn") if _installed(metadata, d)]
    vendor, flags = cpu_flags()
    return f"ort {onnxruntime.__version__} ({'+'.join(dists)}) {vendor} {' '.join(flags)}"


def _installed(metadata, dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


# --- the bundles: the suite's session exports ----------------------------------------------------------------------
class TempFactory:
    """tmp_path_factory's mktemp outside pytest (the recorder)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="engine-corpus-"))

    def mktemp(self, name: str, numbered: bool = True) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))


def _family_case(family: str, name: str):
    from family_cases import FAMILIES

    return FAMILIES[family], next(c for c in FAMILIES[family].cases if c.name == name)


def _export_options(family: str, case) -> dict:
    """The export options family_cases / conftest give the case's fp32 export (the quantized ones take the same)."""
    if family == "smolvlm":
        return dict(prefill_ar=case.prefill_ar, max_seq_len=case.max_seq_len, context_step=0 if case.static else None)
    if family == "internvl":
        return dict(prefill_ar=case.prefill_ar)
    if family == "lfm2_vl":
        return dict(prefill_ar=case.prefill_ar, attention=case.attention, context_step=case.context_step)
    return dict(prefill_ar=case.prefill_ar, attention=case.attention)


_QUANT: dict[tuple, Path] = {}
SHARED_QUANT = ("w8a16", "w4a16", "w4a8", "htp")  # test_quant.bundle's kinds of SmolVLM's default case


def bundle(family: str, case_name: str, precision: str, tmp_path_factory) -> Path:
    """The bundle of a family case at a precision: fp32 the suite's session export (family_cases), SmolVLM's default
    case's quantized and HTP bundles test_quant.bundle's (shared with test_quant, test_gqa, test_htp_*), the others'
    exported here once per session from the same checkpoint with the case's options."""
    fc, case = _family_case(family, case_name)
    ex = fc.exported(case, tmp_path_factory)
    if precision == "fp32":
        return ex.bundle
    if family == "smolvlm" and case is fc.cases[0] and precision in SHARED_QUANT:
        import test_quant

        return test_quant.bundle(precision, tmp_path_factory)
    key = (case_name, precision)
    if key not in _QUANT:
        from vlmrt.export.pipeline import export

        out = tmp_path_factory.mktemp(f"corpus-{case_name}-{precision}") / "bundle"
        _QUANT[key] = export(str(ex.ckpt), out, quant=precision, progress=False, **_export_options(family, case))
    return _QUANT[key]


# --- the runtime (the only part a refactor of the engine's entry points changes) -----------------------------------
def load(path: Path, device: str = "cpu", lookahead: int = 0):
    from vlmrt.runtime.vlm import VLM

    return VLM.load(path, device=device, threads=THREADS, lookahead=lookahead)


def answer(vlm, messages: list[dict], mode: str, n: int = STEPS, **sampling) -> tuple[list[int], object]:
    """A chat turn's ids (EOS ignored) and its stats; the VLM keeps the conversation's cache for a follow-up."""
    for _ in vlm.chat(messages, mode=mode, max_new_tokens=n, ignore_eos=True, **sampling):
        pass
    return list(vlm.result.token_ids), vlm.result.stats


class Oracle:
    """A drafter with PromptLookup's interface that knows plain decoding's answer (`answer`): it proposes the true next
    tokens, every third call with one wrong among them, so that lookahead's verify calls accept several drafts and
    reject the rest (a random fixture model copies from its prompt by chance only)."""

    answer: list[int] = []
    vocab = 0

    def __init__(self, k: int, ids: list[int], adapt: bool = True):
        self.k, self.n, self.calls = k, 0, 0

    def append(self, token) -> None:
        self.n += 1

    def propose(self, limit: int) -> list[int]:
        out = self.answer[self.n : self.n + min(self.k, limit)]
        self.calls += 1
        if self.calls % 3 == 0 and len(out) > 1:
            j = self.calls % len(out)
            out = out[:j] + [(out[j] + 1) % self.vocab]
        return out

    def feedback(self, accepted: int, drafted: int) -> None:
        pass


@contextmanager
def oracle_drafts(answer: list[int], vocab: int):
    """Oracle in place of PromptLookup wherever the runtime imported it, drafting answer."""
    from vlmrt.runtime.decode import lookahead as lookahead_module

    Oracle.answer, Oracle.vocab = answer, vocab
    real = lookahead_module.PromptLookup
    patched = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("vlmrt.")
               and getattr(m, "PromptLookup", None) is real]
    assert patched
    try:
        for m in patched:
            m.PromptLookup = Oracle
        yield
    finally:
        for m in patched:
            m.PromptLookup = real


def teacher_forced(vlm, messages: list[dict], ids: list[int], mode: str) -> np.ndarray:
    """Logits [len(ids), vocab] float32: row i after the prompt (prefilled fresh in mode) and ids[:i], as `vlmrt eval`
    scores (CacheRow.score)."""
    p = vlm.prompt(messages)
    x = vlm.decoder_inputs(p)
    return np.array(vlm.row.score(x.embeds, ids, mode, positions=x.positions, rows=x.rows), np.float32)


def batched(path: Path, plan: list[tuple[list[dict], dict, int]], only: int | None = None):
    """The conversations of plan ((messages, chat options, the round it starts)) through one opened bundle's VLMs over
    one scheduler (VLM.slots, run by the AnswerLoop that runs the server's slots: runtime/answers.py), or only
    plan[only] (the others' rows idle). Returns (whether there was a batch, each conversation's ids, each one's logits
    rows of its batched decode calls [steps, vocab] (None: no batch))."""
    from vlmrt.runtime.answers import AnswerLoop
    from vlmrt.runtime.bundle import Bundle
    from vlmrt.runtime.vlm import VLM

    vlms = VLM.slots(Bundle.open(path, threads=THREADS), len(plan))
    sched = vlms[0].scheduler
    batch = sched.probed is not None  # (several rows of a graph that takes a batch)
    rows: dict[int, list[np.ndarray]] = {i: [] for i in range(len(plan))}
    if batch:
        call = sched.batch_call

        def kept(pending):
            step, dt = call(pending)
            for r in pending:  # (row r: VLM r's sequence; its pick is made from this row)
                rows[r].append(np.array(step.buffers.logits[r], np.float32).reshape(-1))
            return step, dt

        sched.batch_call = kept
    loop = AnswerLoop(vlms)
    for rnd in range(4000):
        for i, (msgs, opts, at) in enumerate(plan):
            if at == rnd and only in (None, i):
                loop.begin(vlms[i].chat_answer(msgs, ignore_eos=True, **opts))
        for _, kind, value in loop.round():
            if kind == "error":
                raise value
        if not loop.busy and rnd > max(at for _, _, at in plan):
            break
    ids = [list(v.result.token_ids) if only in (None, i) else [] for i, v in enumerate(vlms)]
    return batch, ids, [np.stack(r) if r else None for r in rows.values()] if batch else None


# --- the cases ------------------------------------------------------------------------------------------------------
def user(text: str, image: str | None = None, video: str | None = None) -> list[dict]:
    parts = []
    if image:
        parts.append({"type": "image_url", "image_url": {"url": str(image_file(image, Path(tempfile.gettempdir())))}})
    if video:
        parts.append({"type": "video", "video": str(video)})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@dataclass(frozen=True)
class Case:
    """One recorded run. run: "answer" (an image prompt, greedy, teacher-forced), "follow_up" (a second turn reusing
    the first's cache), "lookahead" (--lookahead 4: an oracle drafter on the image prompt, then a prompt that copies),
    "video" (SmolVLM2's frames), "batched" (3 conversations at once through the batched path, then each alone through
    the same batch), "htp" (the QNN HTP simulator, a text prompt)."""

    family: str
    case: str
    precision: str
    run: str
    mode: str = "hybrid"

    @property
    def id(self) -> str:
        return f"{self.family}/{self.case}/{self.precision}/{self.run}/{self.mode}"


RECORDED_FAMILIES = ("smolvlm", "internvl", "lfm2_vl", "qwen_vl")


def _cases() -> list[Case]:
    from family_cases import FAMILIES

    # the families the record (main 6bf0bd2) holds; a family registered after it (Gemma 4) is held to transformers by
    # the conformance and paths runners instead, until its cases are recorded on every signature
    FAMILIES = {name: fc for name, fc in FAMILIES.items() if name in RECORDED_FAMILIES}
    out = []
    for family, fc in FAMILIES.items():
        for c in fc.cases:  # every case (decoder kind) of every family, fp32, both modes
            out += [Case(family, c.name, "fp32", "answer", mode) for mode in MODES]
    # each family's gqa_in_place case (the CPU default) at MatMulNBits' float path (w4a16) and int8 path (w4a8)
    first = {family: fc.cases[0].name for family, fc in FAMILIES.items()}
    for family, name in first.items():
        for precision in QUANT:
            out += [Case(family, name, precision, "answer", mode) for mode in MODES]
    for family, name in first.items():  # the batched path (a one-row call rounds apart from a multi-row one on w4a16)
        out += [Case(family, name, precision, "batched") for precision in ("fp32", *QUANT)]
    for family, name in first.items():  # a second turn on the first's cached prefix; lookahead on a prompt that copies
        out += [Case(family, name, "fp32", run, mode) for run in ("follow_up", "lookahead") for mode in MODES]
    out += [Case("lfm2_vl", "lfm2-attn-conv-conv-attn-conv-rows", "fp32", "lookahead"),  # rows_dynamic's logit rows
            Case("qwen_vl", "qwen2.5-vl-rows", "fp32", "lookahead")]
    out += [Case("smolvlm", first["smolvlm"], "fp32", "video", mode) for mode in MODES]  # SmolVLM2's frames
    # the HTP target (test_quant.bundle("htp"): static QDQ graphs, uint8 KV, a lookahead verify graph of AR 5): on the
    # CPU EP (an image prompt, both modes, lookahead) and on the QNN HTP simulator (a text prompt, both modes)
    out += [Case("smolvlm", first["smolvlm"], "htp", "answer", mode) for mode in MODES]
    out += [Case("smolvlm", first["smolvlm"], "htp", "lookahead")]
    out += [Case("smolvlm", first["smolvlm"], "htp", "htp", mode) for mode in MODES]
    return out


CASES = _cases()

BATCH_PLAN = [(PROMPT, IMAGE, dict(max_new_tokens=16), 0),
              ("Tell me a story.", None, dict(max_new_tokens=24, temperature=0.9, seed=3), 0),
              ("What colour is it?", "tall", dict(max_new_tokens=16), 2)]


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.float32).tobytes()).hexdigest()


def margins(logits: np.ndarray) -> list[float]:
    top = np.sort(logits.astype(np.float64), axis=-1)[:, -2:]
    return [float(f"{m:.4g}") for m in (top[:, 1] - top[:, 0])]


def bundle_digest(path: Path) -> str:
    """sha256 over the bundle's files' sha256 (manifest.json's "files"): which export a record was made on. Not
    compared (an export may change its graph's bytes and not one logit), named in a failure's message."""
    files = json.loads((Path(path) / "manifest.json").read_text())["files"]
    return hashlib.sha256(json.dumps({k: v["sha256"] for k, v in sorted(files.items())}).encode()).hexdigest()[:16]


def run_case(c: Case, tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
    """(the case's record, the logits it hashed, by name: for the cross-signature tolerance)."""
    rec, dump = _run(c, tmp_path_factory)
    return {**rec, "bundle": bundle_digest(bundle(c.family, c.case, c.precision, tmp_path_factory))}, dump


def _run(c: Case, tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
    path = bundle(c.family, c.case, c.precision, tmp_path_factory)
    if c.run == "answer":
        vlm = load(path)
        msgs = user(PROMPT, IMAGE)
        ids, _ = answer(vlm, msgs, c.mode)
        tf = teacher_forced(vlm, msgs, ids, c.mode)
        return {"ids": ids, "logits": _sha(tf), "margins": margins(tf)}, {"tf": tf}
    if c.run == "follow_up":  # turn 2 reuses turn 1's cached prefix (chat); its logits teacher-forced fresh
        vlm = load(path)
        first = user(PROMPT, IMAGE)
        ids1, _ = answer(vlm, first, c.mode)
        msgs = first + [{"role": "assistant", "content": vlm.result.text}] + user(FOLLOW_UP)
        ids2, stats = answer(vlm, msgs, c.mode)
        assert stats.reused_prompt_tokens > 0, "the follow-up reused no prefix"
        tf = teacher_forced(load(path), msgs, ids2, c.mode)
        return {"ids": ids2, "first_ids": ids1, "logits": _sha(tf), "margins": margins(tf)}, {"tf": tf}
    if c.run == "lookahead":
        # the image prompt with an oracle drafter (several drafts accepted per verify call, some rejected), then a
        # prompt that copies with the prompt-lookup drafter; logits teacher-forced plain
        plain, fast = load(path), load(path, lookahead=4)
        msgs = user(PROMPT, IMAGE)
        want, _ = answer(plain, msgs, c.mode)
        with oracle_drafts(want, plain.manifest.decoder.vocab_size):
            ids, stats = answer(fast, msgs, c.mode)
        copy, copied = answer(fast, user(COPY), c.mode)
        tf = teacher_forced(plain, msgs, ids, c.mode)
        return {"ids": ids, "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens, "copy_ids": copy,
                "copy_drafted": copied.drafted_tokens, "copy_accepted": copied.accepted_tokens, "logits": _sha(tf),
                "margins": margins(tf)}, {"tf": tf}
    if c.run == "video":
        vlm = load(path)
        msgs = user("What happens in the video?", video=ASSETS / "no_time_for_that_tiny.gif")
        ids, _ = answer(vlm, msgs, c.mode)
        tf = teacher_forced(vlm, msgs, ids, c.mode)
        return {"ids": ids, "logits": _sha(tf), "margins": margins(tf)}, {"tf": tf}
    if c.run == "htp":  # the QNN EP's HTP simulator, a text prompt (the vision graph on the simulator is slow)
        vlm = load(path, device="htp")
        msgs = user(HTP_PROMPT)
        ids, _ = answer(vlm, msgs, c.mode, n=HTP_STEPS)
        tf = teacher_forced(vlm, msgs, ids, c.mode)
        return {"ids": ids, "logits": _sha(tf), "margins": margins(tf)}, {"tf": tf}
    if c.run == "batched":
        plan = [(user(text, image), opts, at) for text, image, opts, at in BATCH_PLAN]
        was, together, rows = batched(path, plan)
        rec = {"batched": was, "ids": together}
        dump = {}
        if rows:
            rec["logits"] = [_sha(r) for r in rows]
            dump.update({f"together{i}": r for i, r in enumerate(rows)})
        # each greedy sequence's margins from its teacher-forced logits alone (the batched rows lack the prefill's);
        # a sampled one's picks do not follow a margin (None)
        vlm = load(path)
        rec["margins"] = [None if opts.get("temperature") else margins(teacher_forced(vlm, msgs, ids, "hybrid"))
                          for (msgs, opts, _), ids in zip(plan, together)]
        alone_ids, alone_sha = [], []
        for i in range(len(plan)):
            _, ids, rows = batched(path, plan, only=i)
            alone_ids.append(ids[i])
            if rows:
                alone_sha.append(_sha(rows[i]))
                dump[f"alone{i}"] = rows[i]
        rec["alone_ids"] = alone_ids
        if alone_sha:
            rec["alone_logits"] = alone_sha
        return rec, dump
    raise ValueError(c.run)


# --- comparing ------------------------------------------------------------------------------------------------------
def _sequences(rec: dict) -> list[tuple[list[int], list[float] | None]]:
    """(ids, margins per id or None) of each greedy-or-sampled sequence a record holds."""
    if "alone_ids" in rec:  # batched: each sequence together, then alone, under its teacher-forced margins
        return list(zip(rec["ids"], rec["margins"])) + list(zip(rec["alone_ids"], rec["margins"]))
    return [(rec["ids"], rec["margins"])]


def compare(c: Case, got: dict, corpus: dict, sig: str) -> str:
    """Hold a run of case c against the corpus (AssertionError where it differs). On a signature with a record:
    equal bit for bit (ids and logits hashes: "exact"). Elsewhere, against every recorded signature, each greedy
    sequence's ids equal up to the first step whose recorded top-2 margin is within the precision's measured
    cross-signature tolerance (corpus["tolerance"]; a sampled sequence is not compared: "within")."""
    mine = corpus["signatures"].get(sig)
    if mine is not None:
        want = mine["cases"].get(c.id)
        assert want is not None, f"{c.id}: not recorded for this signature ({sig}): python tests/engine_corpus.py record"
        why = "" if got["bundle"] == want["bundle"] else " (and the bundle's files differ from the recorded export's)"
        assert got["ids"] == want["ids"], f"{c.id}: greedy ids differ from the corpus{why}"
        assert got.get("alone_ids") == want.get("alone_ids"), f"{c.id}: ids alone through the batch differ{why}"
        assert {**got, "bundle": None} == {**want, "bundle": None}, f"{c.id}: logits differ from the corpus (ids equal){why}"
        return "exact"
    tol = corpus["tolerance"].get(c.precision, {}).get("margin")
    assert tol is not None, f"{c.id}: no measured cross-signature tolerance for {c.precision} in {CORPUS.name}"
    for s, entry in corpus["signatures"].items():
        want = entry["cases"].get(c.id)
        assert want is not None, f"{c.id}: not recorded for {s}"
        for (g, _), (w, m) in zip(_sequences(got), _sequences(want), strict=True):
            if m is None:
                continue
            k = next((i for i, x in enumerate(m) if x <= tol), len(m))
            assert g[:k] == w[:k], f"{c.id}: ids differ from {s}'s before a step of margin <= {tol} (margins {m})"
    return "within"


def tolerance(dumps: list[Path]) -> dict:
    """Per precision, the largest |logit difference| between two signatures' dumped logits (record --dump) over the
    rows computed on the same ids (up to and including the step where their picks part), and the margin bound 2x
    that: a pick whose top-2 margin exceeds it cannot flip under that rounding difference."""
    corpus = read()
    (sa, a), (sb, b) = [(str(z["__signature__"]), z) for z in map(np.load, dumps)]
    recs = [corpus["signatures"][s]["cases"] for s in (sa, sb)]
    out: dict[str, dict] = {}
    for key in sorted(set(a.files) & set(b.files) - {"__signature__"}):
        cid, name = key.split("|")
        precision = cid.split("/")[2]
        ra, rb = (r[cid] for r in recs)
        if name == "tf":
            ida, idb, first = ra["ids"], rb["ids"], 0
        else:  # batched rows: row j picked ids[j + 1]
            i = int(name[-1])
            field_ = "ids" if name.startswith("together") else "alone_ids"
            ida, idb, first = ra[field_][i], rb[field_][i], 1
        x, y = a[key], b[key]
        same = next((j for j in range(min(len(ida), len(idb))) if ida[j] != idb[j]), min(len(ida), len(idb)))
        rows = min(len(x), len(y), same + 1 - first)
        if rows <= 0:
            continue
        d = float(np.abs(x[:rows].astype(np.float64) - y[:rows]).max())
        t = out.setdefault(precision, {"max_logit_diff": 0.0, "rows": 0, "cases": 0})
        t["max_logit_diff"] = max(t["max_logit_diff"], d)
        t["rows"] += rows
        t["cases"] += 1
    for t in out.values():
        t["margin"] = float(f"{2 * t['max_logit_diff']:.3g}") if t["max_logit_diff"] else 0.0
        t["max_logit_diff"] = float(f"{t['max_logit_diff']:.3g}")
        t["between"] = [sa, sb]
    return out


# --- the record -----------------------------------------------------------------------------------------------------
def read() -> dict:
    return json.loads(CORPUS.read_text()) if CORPUS.exists() else {"signatures": {}, "tolerance": {}}


def record(only: str | None = None, dump: Path | None = None) -> dict:
    tpf = TempFactory()
    sig = signature()
    corpus = read()
    entry = corpus["signatures"].setdefault(sig, {"cases": {}})
    entry["recorded"] = f"{time.strftime('%Y-%m-%d', time.gmtime())} on {platform.node() or 'this machine'}"
    logits = {}
    t0 = time.perf_counter()
    for c in CASES:
        if only and only not in c.id:
            continue
        t = time.perf_counter()
        rec, arrays = run_case(c, tpf)
        entry["cases"][c.id] = rec
        logits.update({f"{c.id}|{k}": v for k, v in arrays.items()})
        print(f"{c.id}: {time.perf_counter() - t:.1f} s", flush=True)
    entry["cases"] = dict(sorted(entry["cases"].items()))
    CORPUS.parent.mkdir(exist_ok=True)
    CORPUS.write_text(json.dumps(corpus, indent=1, sort_keys=False) + "\n")
    if dump:  # (added to the dump already there: a -k record replaces its cases' logits)
        if dump.exists():
            with np.load(dump) as old:
                assert str(old["__signature__"]) == sig, f"{dump} holds another signature's logits"
                logits = {**{k: old[k] for k in old.files if k != "__signature__"}, **logits}
        np.savez_compressed(dump, __signature__=np.array(sig), **logits)
    print(f"{sig}: {len(entry['cases'])} cases in {CORPUS} ({time.perf_counter() - t0:.0f} s)")
    return corpus


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("signature")
    r = sub.add_parser("record")
    r.add_argument("-k", dest="only", help="only the cases whose id contains this")
    r.add_argument("--dump", type=Path, help="also save the logits (npz) for `tolerance`")
    t = sub.add_parser("tolerance", help="measure the cross-signature tolerance from two dumps, write it into CORPUS")
    t.add_argument("dumps", type=Path, nargs=2)
    a = ap.parse_args()
    if a.cmd == "signature":
        print(signature())
    elif a.cmd == "record":
        record(a.only, a.dump)
    else:
        corpus = read()
        corpus["tolerance"] = tolerance(a.dumps)
        CORPUS.write_text(json.dumps(corpus, indent=1) + "\n")
        print(json.dumps(corpus["tolerance"], indent=1))
