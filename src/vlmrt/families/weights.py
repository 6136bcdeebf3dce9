"""Checkpoint tensors -> a family's modules: the weight loading every family shares.

A family's `load_weights` takes each tensor by name through `Tensors` (which records what it took), maps its vision
tower's names onto ours with a key table (`layer_keys`), loads the text decoder with `text_decoder` (its names are
the checkpoint's: families/decoder.py `sanitize`), and ends with `Tensors.check_all_used`: a checkpoint weight that
no table maps is refused, since dropping it silently would export a different model.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from . import decoder
from .decoder import TextConfig, UnsupportedCheckpoint
from .layers import CausalDecoder


def _buffer(name: str) -> bool:
    """Non-persistent buffers older writers saved (transformers' rotary inverse frequencies): nothing to map."""
    return name.endswith("rotary_emb.inv_freq")


class Tensors:
    """A checkpoint's tensors, taken by name (as float32); every take is recorded."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self):
        return self.tensors.keys()

    def take(self, name: str) -> torch.Tensor:
        return self.stored(name).float()

    __call__ = take

    def stored(self, name: str) -> torch.Tensor:
        """The tensor as the checkpoint stores it (its dtype; safetensors' memory map, nothing copied): what a
        token_table.TokenTable reads row block by row block."""
        if name not in self.tensors:
            raise UnsupportedCheckpoint(f"checkpoint is missing weight {name}")
        self.used.add(name)
        return self.tensors[name]

    def check_all_used(self, skip: Callable[[str], bool] = lambda name: False) -> None:
        """Refuse the checkpoint when a weight was not taken, other than old writers' buffers and what `skip` says
        the modules leave out on purpose (e.g. vision layers past the feature layer)."""
        unused = sorted(k for k in self.tensors if k not in self.used and not _buffer(k) and not skip(k))
        if unused:
            raise UnsupportedCheckpoint(f"checkpoint has {len(unused)} weights this exporter does not map, e.g. {unused[0]}")


def layer_keys(table: Mapping[str, str], layers: int, params: tuple[str, ...] = ("weight", "bias")) -> Iterator[tuple[str, str]]:
    """(our name, the checkpoint's name) for every layer i and parameter p of a table {ours: theirs} whose entries
    hold `{i}` and `{p}` placeholders."""
    for i in range(layers):
        for ours, theirs in table.items():
            for p in params:
                yield ours.format(i=i, p=p), theirs.format(i=i, p=p)


def text_decoder(tc: TextConfig, tensors: Tensors, prefix: str, head: str, tie: bool) -> tuple[CausalDecoder, torch.Tensor]:
    """The text decoder under `prefix` (the text model's, e.g. `model.text_model.`) and its lm head `head` (the
    checkpoint's name for it): (decoder, embedding table [vocab, hidden]).

    tie (the config's tie_word_embeddings): the head may be the embedding table. transformers 5 ties only a head
    the checkpoint lacks, so a saved head is the head even under a tied config; an untied config without a saved
    head is refused."""
    if not tie and head not in tensors:
        raise UnsupportedCheckpoint(f"config says the lm head is not tied, but the checkpoint has no {head}")
    return decoder.load(tc, tensors.tensors, tensors.take, prefix, head if head in tensors else None)
