"""vlmrt command line: a thin layer over vlmrt.export, vlmrt.runtime and vlmrt.batch."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _export(a) -> int:
    from .export.pipeline import export

    calibration = None
    if a.calibration:
        from .eval.samples import calibration_set

        calibration = calibration_set(a.calibration)
    out = export(a.src, a.out, prefill_ar=a.prefill_ar, max_seq_len=a.max_seq_len, dtype=a.dtype, quant=a.quant,
                 target=a.target, calibration=calibration, soc_model=a.soc_model,
                 htp_arch=a.htp_arch, keep_qdq=a.keep_qdq, shared_context=a.htp_shared_context,
                 context_step=a.context_step, attention=a.attention, lookahead_ar=a.lookahead_ar, force=a.force,
                 progress=not a.quiet)
    print(out)
    return 0


def _stats_report(r) -> str:
    s = r.stats
    lines = [
        f"prompt tokens      {s.prompt_tokens} ({s.images} images, {s.image_tiles} image tiles; "
        f"{s.reused_prompt_tokens} reused)",
        f"generated tokens   {s.generated_tokens} (stop: {s.stop_reason})",
        f"model load         {s.load_s:.3f} s" + (f" (+ vision graph {s.vision_load_s:.3f} s, on first use)"
                                                 if s.vision_load_s else ""),
        f"image preprocess   {s.preprocess_s:.3f} s",
        f"vision encode      {s.vision_s:.3f} s" + (" (skipped: cached)" if s.vision_skipped else ""),
        f"time to 1st token  {s.ttft_s:.3f} s",
        f"prefill            {s.prefill_tokens_per_s:.1f} tokens/s",
        (f"decode             {s.decode_tokens_per_s:.1f} tokens/s ({s.decode_ms_per_token:.1f} ms/token)"
         if s.generated_tokens > 1 else "decode             none (the one token came from prefill)"),
        f"peak RSS           {s.peak_rss_mb:.0f} MB",
    ]
    if s.drafted_tokens:
        lines.insert(-1, f"lookahead          {s.accepted_tokens} of {s.drafted_tokens} drafted tokens accepted")
    return "\n".join(lines)


def _options(a) -> dict:
    """The generation options of `run` and `chat`, checked."""
    from .runtime.sampler import SamplingConfig

    SamplingConfig(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed).validate()
    if a.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    return dict(mode=a.mode, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                seed=a.seed, stop=a.stop, ignore_eos=a.ignore_eos, max_tiles=a.max_tiles, max_frames=a.max_frames)


def _videos(a) -> list:
    """--video (with --fps for a folder of frames) as the turn's VideoSource."""
    from .runtime.conversation import VideoSource

    if a.fps is not None and a.video is None:
        raise ValueError("--fps is the frame rate of a --video folder of frames")
    return [VideoSource(a.video, a.fps)] if a.video is not None else []


def _run(a) -> int:
    from .runtime.conversation import user_turn
    from .runtime.pipeline import VLM

    if (a.messages is None) == (a.prompt is None):
        raise ValueError("give --prompt (with --image / --video ...) or --messages CONV.json")
    if a.messages is not None:
        if a.image or a.video:
            raise ValueError("--messages carries its images and videos (image_url / video_url parts); --image and "
                             "--video do not apply")
        from .runtime.conversation import load_messages

        messages = load_messages(a.messages)
    else:
        messages = user_turn(a.prompt, a.image or [], _videos(a))
    opts = _options(a)
    # the default model's cache was verified (every file's sha256) by ensure_bundle just now
    if a.htp_arch is not None and a.device != "htp":
        raise ValueError("--htp-arch is for --device htp")
    vlm = VLM.load(_bundle_or_default(a.bundle), device=a.device, threads=a.threads, verify=a.bundle is not None,
                   kv_requant=not a.no_kv_requant, htp_arch=a.htp_arch, lookahead=a.lookahead)
    # a one-shot run: nothing to reuse, the same as generate()
    gen = vlm.chat(messages, **opts)
    if a.json:
        for _ in gen:
            pass
        print(json.dumps(vlm.result.to_dict()))
    else:
        for piece in gen:
            print(piece, end="", flush=True)
        print(flush=True)  # the answer's line ends before the report (stderr) when both go to one pipe
        print(_stats_report(vlm.result), file=sys.stderr)
    return 0


