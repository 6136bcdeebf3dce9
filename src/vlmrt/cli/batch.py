"""`vlmrt batch`: every record of a data set answered into a JSONL file (vlmrt.batch; docs/batch.md)."""

from __future__ import annotations

import json

from ..serve.arguments import check_url_policy, url_policy_args  # (argparse only: the server loads when it runs)
from .options import _bundle_or_default, _fetch, _generation_args, _grammar, _grammar_args, _logprobs_arg, _options


def add_parser(sub) -> None:
    t = sub.add_parser("batch", help="answer every record of a data set into a JSONL file (one process or Ray Data actors)")
    _generation_args(t, "intra-op threads per worker (default: 1 worker in process, the physical cores; more, "
                        "the CPUs divided by the workers, on a cluster the smallest node's)")
    t.add_argument("--input", required=True, metavar="SRC",
                   help="a folder of images (with --prompt) or a JSONL file of records: id, image (a path, URL or data "
                        "URI, or a list of them) and prompt, or id and messages")
    t.add_argument("--output", required=True, metavar="OUT.jsonl",
                   help="results, one line per record (appended; a rerun skips the ids already in it)")
    t.add_argument("--prompt", default=None, help="the question for a folder's images and for records without one")
    t.add_argument("--workers", type=int, default=1,
                   help="workers, each loading the bundle once (default 1: in this process; more: Ray Data actors)")
    t.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: a local Ray for the job)")
    t.add_argument("--batch-size", type=int, default=4,
                   help="records a worker answers together, decoding together where the bundle's decoder takes a batch "
                        "(one decoder call per step for all of them); on Ray also the records per call (default 4)")
    t.add_argument("--retry-errors", action="store_true", help="do again the records whose line in OUT is an error")
    url_policy_args(t, "records'")  # (a refused URL: the record's error line)
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    _grammar_args(t, "every answer (a record's own response_format instead, where it has one)")
    _logprobs_arg(t, "each answer's line gets them as logprobs (OpenAI's shape)")
    t.set_defaults(fn=run)


def run(a) -> int:
    from ..batch.runner import Job, report, run_batch

    check_url_policy(a)
    opts, max_pixels = _options(a), _fetch(a).max_pixels
    fmt = _grammar(a)
    if fmt is not None:
        opts["response_format"] = fmt
    if a.logprobs is not None:
        opts["logprobs"] = a.logprobs
    if a.workers < 1:  # before the default model is built
        raise ValueError("--workers must be >= 1")
    job = Job(bundle=_bundle_or_default(a.bundle), input=a.input, output=a.output, prompt=a.prompt, workers=a.workers,
              threads=a.threads, ray_address=a.ray_address, device=a.device, verify=a.bundle is not None,
              kv_requant=not a.no_kv_requant, lookahead=a.lookahead, options=opts, batch_size=a.batch_size, retry_errors=a.retry_errors,
              progress=not a.quiet, allow_local_urls=a.allow_local_urls, image_urls=not a.no_image_urls,
              max_pixels=max_pixels)
    s = run_batch(job)
    report(s)
    if a.json:
        from dataclasses import asdict

        print(json.dumps(asdict(s)))
    return 0
