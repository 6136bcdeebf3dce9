"""A bundle opened for execution: verified manifest, ORT sessions, tokenizer, embedding table."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import manifest as mf
from ..verify_record import identity

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
DEVICES = ("cpu", "cuda", "htp")
_QNN_REGISTERED = False


def qnn_devices():
    """Register the QNN plugin EP (PyPI onnxruntime-qnn) once; return its ORT devices."""
    global _QNN_REGISTERED
    import onnxruntime as ort

    try:
        import onnxruntime_qnn
    except ImportError:
        raise mf.BundleError("--device htp needs the QNN execution provider: pip install 'vlmrt[htp]'") from None
    if not _QNN_REGISTERED:
        ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        _QNN_REGISTERED = True
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devs:
        raise mf.BundleError("the QNN execution provider found no device")
    return devs, onnxruntime_qnn.get_qnn_htp_path()


def check_threads(threads: int | None) -> None:
    """--threads: None (the default), or 1 to 4x this machine's CPUs (ORT starts every one of them: 100,000 threads
    hung the load; more threads than CPUs only wait for each other)."""
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= 4 * cpus:
        raise ValueError(f"--threads must be between 1 and {4 * cpus} (4x this machine's {cpus} CPUs), not {threads}")


def default_threads() -> int:
    """Physical cores if we can tell, else logical CPUs available to this process."""
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        n = len(cores)
    except OSError:
        n = 0
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, avail) if n else avail)


class SharedWeights:
    """Graph initializers kept in the bundle's data files, memory-mapped once and handed to every
    session as OrtValues over the mapping (SessionOptions.add_initializer): the prefill and decode sessions
    of a two-graph bundle then share one copy of the weights — the page cache's — instead of each
    reading its own. Keyed by file, offset, dtype and shape, the same bytes give the same OrtValue.

    MatMulNBits inputs are left out: the CPU kernel computes from its own prepacked copy, and ORT, when it
    maps such a weight itself, drops the mapping once the copy exists; a shared mapping would keep both
    resident for the session's life (memory figures: docs/performance.md). The scales and zero points among them
    (GraphSpec.load_only_weights) are mapped one weight per mapping (own=True), whose pages drop_pages unmaps while
    the session is built (dropping)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.maps: dict[str, mmap.mmap] = {}
        self.values: dict[tuple, object] = {}
        self.own: dict[tuple, mmap.mmap] = {}  # (file, offset, length) -> the mapping of that weight alone

    def initializers(self, graph: mf.GraphSpec, weights: list[dict] | None = None, own: bool = False) -> dict[str, object]:
        """name -> OrtValue for the graph's mapped weights (GraphSpec.mapped_weights, written by the export), or for
        those of the list weights; own: each in a mapping of its own pages (a page fault maps up to 64 KB around it,
        within one mapping: a whole-file one would gather the neighbouring weights' pages too)."""
        import onnxruntime as ort

        out = {}
        for w in graph.mapped_weights if weights is None else weights:
            try:
                dtype, shape = np.dtype(w["dtype"]), tuple(w["shape"])
            except TypeError:
                raise mf.BundleError(f"graph {graph.file}: weight {w['name']!r} has an unknown dtype {w['dtype']!r}") from None
            key = (w["file"], w["offset"], w["length"], dtype.str, shape)
            if key not in self.values:
                try:
                    buf, at = self._mapping(w, own)
                    arr = np.frombuffer(buf, dtype=np.uint8, count=w["length"], offset=at).view(dtype).reshape(shape)
                except ValueError as e:
                    raise mf.BundleError(f"graph {graph.file}: weight {w['name']!r} does not fit {w['file']}: {e}") from None
                self.values[key] = ort.OrtValue.ortvalue_from_numpy(arr)
            out[w["name"]] = self.values[key]
        return out

    def _mapping(self, w: dict, own: bool) -> tuple[mmap.mmap, int]:
        """(mapping, the weight's offset in it)."""
        if not own:
            if w["file"] not in self.maps:
                with open(self.folder / w["file"], "rb") as f:
                    self.maps[w["file"]] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self.maps[w["file"]], w["offset"]
        start = w["offset"] // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        key = (w["file"], w["offset"], w["length"])
        if key not in self.own:
            with open(self.folder / w["file"], "rb") as f:
                self.own[key] = mmap.mmap(f.fileno(), w["offset"] + w["length"] - start, offset=start,
                                          access=mmap.ACCESS_READ)
        return self.own[key], w["offset"] - start

    def drop_pages(self, weights: list[dict]) -> None:
        """Unmap the resident pages of these weights' own mappings (MADV_DONTNEED: the file stays in the page cache;
        a later read faults them back in, so this is safe whoever reads them, and when). For GraphSpec.load_only_weights
        while their session is built: ORT's x86 int8-compute MatMulNBits copies the scales into its packed weights and
        keeps the originals, which it never reads again (16 MB for SmolLM2-135M w4a8; docs/performance.md#memory)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for w in weights:
            m = self.own.get((w["file"], w["offset"], w["length"]))
            if m is not None:
                m.madvise(mmap.MADV_DONTNEED)

    @contextlib.contextmanager
    def dropping(self, weights: list[dict], every_s: float = 0.02):
        """drop_pages(weights) every every_s seconds while the block runs (a session build: ORT releases the GIL
        while it prepacks), and once more at its end. ORT packs node by node and never reads a node's scales again,
        so their pages need not pile up until the session exists: for SmolLM2-135M w4a8 that pile was the load's
        peak, 14 MB above what stays (docs/performance.md#memory)."""
        done = threading.Event()

        def drop() -> None:
            while not done.wait(every_s):
                self.drop_pages(weights)

        t = threading.Thread(target=drop, name="vlmrt-drop-pages", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
            self.drop_pages(weights)


class EmbeddingRows:
    """A bundle's [vocab, hidden] embedding table (.npy), read a few rows at a time with pread. A prompt touches a
    few hundred scattered rows; through a memory map each row faults in (and counts in RSS) the 64 KB around it
    (most of an int8 table after a long prompt; docs/performance.md)."""

    def __init__(self, path: Path):
        arr = np.load(path, mmap_mode="r")  # reads the header: shape, dtype, where the rows start
        if not arr.flags.c_contiguous:
            raise mf.BundleError(f"{path.name}: the embedding table must be C-ordered")
        self.shape, self.dtype, self._offset = arr.shape, arr.dtype, arr.offset
        self._row = arr.shape[1] * arr.dtype.itemsize
        del arr
        self._fd = os.open(path, os.O_RDONLY)
        self._one_row = np.empty(self.shape[1], self.dtype)  # row()'s buffer
        self._one = memoryview(self._one_row.view(np.uint8))

    def __getitem__(self, ids) -> np.ndarray:
        """ids [n] -> rows [n, hidden]"""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"token id out of range 0..{self.shape[0] - 1}")
        out = np.empty((ids.size, self.shape[1]), self.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        row = self._row
        for i, t in enumerate(ids.tolist()):
            if os.preadv(self._fd, [buf[i * row : (i + 1) * row]], self._offset + t * row) != row:
                raise mf.BundleError("embedding table file is truncated")
        return out

    def row(self, token: int) -> np.ndarray:
        """Token's row [hidden] (0 <= token < vocab, unchecked here), in a buffer the next call overwrites."""
        self.read_into(token, self._one)
        return self._one_row

    def read_into(self, token: int, buf) -> None:
        """Token's row (0 <= token < vocab, unchecked here) into buf, a writable buffer of one row's bytes (the
        decode step's bound input, StepBuffers.token_row)."""
        if os.preadv(self._fd, [buf], self._offset + token * self._row) != self._row:
            raise mf.BundleError("embedding table file is truncated")

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def release_freed_heap() -> None:
    """Give the heap that loading freed back to the OS (glibc's malloc_trim; a no-op elsewhere). Parsing the
    tokenizer's JSON and the graphs leaves freed heap that RSS keeps counting."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def make_session(path: Path, device: str, threads: int | None, target: dict | None = None,
                 shared: SharedWeights | None = None, graph: mf.GraphSpec | None = None, config: dict | None = None,
                 load_only: SharedWeights | None = None):
    """An ORT session for the graph file at path; with shared (and the graph's spec), its mapped weights come from
    the shared mapping; config: more session config entries (the QNN EP's context sharing); with load_only, the
    graph's load_only_weights come from that mapping, whose pages are dropped while the session is built."""
    import onnxruntime as ort

    if device not in DEVICES:
        raise mf.BundleError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or default_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    providers = None
    if device == "htp":
        # everything on the NPU: a node the HTP cannot take is an error, not a silent CPU fallback
        devs, backend = qnn_devices()
        opts = {"backend_path": backend}
        for k in ("soc_model", "htp_arch"):
            if target and target.get(k):
                opts[k] = str(target[k])
        opts.update(graph.qnn_options if graph is not None else {})  # e.g. an fp16 graph's precision flag
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        for k, v in (config or {}).items():
            so.add_session_config_entry(k, v)
        so.add_provider_for_devices(devs, opts)
    else:
        providers = PROVIDERS[device]
        if providers[0] not in ort.get_available_providers():
            raise mf.BundleError(f"device {device!r} needs onnxruntime's {providers[0]}, which this onnxruntime lacks")
        if shared is not None:
            for name, value in shared.initializers(graph).items():
                so.add_initializer(name, value)
            if not graph.prepacked:
                # prepacking would give each session a private packed copy of every float weight (on top of the
                # shared mapping): far less memory and a faster load without it, at a slower prefill step (figures:
                # docs/history.md) — ORT's Python API has no shared prepacked-weights container to get both.
                # MatMulNBits keeps prepacking: its CPU kernel computes from that layout.
                so.add_session_config_entry("session.disable_prepacking", "1")
        if load_only is not None:
            for name, value in load_only.initializers(graph, graph.load_only_weights, own=True).items():
                so.add_initializer(name, value)
    building = load_only.dropping(graph.load_only_weights) if load_only is not None else contextlib.nullcontext()
    try:
        with building:
            if providers is None:
                return ort.InferenceSession(str(path), sess_options=so)
            return ort.InferenceSession(str(path), sess_options=so, providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise mf.BundleError(f"cannot load graph {path.name}: {str(e).splitlines()[0]}") from None


def _graph_files(m: mf.Manifest, device: str, htp_arch) -> tuple[dict[str, str], dict[str, dict]]:
    """graph name -> the file its session loads (the QNN context on the HTP, the ONNX graph elsewhere), and
    file -> extra session config entries."""
    have_ctx = all(g.context for g in m.graphs.values())
    if device != "htp":
        if any(g.file is None for g in m.graphs.values()):
            raise mf.BundleError("this HTP bundle holds only QNN context binaries, which only the QNN EP runs: use "
                                 "--device htp, or re-export with --keep-qdq to run it on the CPU EP")
        return {n: g.file for n, g in m.graphs.items()}, {}
    built = m.target.get("htp_arch")
    if have_ctx and htp_arch is not None and str(htp_arch).lower().lstrip("v") != str(built):
        raise mf.BundleError(f"this bundle's context binaries were compiled for htp_arch {built} "
                             f"({m.target.get('soc_name') or 'soc model ' + str(m.target.get('soc_model'))}), not "
                             f"{htp_arch}: re-export with --soc-model/--htp-arch for this device")
    if not have_ctx:  # a QDQ-only HTP bundle: the QNN EP compiles each graph at load
        return {n: g.file for n, g in m.graphs.items()}, {}
    files = {n: g.context.file for n, g in m.graphs.items()}
    config: dict[str, dict] = {}
    if m.target.get("shared_context"):
        import platform

        if platform.machine().lower() in ("x86_64", "amd64"):
            raise mf.BundleError("this bundle's prefill and decode share one QNN context, which the x86-64 HTP "
                                 "simulator cannot load (it crashes in contextCreateFromBinary); run it on a Snapdragon "
                                 "device, or re-export without --htp-shared-context")
        for n in ("prefill", "decode"):
            config[files[n]] = {"ep.share_ep_contexts": "1"}
        config[files["decode"]]["ep.stop_share_ep_contexts"] = "1"
    return files, config


class Sessions(Mapping):
    """graph name -> ORT session, each created on first use (a text-only request never loads the vision graph);
    graphs that share a file share one session. load_s: seconds spent creating sessions so far, per graph name."""

    def __init__(self, path: Path, m: mf.Manifest, device: str, threads: int | None, shared: SharedWeights | None,
                 files: dict[str, str], config: dict[str, dict], verified: dict[str, list[int]] | None = None):
        """files: graph name -> the file its session loads; config: file -> more session config entries
        (_graph_files). verified: bundle file -> its identity (verify_record.identity) when manifest.load verified
        it; a session created later (the vision graph's, on the first image) first checks that its files are still
        those: a file changed since is hashed again, and refused if its sha256 is no longer the manifest's."""
        self.path, self.m, self.device, self.threads, self.shared = path, m, device, threads, shared
        self.files, self.config, self.verified = files, config, verified
        # a graph whose data file no other graph reads (the vision graph) gains nothing from the shared mapping:
        # ORT loads it itself, prepacks its weights (a faster vision tile) and drops the unpacked copy
        specs = {files[name]: g for name, g in m.graphs.items()}
        self.users: dict[str, int] = {}
        for g in specs.values():
            for loc in set(g.data_files):
                self.users[loc] = self.users.get(loc, 0) + 1
        self.by_file: dict[str, object] = {}
        self.load_s: dict[str, float] = {}

    def __getitem__(self, name: str):
        g, f = self.m.graphs[name], self.files[name]
        s = self.by_file.get(f)
        if s is None:
            t = time.perf_counter()
            self._still_verified(name)
            shared = self.shared if any(self.users[loc] > 1 for loc in g.data_files) else None
            s = make_session(self.path / f, self.device, self.threads, self.m.target, shared, g, self.config.get(f),
                             self.shared if g.load_only_weights else None)
            for other, spec in self.m.graphs.items():  # the graph file's I/O are what the manifest says
                if self.files[other] == f:
                    check_io(s, other, spec, f)
                    check_agrees(s, other, self.m, f)
            self.by_file[f] = s
            release_freed_heap()
            self.load_s[name] = time.perf_counter() - t
        return s

    def _still_verified(self, name: str) -> None:
        """The graph's files are those manifest.load verified, else hashed again (BundleError if altered)."""
        if self.verified is None:
            return
        for field_name, f in mf.bundle_paths(self.m):
            if not field_name.startswith(f"graphs.{name}.") or f not in self.verified:
                continue
            p = self.path / f
            try:
                st = p.stat()
            except OSError as e:
                raise mf.BundleError(f"bundle file missing since the bundle was loaded: {p} ({e.strerror})") from None
            if identity(st) == self.verified[f]:
                continue
            entry = self.m.files[f]
            if st.st_size != entry["bytes"] or mf.sha256_file(p) != entry["sha256"]:
                raise mf.BundleError(f"bundle file altered since the bundle was loaded (sha256 mismatch): {p}")
            self.verified[f] = identity(st)

    def __iter__(self):
        return iter(self.m.graphs)

    def __len__(self) -> int:
        return len(self.m.graphs)

    def loaded(self, name: str) -> bool:
        return self.files[name] in self.by_file


def check_io(s, name: str, g: mf.GraphSpec, file: str) -> None:
    for kind, have, want in (("inputs", s.get_inputs(), g.inputs), ("outputs", s.get_outputs(), g.outputs)):
        if sorted(t.name for t in have) != sorted(t.name for t in want):
            raise mf.BundleError(f"graph {file}'s {kind} {sorted(t.name for t in have)[:6]} disagree with "
                                 f"the manifest's graphs.{name}.{kind}")


def _static(shape) -> list:
    return [d if isinstance(d, int) else None for d in shape]


def _agree(have, want) -> bool:
    """Two shapes agree where both dims are numbers."""
    return len(have) == len(want) and all(a is None or b is None or a == b for a, b in zip(_static(have), _static(want)))


def check_agrees(s, name: str, m: mf.Manifest, file: str) -> None:
    """The graph file's tensors have the static dims the manifest's graphs.<name> says."""
    g = m.graphs[name]
    for kind, have in (("inputs", s.get_inputs()), ("outputs", s.get_outputs())):
        spec = {t.name: t.shape for t in getattr(g, kind)}
        for t in have:
            if t.name in spec and not _agree(t.shape, spec[t.name]):
                raise mf.BundleError(f"graph {file}'s {t.name} has shape {t.shape}, the manifest's graphs.{name} "
                                     f"says {spec[t.name]}")


def check_numbers(m: mf.Manifest) -> None:
    """The manifest's numbers agree with its own graph specs (which check_agrees holds to the graph files): the KV
    cache's layers and shape for the decoder graphs, a tile's patches and tokens per tile for the vision graph. A
    manifest that loads but disagrees would otherwise fail inside ORT, or answer from misplaced rows."""
    v = m.graphs["vision"]
    side = m.image.tile_size // m.image.patch_size
    want_in = [side * side, 3 * m.image.patch_size ** 2]
    have_in = v.input(m.vision.patches_input).shape
    if m.image.tile_size % m.image.patch_size or not _agree(have_in, want_in):
        raise mf.BundleError(f"the manifest's image tile_size {m.image.tile_size} and patch_size {m.image.patch_size} "
                             f"do not fit the vision graph's input {have_in}")
    rows = v.output(m.vision.embeds_output).shape[:1]
    if m.prompt.tokens_per_tile < 1 or not _agree(rows, [m.prompt.tokens_per_tile]):
        raise mf.BundleError(f"the manifest's prompt.tokens_per_tile {m.prompt.tokens_per_tile} is not the vision "
                             f"graph's {rows[0] if rows else '?'} rows per tile")
    kv = m.kv
    for name in ("prefill", "decode", "verify"):
        if name not in m.graphs:
            continue
        shapes = {t.name: t.shape for t in m.graphs[name].inputs}
        layers = sum(kv.key_input.format(layer=i) in shapes for i in range(len(shapes) + 1))
        if kv.layers < 1 or layers != kv.layers or kv.key_input.format(layer=kv.layers - 1) not in shapes:
            raise mf.BundleError(f"the manifest's kv.layers {kv.layers} is not graphs.{name}'s {layers} cache layers")
        want = ([1, kv.heads, kv.max_context, kv.head_dim] if kv.layout == "in_place"
                else [kv.max_context if not m.decoder.context_step else None, kv.dim])
        have = shapes[kv.key_input.format(layer=0)]
        if not _agree(have, want) or (kv.layout == "in_place" and kv.heads * kv.head_dim != kv.dim):
            raise mf.BundleError(f"the manifest's kv (max_context {kv.max_context}, dim {kv.dim}, heads {kv.heads}, "
                                 f"head_dim {kv.head_dim}) does not fit graphs.{name}'s cache input {have}")


@dataclass
class Bundle:
    path: Path
    manifest: mf.Manifest
    sessions: Sessions  # graph name -> session, created on first use
    tokenizer: object  # tokenizers.Tokenizer
    embed_table: EmbeddingRows  # [vocab, hidden], indexed by token ids
    embed_scale: np.ndarray | None = None  # [vocab] row scales of an int8 table
    shared: SharedWeights | None = None  # must outlive the sessions: they read its memory

    @classmethod
    def open(cls, path: str | Path, device: str = "cpu", threads: int | None = None, verify: bool = True,
             htp_arch: str | int | None = None) -> "Bundle":
        """htp_arch: the device's Hexagon arch, if known (`vlmrt run --htp-arch`): a bundle whose context binaries
        were compiled for another one is refused."""
        from tokenizers import Tokenizer

        check_threads(threads)
        path = Path(path)
        m = mf.load(path, verify=verify)
        check_numbers(m)
        # what was verified, so that a session created later (the vision graph's) checks its files are still those
        verified = {f: identity((path / f).stat()) for f in m.files} if verify else None
        if device == "htp" and m.target.get("name") != "htp":
            raise mf.BundleError(f"this bundle was exported for {m.target.get('name')}; export with --target htp to run on the HTP")
        graphs, config = _graph_files(m, device, htp_arch)
        try:  # first, so that the heap its parse frees is given back before the sessions' peak
            tok = Tokenizer.from_file(str(path / m.tokenizer_file))
        except Exception as e:
            raise mf.BundleError(f"cannot load tokenizer {m.tokenizer_file}: {e}") from None
        release_freed_heap()
        shared = SharedWeights(path) if device != "htp" else None  # the QNN EP compiles its own copy
        sessions = Sessions(path, m, device, threads, shared, graphs, config, verified)
        for name in ("prefill", "head", "decode"):  # every request needs the decoder; the vision graph only an image's
            # (decode loads last: with shared QNN contexts it stops the sharing)
            if name in m.graphs:
                sessions[name]  # noqa: B018 (loads it)
        release_freed_heap()
        table = EmbeddingRows(path / m.decoder.embedding_file)
        if table.shape != (m.decoder.vocab_size, m.decoder.hidden_size):
            raise mf.BundleError(f"embedding table shape {table.shape} does not match the manifest")
        if str(table.dtype) != m.decoder.embedding_dtype:
            raise mf.BundleError(f"embedding table dtype {table.dtype} is not the manifest's {m.decoder.embedding_dtype}")
        scale = np.load(path / m.decoder.embedding_scale_file) if m.decoder.embedding_scale_file else None
        return cls(path, m, sessions, tok, table, scale, shared)