def _chat(a) -> int:
    from .chat_repl import repl
    from .runtime.pipeline import VLM

    opts = _options(a)
    vlm = VLM.load(_bundle_or_default(a.bundle), device=a.device, threads=a.threads, verify=a.bundle is not None,
                   kv_requant=not a.no_kv_requant, htp_arch=a.htp_arch, lookahead=a.lookahead)
    return repl(vlm, opts, images=a.image or [], videos=_videos(a), system=a.system, report=_stats_report)


def _bundle_or_default(bundle: str | None) -> str:
    """The given bundle, or the offline default model (exported into the cache on first use)."""
    if bundle is not None:
        return bundle
    from .demo.default_model import ensure_bundle

    return str(ensure_bundle(progress=True))


def _eval_dataset(a) -> int:
    from .demo import easyvqa_data as ev
    from .runtime.pipeline import VLM

    if a.dataset != "easy-vqa":
        raise ValueError(f"unknown --dataset {a.dataset!r} (known: easy-vqa)")
    vlm = VLM.load(_bundle_or_default(a.bundle), device=a.device, threads=a.threads, verify=a.bundle is not None,
                   kv_requant=not a.no_kv_requant)
    rows = ev.select(a.split, a.limit)

    def answer(image, question):
        return vlm(question, image, mode=a.mode, max_new_tokens=8).text

    r = ev.score(answer, rows, a.split, progress=not a.json)
    r.update(bundle=str(vlm.bundle.path), mode=a.mode, device=a.device,
             kv_requant=not a.no_kv_requant, subset=f"all {a.split}" if not a.limit else f"stratified {len(rows)} (seed 0)")
    if a.json:
        print(json.dumps(r))
        return 0
    groups = ", ".join(f"{k} {v:.4f}" for k, v in r["by_group"].items() if v is not None)
    print(f"easy-VQA {a.split}: {r['correct']}/{r['questions']} exact match = {r['accuracy']:.4f} ({groups}); "
          f"{r['subset']}, mode {a.mode}, device {a.device}, {r['seconds']} s")
    return 0


def _eval(a) -> int:
    from .eval import accuracy, samples
    from .runtime.pipeline import VLM

    if a.dataset:
        return _eval_dataset(a)
    if a.reference is None or a.bundle is None:
        raise ValueError("vlmrt eval needs BUNDLE and --reference (or --dataset easy-vqa)")
    if a.tokens < 1:
        raise ValueError("--tokens must be >= 1")
    bundle = VLM.load(a.bundle, device=a.device, threads=a.threads, kv_requant=not a.no_kv_requant)
    ref = accuracy.load_reference(a.reference, bundle)
    if a.image or a.prompt:
        prompts = a.prompt or samples.IMAGE_PROMPTS
        chosen = [(img, p) for img in (a.image or [None]) for p in prompts]
    else:
        chosen = samples.default_samples(text_only=a.text_only)
    r = accuracy.evaluate(bundle, ref, chosen, tokens=a.tokens, mode=a.mode)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"bundle            {r['bundle']}  ({', '.join(f'{k} {v}' for k, v in r['precision'].items())}, lm head {r['lm_head']})")
    print(f"samples           {r['samples']} ({r['positions']} scored positions, mode {r['mode']})")
    print(f"first-token match {r['first_token_match']:.3f}")
    print(f"top-1 agreement   {r['top1_agreement']:.4f}")
    print(f"mean KL           {r['mean_kl']:.5f}")
    print(f"bundle size       {r['bundle_bytes'] / 1e6:.1f} MB")
    print(f"peak RSS          {r['peak_rss_mb']:.0f} MB")
    return 0


