"""A prompt as typed chunks: runs of text token ids and images, each knowing its token count.

    prompt = Prompt([TextChunk([1, 2, 3]), ImageChunk(key, grid, ids=ids, rows=rows), TextChunk([...])])
    prompt.ids            # every token id, image slots holding the image token id
    prompt.keys()         # one key per KV slot (the prefix cache compares them)
    prompt.splice(token_embeds, start)   # the image rows put over their slots: the one splice

A chunk's token count (n_tokens) is the KV slots and embedding rows it takes; how its tokens are positioned (and so
how far it moves the next chunk's position: an M-RoPE image (Qwen-VL) takes fewer positions than tokens) is the
manifest's named positions op's (decoder.positions.op, runtime/prompt/positions.py), which reads the chunks (an image
chunk's grid); never a family branch here.

An image has one record, its ImageChunk, from the moment it is read to the image cache: made with its tiles (or the
embeddings the image cache kept), placed by prompt.build (its expansion's ids and rows written on it), given its
embeddings by the vision graph, and kept as it is by the image cache (runtime/decode/prefix_cache.py ImageCache).

A video is not a chunk type: runtime/media/video.py writes it as text chunks (the intro, a timestamp line per frame)
and one image chunk per frame (its expansion params and row token the video's, where its processor writes frames
with their own token: Gemma 4's `<|video|>`), so a repeated frame's embeddings come from the image cache like an
image's, and a frame is a span of its own where the decoder takes spans (Gemma 4's bidirectional vision attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ..decode.spans import prompt_spans

if TYPE_CHECKING:
    from ...format.manifest import PromptSpec


@dataclass
class TextChunk:
    ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


@dataclass
class ImageChunk:
    """One image (or video frame): its tiling and where its rows come from (pixels to encode, or embeddings known),
    and, once prompt.build placed it, its expansion's token ids (markers and image-token slots) and the offsets in
    ids of the slots the vision graph's rows fill."""

    key: Any  # (content digest, tiling): the image cache's key and the prefix cache's row key
    grid: tuple[int, int, int]  # (rows, cols, tiles) of the tiling, what the expansion is written from
    pixels: np.ndarray | None = None  # [tiles, c, S, S] (NaFlex: [tiles, patches, d]) to run through the vision graph, or None when embeds are known
    # [len(rows), hidden (+ row width)]: the vision graph's rows (from the image cache or encoded); with row outputs
    # (manifest vision.row_outputs) their rows follow the embedding's columns (the decoder's row input, row_input)
    embeds: np.ndarray | None = None
    label: str = field(default="image")  # what it is, for messages ("image 2", "frame 3 of video 1")
    # each tile's image-token count (rows of embeds), in order (the vision tile-inputs op's: runtime/media/tile_inputs.py);
    # None until build: every tile gives PromptSpec.tokens_per_tile (square tiles)
    tile_tokens: list[int] | None = None
    patch_grids: np.ndarray | None = None  # NaFlex tiles' patch grids [tiles, 2] (the vision tile-inputs op reads)
    resized_to_fit: bool = False  # image.Tiles.resized_to_fit: shrunk to fit the vision graph's patch budget
    # a video frame's expansion params over PromptSpec.params and the token of its rows (VideoSpec.frame_params,
    # .frame_token_id: Gemma 4's video token); None: an image's
    expansion_params: dict | None = None
    token_id: int | None = None
    ids: list[int] = field(default_factory=list)  # the expansion's token ids, markers included (written by build)
    # [len(embeds)] int64 offsets in ids of the image-token slots, in order (written by build)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def tokens(self, p: PromptSpec) -> list[int]:
        """Each tile's image-token count."""
        return self.tile_tokens if self.tile_tokens is not None else [p.tokens_per_tile] * self.grid[2]

    def reused(self, label: str) -> "ImageChunk":
        """This image's record for another prompt from its embeddings (an image cache hit): its tiling, rows and
        label there, not yet placed."""
        return ImageChunk(self.key, self.grid, embeds=self.embeds, label=label, tile_tokens=self.tile_tokens,
                          expansion_params=self.expansion_params, token_id=self.token_id)


Chunk = Union[TextChunk, ImageChunk]


class Prompt:
    def __init__(self, chunks: list[Chunk]):
        self.chunks = chunks
        self.ids: list[int] = [t for c in chunks for t in c.ids]
        starts = np.cumsum([0] + [c.n_tokens for c in chunks])
        self.offsets = [int(s) for s in starts[:-1]]  # each chunk's first slot

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def images(self) -> list[tuple[int, ImageChunk]]:
        """(first slot, chunk) of each image chunk, in order."""
        return [(o, c) for o, c in zip(self.offsets, self.chunks) if isinstance(c, ImageChunk)]

    def keys(self) -> list:
        """One key per slot: the token id, or (image key, row) for an image row, whose token id alone does not say which
        picture it is."""
        keys: list = list(self.ids)
        for o, c in self.images():
            for r, at in enumerate(c.rows):
                keys[o + int(at)] = (c.key, r)
        return keys

    def needs_rows(self, start: int) -> list[ImageChunk]:
        """Image chunks with a row at or after slot start (those wholly before it are in the kept KV prefix)."""
        return [c for o, c in self.images() if len(c.rows) and o + int(c.rows[-1]) >= start]

    def splice(self, token_embeds: np.ndarray, start: int = 0) -> np.ndarray:
        """Prompt embeddings [n_tokens - start, hidden] from the token embeddings of ids[start:]: each image chunk's
        rows put over its image-token slots (the rows of chunks wholly before start are not needed)."""
        if token_embeds.shape[0] != self.n_tokens - start:
            raise ValueError(f"{token_embeds.shape[0]} token embeddings for {self.n_tokens - start} prompt slots")
        out = token_embeds if token_embeds.flags.writeable else token_embeds.copy()
        for o, c, slots, keep in self._image_slots(start):
            out[slots[keep] - start] = c.embeds[keep, : out.shape[1]]
        return out

    def row_input(self, hidden: int, width: int, dtype, start: int = 0) -> np.ndarray:
        """The decoder's row input [n_tokens - start, width] (manifest decoder.row_input): each image row's columns
        after the first `hidden` of its embeddings (the vision graph's row outputs), zeros elsewhere."""
        out = np.zeros((self.n_tokens - start, width), dtype)
        for o, c, slots, keep in self._image_slots(start):
            if c.embeds.shape[1] != hidden + width:
                raise ValueError(f"{c.label}'s rows are {c.embeds.shape[1]} wide, not hidden + row input = {hidden + width}")
            out[slots[keep] - start] = c.embeds[keep, hidden:]
        return out

    def spans(self, start: int = 0) -> np.ndarray:
        """[n_tokens - start] int64: each slot's image span from start on, a maximal run of image-token slots
        numbered from the prompt's first (-1 elsewhere; the decoder's span input, runtime/decode/spans.py)."""
        is_image = np.zeros(self.n_tokens, bool)
        for o, c in self.images():
            is_image[o + c.rows] = True
        return prompt_spans(is_image)[start:]

    def _image_slots(self, start: int):
        """(first slot, chunk, its image slots, which of them are at or after start) of the image chunks with rows
        from start on, their embeddings checked."""
        for o, c in self.images():
            slots = o + c.rows
            if not len(slots) or slots[-1] < start:
                continue
            if c.embeds is None or c.embeds.shape[0] != len(c.rows):
                have = "no embeddings" if c.embeds is None else f"{c.embeds.shape[0]} embeddings"
                raise ValueError(f"{c.label} has {len(c.rows)} image-token slots but {have}")
            yield o, c, slots, slots >= start
