"""ONNX Runtime sessions for a bundle's graphs: providers (CPU, CUDA, the QNN EP's HTP), threads, one session per
graph file (the decoder's at load, the vision graph's on the first image), the graphs' I/O checked against the
manifest."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path

from ..format import manifest as mf
from ..format.verify_record import identity
from . import gqa_kernel, huge_pages
from .weights import SharedWeights, release_freed_heap

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
DEVICES = ("cpu", "cuda", "htp")
_QNN_REGISTERED = False
_EVENTS_OFF = False


def telemetry_off(ort) -> None:
    """ORT's telemetry events off, unless the environment asks for them (ORT_DISABLE_TELEMETRY=0). vlmrt/__init__.py
    sets ORT_DISABLE_TELEMETRY, which stops the uploader, but onnxruntime reads it only when it is imported: a
    program that imported onnxruntime before vlmrt still gets its events turned off here (all but the start-up
    event, which onnxruntime may have queued already)."""
    global _EVENTS_OFF
    if not _EVENTS_OFF and os.environ.get("ORT_DISABLE_TELEMETRY", "1") != "0":
        ort.disable_telemetry_events()
        _EVENTS_OFF = True


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


def make_session(path: Path, device: str, threads: int | None, target: dict | None = None,
                 shared: SharedWeights | None = None, graph: mf.GraphSpec | None = None, config: dict | None = None,
                 load_only: SharedWeights | None = None):
    """An ORT session for the graph file at path; with shared (and the graph's spec), its mapped weights come from
    the shared mapping; config: more session config entries (the QNN EP's context sharing); with load_only, the
    graph's load_only_weights come from that mapping, whose pages are dropped while the session is built."""
    import onnxruntime as ort

    telemetry_off(ort)
    if device not in DEVICES:
        raise mf.BundleError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or default_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    providers = None
    held: list[object] = []  # the OrtValues the session reads its mapped weights from (kept alive with it)
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
                held.append(value)
            if not graph.prepacked:
                # prepacking would give each session a private packed copy of every float weight (on top of the
                # shared mapping): far less memory and a faster load without it, at a slower prefill step (figures:
                # docs/history.md) — ORT's Python API has no shared prepacked-weights container to get both.
                # MatMulNBits keeps prepacking: its CPU kernel computes from that layout.
                so.add_session_config_entry("session.disable_prepacking", "1")
        if load_only is not None:
            for name, value in load_only.initializers(graph, graph.load_only_weights, own=True).items():
                so.add_initializer(name, value)
                held.append(value)
    building = load_only.dropping(graph.load_only_weights) if load_only is not None else contextlib.nullcontext()
    try:
        with building:
            if providers is None:
                session = ort.InferenceSession(str(path), sess_options=so)
            else:
                session = ort.InferenceSession(str(path), sess_options=so, providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise mf.BundleError(f"cannot load graph {path.name}: {str(e).splitlines()[0]}") from None
    # ORT reads added initializers where they are and holds no Python reference to them: the session keeps the
    # OrtValues (each keeps its array, each array its memory map), so a session outliving its Bundle (a CacheRow
    # kept after its VLM is dropped) does not read unmapped memory
    session.vlmrt_weights = held
    return session


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
        self.gqa_kernel = gqa_kernel.for_cache(m.kv)  # ORT's GroupQueryAttention kernel, by the decoder's cache

    def __getitem__(self, name: str):
        g, f = self.m.graphs[name], self.files[name]
        s = self.by_file.get(f)
        if s is None:
            t = time.perf_counter()
            self._still_verified(name)
            shared = self.shared if any(self.users[loc] > 1 for loc in g.data_files) else None
            with gqa_kernel.building(self.gqa_kernel):
                s = make_session(self.path / f, self.device, self.threads, self.m.target, shared, g, self.config.get(f),
                                 self.shared if g.load_only_weights else None)
            for other, spec in self.m.graphs.items():  # the graph file's I/O are what the manifest says
                if self.files[other] == f:
                    check_io(s, other, spec, f)
                    check_agrees(s, other, self.m, f)
            self.by_file[f] = s
            release_freed_heap()
            huge_pages.collapse_populated()  # the weights it packed onto 2 MiB pages: fewer TLB misses a step
            self.load_s[name] = time.perf_counter() - t
        return s

    def prefill_rows(self) -> int | None:
        """The most rows a prefill call of the decoder should take on the attention kernel these sessions run
        (gqa_kernel.PREFILL_ROWS: the CPU EP's `scores` kernel holds a call's scores); None: no bound but the bundle's
        block."""
        return gqa_kernel.PREFILL_ROWS[gqa_kernel.running(self.gqa_kernel)] if self.device == "cpu" else None

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


def agree(have, want) -> bool:
    """Two shapes agree where both dims are numbers."""
    return len(have) == len(want) and all(a is None or b is None or a == b for a, b in zip(_static(have), _static(want)))


def check_agrees(s, name: str, m: mf.Manifest, file: str) -> None:
    """The graph file's tensors have the static dims the manifest's graphs.<name> says."""
    g = m.graphs[name]
    for kind, have in (("inputs", s.get_inputs()), ("outputs", s.get_outputs())):
        spec = {t.name: t.shape for t in getattr(g, kind)}
        for t in have:
            if t.name in spec and not agree(t.shape, spec[t.name]):
                raise mf.BundleError(f"graph {file}'s {t.name} has shape {t.shape}, the manifest's graphs.{name} "
                                     f"says {spec[t.name]}")