def _bench(a) -> int:
    from .bench import bench

    if a.runs < 1 or a.gen_tokens < 1 or a.prompt_tokens < 1:
        raise ValueError("--runs, --gen-tokens and --prompt-tokens must be >= 1")
    r = bench(a.bundle, image=a.image, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, runs=a.runs,
              threads=a.threads, mode=a.mode, device=a.device, lookahead=a.lookahead)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['bundle']}: {r['prompt_tokens']} prompt tokens, {r['generated_tokens']} generated, {r['runs']} runs, "
          f"mode {r['mode']}, device {r['device']}, threads {r['threads'] or 'default'}, lookahead {r['lookahead']}"
          "   (min / median / max)")
    for k, unit in (("load_s", "s"), ("preprocess_s", "s"), ("vision_s", "s"), ("ttft_s", "s"),
                    ("prefill_tokens_per_s", "tok/s"), ("decode_ms_per_token", "ms"), ("decode_tokens_per_s", "tok/s"),
                    ("host_overhead_ms_per_step", "ms"), ("accepted_per_draft", "")):
        v = r[k]
        print(f"  {k:22s} {v['min']:9.3f} {v['median']:9.3f} {v['max']:9.3f} {unit}")
    print(f"  peak RSS               {r['peak_rss_mb']:.0f} MB")
    return 0


LOOKAHEAD_HELP = ("lookahead decoding of greedy answers: draft up to N tokens per step by prompt lookup and verify "
                  "them in one decoder call (same output; faster when the answer copies the prompt); 0 = off (default)")


def _generation_args(r, threads_help: str = "intra-op threads (default: physical cores)") -> None:
    r.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder (default: the offline easy-VQA demo model, exported into $VLMRT_CACHE or "
                        "~/.cache/vlmrt on first use)")
    r.add_argument("--mode", choices=["kv", "hybrid"], default=None, help="kv: prompt through the AR=1 graph; hybrid: AR=N prefill blocks (default)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable): the answer is cut before it and generation ends there")
    r.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    r.add_argument("--max-tiles", type=int, default=None,
                   help="cap each image's tile count (bundles whose tiling has one, e.g. InternVL)")
    r.add_argument("--max-frames", type=int, default=None,
                   help="sample at most this many frames of a video (default: the checkpoint's, e.g. 64 for SmolVLM2)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"],
                   help="htp: all graphs on the Qualcomm NPU via the QNN EP (the HTP simulator on x86-64), no CPU fallback")
    r.add_argument("--htp-arch", default=None,
                   help="--device htp: this device's Hexagon arch (e.g. 75, 79); a bundle compiled for another is refused")
    r.add_argument("--no-kv-requant", action="store_true",
                   help="HTP bundles, hybrid mode: reuse prefill's uint8 KV rows as-is in decode (to measure requantization)")
    r.add_argument("--threads", type=int, default=None, help=threads_help)
    r.add_argument("--lookahead", type=int, default=0, metavar="N", help=LOOKAHEAD_HELP)


def _image_arg(r) -> None:
    r.add_argument("--image", action="append",
                   help="image: a file, an http(s):// URL or a data:image/...;base64, URI (repeatable: several "
                        "images, in order, before the text)")
    r.add_argument("--video", default=None,
                   help="video (SmolVLM2 bundles): an animated GIF / WebP, an mp4 / webm / mkv / mov file (needs "
                        "vlmrt[video]), a folder of numbered frames (with --fps), an http(s):// URL or a data URI; "
                        "put before the images and the text (docs/video.md)")
    r.add_argument("--fps", type=float, default=None, help="the frame rate of a --video folder of frames")


