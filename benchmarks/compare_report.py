"""benchmarks/compare.py's output: the markdown tables and the PNG chart (matplotlib, `vlmrt[bench]`)."""

from __future__ import annotations

from pathlib import Path


def _mmm(v, fmt="{:.3f}") -> str:
    return " / ".join(fmt.format(x) for x in v) if v else "—"


def markdown(res: dict, argv: str) -> str:
    bw = res["bandwidth"]["bytes_per_s"]
    lines = [
        f"{res['date']}, {res['cpu']}, {res['threads']} threads, {res['runs']} runs each, load average at start "
        f"{res['load'][0]:.1f}, at end {res['load_after'][0]:.1f}; memory bandwidth {bw / 1e9:.1f} GB/s "
        f"(read {res['bandwidth']['read_bytes_per_s'] / 1e9:.1f}, copy {res['bandwidth']['copy_bytes_per_s'] / 1e9:.1f}). "
        f"Command: `python -m benchmarks.compare {argv}`.", ""]
    if res["text"]:
        lines += [
            f"Text: {res['prompt_tokens']} prompt tokens, then exactly {res['gen_tokens']} greedy tokens (min / median / max).", "",
            "| runtime | TTFT s | decode tok/s | host ms/step | peak RSS MB | bytes read/token | bandwidth limit tok/s | fraction |",
            "|---|---|---|---|---|---|---|---|"]
        for r in res["text"]:
            b = r.get("bytes_per_token")
            limit = bw / b if b else None
            frac = f"{r['decode_tokens_per_s'][1] / limit:.0%}" if limit else "—"
            host = f"{r['host_overhead_ms_per_step'][1]:.3f}" if "host_overhead_ms_per_step" in r else "—"
            lines.append(f"| {r['name']} | {_mmm(r['ttft_s'])} | {_mmm(r['decode_tokens_per_s'], '{:.1f}')} | {host} | "
                         f"{r['peak_rss_mb']:.0f} | {b / 1e6:.0f} MB | {limit:.0f} | {frac} |" if b else
                         f"| {r['name']} | {_mmm(r['ttft_s'])} | {_mmm(r['decode_tokens_per_s'], '{:.1f}')} | {host} | "
                         f"{r['peak_rss_mb']:.0f} | — | — | — |")
        lines.append("")
    if res["image"]:
        lines += [
            "Image: one photo, its tiles through the vision encoder, then exactly "
            f"{res['gen_tokens']} tokens (EOS suppressed). Image TTFT = preprocessing + vision encode + prefill.", "",
            "| runtime | tiles | prompt tokens | image TTFT s | vision encode s | decode tok/s | peak RSS MB |",
            "|---|---|---|---|---|---|---|"]
        for r in res["image"]:
            lines.append(f"| {r['name']} | {r.get('tiles') or '—'} | {r.get('prompt_tokens') or '—'} | {_mmm(r['ttft_s'], '{:.2f}')} | "
                         f"{_mmm(r.get('vision_s'), '{:.2f}')} | {_mmm(r['decode_tokens_per_s'], '{:.1f}')} | {r['peak_rss_mb']:.0f} |")
        lines.append("")
    for n in res["notes"]:
        lines.append(f"- {n}")
    return "\n".join(lines) + "\n"


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("text", "decode_tokens_per_s", "text decode, tokens/s (higher is better)"),
              ("text", "ttft_s", f"text TTFT, {res['prompt_tokens']}-token prompt, s (lower is better)"),
              ("image", "ttft_s", "image TTFT, s (lower is better)"),
              ("image", "decode_tokens_per_s", "decode after the image, tokens/s")]
    panels = [p for p in panels if res[p[0]]]
    colors = {"vlmrt": "#1f77b4", "llama.cpp": "#d62728", "transformers": "#7f7f7f"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 + 0.45 * sum(len(res[p[0]]) for p in panels)), squeeze=False)
    for ax, (kind, key, title) in zip(axes[:, 0], panels):
        rows = res[kind]
        names = [r["name"] for r in rows]
        med = [r[key][1] for r in rows]
        err = [[r[key][1] - r[key][0] for r in rows], [r[key][2] - r[key][1] for r in rows]]
        ax.barh(names, med, xerr=err, color=[colors.get(r["group"], "#2ca02c") for r in rows], capsize=3)
        for y, v in enumerate(med):
            ax.text(v, y, f" {v:.1f}" if v >= 10 else f" {v:.2f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"vlmrt vs llama.cpp vs transformers, same weights — {res['date']}, {res['cpu']}, {res['threads']} threads, load avg {res['load'][0]:.1f}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
