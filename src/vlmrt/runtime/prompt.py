"""Prompt building: the chat template rendered at export, image text expansion as named host ops."""

from __future__ import annotations

from ..manifest import PromptSpec


def grid_markers(rows: int, cols: int, tiles: int, p: PromptSpec) -> str:
    """SmolVLM / Idefics3: per tile `<fake><row_r_col_c><image>×n`, a newline per grid row,
    then the global tile `\\n<fake><global-img><image>×n<fake>`; a lone global tile when rows == cols == 0."""
    fake, image, glob = p.params["fake_token"], p.params["image_token"], p.params["global_token"]
    run = image * p.tokens_per_tile
    if rows == 0 and cols == 0:
        return f"{fake}{glob}{run}{fake}"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += fake + p.params["tile_marker"].format(row=r + 1, col=c + 1) + run
        text += "\n"
    return text + f"\n{fake}{glob}{run}{fake}"


def wrapped_run(rows: int, cols: int, tiles: int, p: PromptSpec) -> str:
    """InternVL: `<img>` + `<IMG_CONTEXT>` × (tokens per tile × tiles) + `</img>`."""
    return p.params["start_token"] + p.params["image_token"] * (p.tokens_per_tile * tiles) + p.params["end_token"]


def tile_markers(rows: int, cols: int, tile_tokens: list[int], p: PromptSpec) -> str:
    """LFM2-VL (Lfm2VlProcessor._build_image_tokens): `<|image_start|>`, per tile of a rows×cols grid
    `<|img_row_R_col_C|>` + `<image>` × its tokens, then the thumbnail `<|img_thumbnail|>` + `<image>` × its tokens
    when the tiling made one (one tile more than the grid), `<|image_end|>`; a single image (rows == cols == 0) is
    its `<image>` run alone between start and end. tile_tokens: each tile's image-token count (they differ: a 512²
    tile has 256, the thumbnail or a single image (h/32)·(w/32)). Not in EXPANSION yet: the expansion ops take
    (rows, cols, tiles, p) until the prompt chunks carry per-tile token counts."""
    image, out = p.params["image_token"], p.params.get("start_token", "")
    if rows * cols == 0:
        return out + image * tile_tokens[0] + p.params.get("end_token", "")
    for i in range(rows * cols):
        out += p.params["tile_marker"].format(row=i // cols + 1, col=i % cols + 1) + image * tile_tokens[i]
    if len(tile_tokens) > rows * cols:
        out += p.params["thumbnail_token"] + image * tile_tokens[-1]
    return out + p.params.get("end_token", "")


EXPANSION = {"grid_markers": grid_markers, "wrapped_run": wrapped_run}


def build_prompt(p: PromptSpec, user_text: str, grid: tuple[int, int, int] | None) -> str:
    """The full prompt text: the chat template with the expanded image, grid = (rows, cols, tiles), or text only."""
    if grid is None:
        return p.template_text.replace("{prompt}", user_text)
    if p.expansion not in EXPANSION:
        raise ValueError(f"this vlmrt has no prompt expansion op {p.expansion!r}; upgrade vlmrt")
    image_text = EXPANSION[p.expansion](*grid, p)
    head, tail = p.template_image.split("{prompt}", 1)
    return head.replace("{image}", image_text) + user_text + tail.replace("{image}", image_text)