def _batch(a) -> int:
    from .batch.runner import Job, report, run_batch

    opts = _options(a)
    if a.workers < 1:  # before the default model is built
        raise ValueError("--workers must be >= 1")
    job = Job(bundle=_bundle_or_default(a.bundle), input=a.input, output=a.output, prompt=a.prompt, workers=a.workers,
              threads=a.threads, ray_address=a.ray_address, device=a.device, verify=a.bundle is not None,
              kv_requant=not a.no_kv_requant, lookahead=a.lookahead, options=opts, batch_size=a.batch_size, retry_errors=a.retry_errors,
              progress=not a.quiet, allow_local_urls=a.allow_local_urls, image_urls=not a.no_image_urls)
    s = run_batch(job)
    report(s)
    if a.json:
        from dataclasses import asdict

        print(json.dumps(asdict(s)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vlmrt", description="Export and run small vision-language models as static ONNX graphs.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("export", help="export a Hugging Face checkpoint (folder or hub id) to a bundle")
    e.add_argument("src", help="checkpoint folder or hub id (e.g. HuggingFaceTB/SmolVLM-256M-Instruct)")
    e.add_argument("out", help="bundle folder to write")
    e.add_argument("--prefill-ar", type=int, default=32, help="tokens per prefill graph call (default 32)")
    e.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache size = max context in tokens (default: the family's, e.g. 1024 for SmolVLM, "
                        "room for the default max tiles for InternVL)")
    e.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="graph I/O and KV cache type (default fp32)")
    e.add_argument("--quant", default=None,
                   help="weight precision: fp32|fp16|w8a16|w4a16|w8a8|w4a8|w4a16m|w4a8m|w4a16o|w4a8o|w4a16g|w4a8g for all graphs (4-bit ones keep the "
                        "vision graph at 8 bits; the m ones also keep each layer's v_proj and down_proj at 8 bits, as Q4_K_M; the o "
                        "ones are 4-bit with a float offset per block, GGUF Q4_1's rule, and keep the lm head at 8 bits), or per graph, e.g. "
                        "vision=fp16,prefill=fp16,decode=w4a16,lm_head=w8a16 (default: --dtype). --target htp: fp16 (the HTP's "
                        "float path), w8a16, w4a16 (int4 block-wise) or w4a16o (int4 block-wise with Q4_1 block offsets), default "
                        "w8a16; 4-bit ones keep the vision graph and the lm head at 8 bits; head=PREC: the lm head as its own graph "
                        "(vision=fp16,prefill=fp16,decode=w4a16o,head=w8a16; the default for an untied head under a per-graph spec)")
    e.add_argument("--target", choices=["cpu", "htp"], default="cpu",
                   help="htp: static graphs for the Qualcomm NPU (QDQ with 16-bit activations or fp16, per --quant; uint8 KV "
                        "cache), compiled into QNN context binaries")
    e.add_argument("--calibration", default=None,
                   help="HTP calibration set: a folder of images (+ optional prompts.txt, one prompt per line); "
                        "default: vlmrt's sample images and its calibration prompts (apart from `vlmrt eval`'s)")
    e.add_argument("--soc-model", default=None,
                   help="HTP: the Snapdragon the context binaries are compiled for: SM8850, SM8750, SM8650, SM8550, SC8380XP "
                        "or a QNN soc model id (default SM8750 = Snapdragon 8 Elite, htp_arch 79)")
    e.add_argument("--htp-arch", default=None, help="HTP: Hexagon arch (e.g. 73, 75, 79) when --soc-model is not given or not known")
    e.add_argument("--keep-qdq", action="store_true",
                   help="HTP: also keep the QDQ ONNX graphs (the CPU EP runs only those; the QNN EP would compile them at load)")
    e.add_argument("--htp-shared-context", action="store_true",
                   help="HTP: prefill and decode in one context binary (one copy of the decoder weights on the device); "
                        "unverified: the x86-64 simulator cannot load it (docs/npu-deploy.md)")
    e.add_argument("--lookahead-ar", type=int, default=0, metavar="K",
                   help="HTP: also a lookahead verify graph of K tokens (the decode graph at AR = K, every row's logits), "
                        "which `run --lookahead` (up to K-1 drafts) uses; default 0: none")
    e.add_argument("--context-step", type=int, default=None,
                   help="CPU decoder graphs take any cache length and each step reads the cache prefix it needs, "
                        "rounded up to this many slots (default 64; 0 = static graphs over the whole cache, as "
                        "--target htp uses)")
    e.add_argument("--attention", choices=["gqa", "portable"], default=None,
                   help="gqa: the CPU decoder's attention as ORT's GroupQueryAttention, which updates the KV cache in "
                        "place (the default for the one-graph CPU decoder when head_dim is a multiple of 16); portable: "
                        "the graph's own attention ops and host-written KV rows (what static and HTP graphs use)")
    e.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e.add_argument("--quiet", action="store_true", help="no progress display")
    e.set_defaults(fn=_export)

    r = sub.add_parser("run", help="ask a question about images or a video, or answer a conversation's next turn")
    _generation_args(r)
    _image_arg(r)
    r.add_argument("--prompt", default=None, help="the question (one user turn: the --image images, then this text)")
    r.add_argument("--messages", default=None, metavar="CONV.json",
                   help="a conversation: a JSON list of OpenAI-style messages (system / user / assistant; content a "
                        "string or text / image_url / video_url parts); answers the next assistant turn")
    r.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, prompt_tokens, stats)")
    r.set_defaults(fn=_run)

    c = sub.add_parser("chat", help="an interactive conversation (/image PATH|URL, /reset, /stats, /quit)")
    _generation_args(c)
    _image_arg(c)
    c.add_argument("--system", default=None, help="a system message put first")
    c.set_defaults(fn=_chat)

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
    t.add_argument("--batch-size", type=int, default=4, help="records per call of a Ray worker (default 4)")
    t.add_argument("--retry-errors", action="store_true", help="do again the records whose line in OUT is an error")
    t.add_argument("--allow-local-urls", action="store_true",
                   help="let records' image URLs reach loopback, private and link-local addresses (default: public "
                        "addresses only, as records may come from others)")
    t.add_argument("--no-image-urls", action="store_true", help="refuse records' http(s) image URLs (error lines)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    t.set_defaults(fn=_batch)

    v = sub.add_parser("eval", help="accuracy of a bundle against the float reference on the same weights")
    v.add_argument("bundle", nargs="?", default=None, help="bundle folder (with --dataset, default: the offline demo model)")
    v.add_argument("--reference", default=None, help="fp32 bundle folder, or the checkpoint folder (needs vlmrt[export])")
    v.add_argument("--dataset", default=None, help="easy-vqa: exact-match accuracy on the data set instead (pip install easy-vqa)")
    v.add_argument("--split", default="test", choices=["train", "test"], help="--dataset split (default test)")
    v.add_argument("--limit", type=int, default=260,
                   help="--dataset: a fixed subset stratified by answer (20 per answer at 260, the default); 0 = all")
    v.add_argument("--image", action="append", help="image file (repeatable); default: the shipped sample images")
    v.add_argument("--prompt", action="append", help="prompt (repeatable); default: a built-in set")
    v.add_argument("--text-only", action="store_true", help="default set without images")
    v.add_argument("--tokens", type=int, default=32, help="reference tokens generated per sample (default 32)")
    v.add_argument("--mode", choices=["kv", "hybrid"], default="hybrid")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"])
    v.add_argument("--no-kv-requant", action="store_true")
    v.add_argument("--threads", type=int, default=None)
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=_eval)

    b = sub.add_parser("bench", help="timings of a bundle over repeated runs (min / median / max)")
    b.add_argument("bundle")
    b.add_argument("--image", default=None)
    b.add_argument("--prompt-tokens", type=int, default=256, help="total prompt tokens incl. image (default 256)")
    b.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per run, EOS ignored (default 64)")
    b.add_argument("--runs", type=int, default=3)
    b.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    b.add_argument("--mode", choices=["kv", "hybrid"], default="hybrid")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"])
    b.add_argument("--lookahead", type=int, default=0, metavar="N", help=LOOKAHEAD_HELP)
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=_bench)

    from .serve.command import add_parser as add_serve  # argparse only: the server's modules load when it runs

    add_serve(sub)
    from .web.command import add_parser as add_web

    add_web(sub)
    return ap


def _check_utf8(args) -> None:
    """A prompt that is not valid UTF-8 (Python keeps such argv bytes as lone surrogates) is refused up front
    (paths may be any bytes: those are left alone)."""
    prompts = getattr(args, "prompt", None)
    for s in prompts if isinstance(prompts, list) else [prompts]:
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("--prompt is not valid UTF-8") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .manifest import BundleError

    # (CheckpointError and ImageError are ValueErrors: importing them here would load the export and PIL for a
    # text-only run)
    expected = (BundleError, ValueError, OSError, KeyError)
    try:
        _check_utf8(args)
        return args.fn(args)
    except KeyboardInterrupt:
        print("vlmrt: interrupted", file=sys.stderr)
        return 130
    except expected as e:
        if os.environ.get("VLMRT_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"vlmrt: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
