"""`vlmrt eval`: a bundle's accuracy against the float reference on the same weights, or on easy-VQA."""

from __future__ import annotations

import json

from .options import _bundle_or_default


def add_parser(sub) -> None:
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
    v.set_defaults(fn=run)


def run(a) -> int:
    from ..eval import accuracy, samples
    from ..runtime.vlm import VLM

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


def _eval_dataset(a) -> int:
    from ..demo import easyvqa_data as ev
    from ..runtime.vlm import VLM

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
