"""`vlmrt batch`: answer every record of a data set into OUT, in this process or on Ray Data actors.

    summary = run_batch(Job(bundle, "questions.jsonl", "answers.jsonl", workers=2, options={...}))

Plan: read the records (records.py), repair OUT and skip the ids it has (output.py), write the error line of each
record that cannot be asked, then answer the rest:
  - workers == 1 and no Ray address: in this process, one Answerer (worker.py); Ray is not needed.
  - otherwise on Ray Data: from_items(requests) -> map_batches(Answerer, ActorPoolStrategy(size=workers),
    num_cpus=threads) -> the driver writes each result line as it comes (streaming, in completion order). Each
    actor loads the bundle once. Ray restarts an actor that dies and retries its tasks (Ray Data's defaults for
    actor pools: max_restarts=-1, max_task_retries=-1); the writer drops a record that comes back twice.
Ray: an existing cluster with `ray_address`, the Ray this process already started (ray.is_initialized()), or a
local one started here for the job: bound to 127.0.0.1, no dashboard, usage stats off, a small object store.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..format.manifest import load as load_manifest
from ..progress import Meter
from ..runtime.media.image import MAX_IMAGE_PIXELS
from ..runtime.media.sources import FetchLimits
from ..runtime.media.url_policy import AddressPolicy
from . import output as out_file
from .records import Record, id_key, read_records
from .worker import Answerer

RAY_HINT = "pip install 'vlmrt[batch]' (ray[data])"
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # a local Ray's object store: requests and result lines are small


class BatchError(ValueError):
    """The job as a whole failed (one line for the CLI)."""


@dataclass(frozen=True)
class Job:
    bundle: str
    input: str
    output: str
    prompt: str | None = None
    workers: int = 1
    threads: int | None = None  # intra-op threads per worker (None: see worker_threads)
    ray_address: str | None = None
    device: str = "cpu"
    verify: bool = True
    kv_requant: bool = True
    lookahead: int = 0  # VLM's draft length of lookahead decoding
    allow_local_urls: bool = False  # image URLs may reach loopback / private / link-local addresses (else public only)
    image_urls: bool = True  # False: records' http(s) image URLs are their error lines
    max_pixels: int = MAX_IMAGE_PIXELS  # decoded pixels of one record's images (--max-pixels; FetchLimits.max_pixels)
    options: dict = field(default_factory=dict)  # VLM.chat's generation options
    batch_size: int = 4  # records a worker answers together (decoding together); per map_batches call on Ray
    retry_errors: bool = False
    progress: bool = True


@dataclass
class Summary:
    records: int = 0  # in the input
    skipped: int = 0  # already in OUT
    answered: int = 0
    errors: int = 0
    duplicates: int = 0  # results that came back twice (retried tasks) and were not written again
    workers: int = 1
    threads: int | None = None
    engine: str = "in-process"  # or "ray"
    seconds: float = 0.0  # the whole job, startup included
    first_result_s: float = 0.0  # until a worker's first result was written (Ray, actors started, bundle loaded)
    records_per_s: float = 0.0  # records done / seconds
    steady_records_per_s: float = 0.0  # worker results after the first / the time between the first and the last

    def line(self) -> str:
        return (f"vlmrt batch: {self.answered} answered, {self.errors} errors, {self.skipped} skipped (already in "
                f"OUT) of {self.records} records; {self.seconds:.1f} s, {self.records_per_s:.2f} records/s "
                f"({self.workers} worker{'s' if self.workers > 1 else ''} x {self.threads or 'default'} "
                f"thread{'' if self.threads == 1 else 's'}, {self.engine})")


def ray_or_none():
    """Ray and Ray Data, or None when not installed. Ray's own log lines below errors are off unless the
    environment asks for them (RAY_DATA_LOG_LEVEL, RAY_BACKEND_LOG_LEVEL): the job shows its own bar."""
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "CRITICAL")  # Ray Data's errors come back as exceptions
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        return None
    return ray


def worker_threads(job: Job, ray=None) -> int | None:
    """Threads per worker: --threads, else the CPUs of this machine (local) or of the smallest node (a cluster)
    shared by the workers, at least 1. In process: the runtime's default."""
    if job.threads is not None:
        return job.threads
    if ray is None:
        return None
    if ray.is_initialized():
        node_cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        total = sum(node_cpus)
        return max(1, int(min(min(node_cpus, default=1), total // job.workers)))
    return max(1, (os.cpu_count() or 1) // job.workers)


def run_batch(job: Job) -> Summary:
    t0 = time.perf_counter()
    if job.workers < 1:
        raise ValueError("--workers must be >= 1")
    if job.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    if job.threads is not None and job.threads < 1:
        raise ValueError("--threads must be >= 1")
    use_ray = job.workers > 1 or job.ray_address is not None
    ray = ray_or_none() if use_ray else None
    if use_ray and ray is None:
        raise ValueError(f"--workers {job.workers} runs on Ray, which is not installed: {RAY_HINT}")
    records = read_records(job.input, job.prompt)
    out = Path(job.output)
    if out.is_dir():
        raise out_file.OutputError(f"--output {out} is a folder; give a .jsonl file")
    out_file.repair(out, say=job.progress)
    done, errors = out_file.done_keys(out)
    # a bad bundle is one error before anything is written or started; workers on this machine read these files
    load_manifest(job.bundle, verify=job.verify)
    out_file.check_options(out, answer_options(job), has_lines=bool(done))
    if job.retry_errors and errors:
        out_file.drop_errors(out)
        done -= errors
    todo = [r for r in records if r.key not in done]
    asks = [r for r in todo if r.error is None]
    local = Answerer(threads=worker_threads(job), **_answerer_kwargs(job, False)) if asks and not use_ray else None
    s = Summary(records=len(records), skipped=len(records) - len(todo), workers=job.workers,
                engine="ray" if use_ray else "in-process")
    writer = out_file.Writer(out, done)
    meter = Meter(len(asks), enabled=job.progress)  # the records asked; those that cannot be are written at once
    first: list[float] = []

    def put(key: str, line: str, is_error: bool) -> None:
        if writer.write(key, line):
            s.errors += is_error
            s.answered += not is_error
            first.append(time.perf_counter()) if not first else None
            meter.advance()

    try:
        for r in todo:
            if r.error is not None:
                s.errors += writer.write(r.key, _error_line(r))
        if local is not None:
            s.threads = worker_threads(job)
            _answer_here(local, asks, put)
        elif asks:
            s.threads = _answer_on_ray(job, ray, asks, put)
        else:
            s.threads = job.threads
    finally:
        writer.close()
        meter.close()
    s.duplicates = writer.duplicates
    t1 = time.perf_counter()
    s.seconds = t1 - t0
    s.records_per_s = (s.answered + s.errors) / s.seconds if s.seconds > 0 else 0.0
    if first:
        s.first_result_s = first[0] - t0
        s.steady_records_per_s = (meter.done - 1) / (t1 - first[0]) if meter.done > 1 and t1 > first[0] else 0.0
    return s


def answer_options(job: Job) -> dict:
    """What the answers in OUT depend on: the bundle (its manifest's sha256, which pins every file's), the default
    prompt, the generation options, the device and the KV requantization. Workers, threads and lookahead (greedy
    output identical) do not change an answer."""
    manifest = Path(job.bundle) / "manifest.json"
    fmt = job.options.get("response_format")  # (a GrammarSpec: its fields)
    options = {**job.options, "response_format": asdict(fmt)} if fmt is not None else job.options
    return dict(bundle=hashlib.sha256(manifest.read_bytes()).hexdigest(), prompt=job.prompt, device=job.device,
                kv_requant=job.kv_requant, **options)


def _error_line(r: Record) -> str:
    return json.dumps({"id": r.id, "error": r.error}, ensure_ascii=False)


def fetch_limits(job: Job) -> FetchLimits:
    """How the workers fetch records' image URLs: records may come from others, so by default only public
    addresses (as vlmrt serve; runtime/media/url_policy.py)."""
    return FetchLimits(addresses=None if job.allow_local_urls else AddressPolicy(), urls=job.image_urls,
                       max_pixels=job.max_pixels)


def _answerer_kwargs(job: Job, verify: bool) -> dict:
    return dict(bundle=job.bundle, device=job.device, verify=verify, kv_requant=job.kv_requant, lookahead=job.lookahead,
                options=job.options, fetch=fetch_limits(job), sequences=job.batch_size)


def _answer_here(w: Answerer, asks: list[Record], put) -> None:
    # batch_size at a time (decoding together): each line is written as soon as it is answered
    for res in w.answers(json.loads(r.request()) for r in asks):
        put(id_key(res["id"]), json.dumps(res, ensure_ascii=False), "error" in res)


def _answer_on_ray(job: Job, ray, asks: list[Record], put) -> int:
    """Answer on Ray Data actors; returns the threads per worker."""
    how = _start_ray(job, ray)
    try:
        threads = worker_threads(job, ray)
        try:  # a cluster's nodes verify their own copies of the bundle
            _stream(job, ray, asks, put, threads, verify=job.verify and how != "local")
        except ray.exceptions.RayError as e:
            if os.environ.get("VLMRT_DEBUG"):
                raise
            raise BatchError(f"the Ray job failed: {ray_error_text(e)}") from None
        return threads
    finally:
        if how != "existing":
            ray.shutdown()


def ray_error_text(e: BaseException) -> str:
    """The message of the error under a Ray exception (e.g. a worker's BundleError when its actor could not start)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if not type(x).__module__.startswith("ray") and isinstance(x, (ValueError, OSError, KeyError)):
            return str(x).strip().splitlines()[0] if str(x).strip() else type(x).__name__
        todo += [c for c in (x.__cause__, x.__context__, getattr(x, "cause", None)) if isinstance(c, BaseException)]
    for line in str(e).splitlines():  # a worker's exception as Ray prints it: "vlmrt.format.manifest.BundleError: ..."
        if line.startswith("vlmrt.") and ": " in line:
            return line.split(": ", 1)[1]
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _start_ray(job: Job, ray) -> str:
    """Use this process's Ray ("existing"), connect to the cluster ("cluster") or start a local one ("local")."""
    import logging

    if ray.is_initialized():
        return "existing"
    quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
    if job.ray_address:
        ray.init(address=job.ray_address, **quiet)
        return "cluster"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    threads = worker_threads(job, ray)
    ray.init(address="local", num_cpus=job.workers * threads, object_store_memory=OBJECT_STORE_BYTES,
             _node_ip_address="127.0.0.1", include_dashboard=False, **quiet)
    return "local"


def _stream(job: Job, ray, asks: list[Record], put, threads: int, verify: bool) -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # ours is the Meter
    ctx.print_on_execution_start = False
    blocks = max(1, min(-(-len(asks) // job.batch_size), 10_000))  # small blocks: results stream back as they are done
    ds = ray.data.from_items([{"request": r.request()} for r in asks], override_num_blocks=blocks)
    ds = ds.map_batches(Answerer, fn_constructor_kwargs={**_answerer_kwargs(job, verify), "threads": threads},
                        batch_size=job.batch_size, compute=ray.data.ActorPoolStrategy(size=job.workers),
                        num_cpus=threads, num_gpus=1 if job.device == "cuda" else None,  # else Ray hides the GPUs
                        batch_format="numpy")
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for key, line, err in zip(batch["key"], batch["line"], batch["error"]):
            put(str(key), str(line), bool(err))


def report(s: Summary) -> None:
    print(s.line(), file=sys.stderr, flush=True)
