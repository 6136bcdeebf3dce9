"""A decoder's inputs, built in one place for everything that runs or traces a families.DecoderModule: the export's
decoder graphs (every attention kind: the CPU target's and the HTP target's float graphs) and the GPTQ calibration's
float steps. The order is decoder.forward's; the names are the graph's inputs."""

from __future__ import annotations

import torch

from .cache_kinds import state_names

ROW_INPUT = "row_input"  # the decoder graph's per-token row input, where it has one (manifest decoder.row_input)
SPAN_INPUT = "span_ids"  # each row's image span, where the decoder has one (manifest decoder.span_input)
VALID_ROWS = "valid_rows"  # a static graph's real rows (1) and padding (0), where it takes them (graphs.static_valid_rows)


def decoder_inputs(decoder, embeds: torch.Tensor, *, start: int = 0, step: dict[str, torch.Tensor],
                   state: list[torch.Tensor], tail: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """decoder's inputs by name, in its forward's order, for the rows embeds [ar, hidden] at positions start ..:
    inputs_embeds; position_ids [decoder.rope_rows, ar] (every row the text position: M-RoPE's rows agree on text);
    where decoder.row_levels, row_input [ar, row_levels * hidden] of zeros (DeepStack's image features: none on
    text); where decoder.span_input, span_ids [ar] of -1 (no span); the attention kind's step inputs (step, by name); the state per layer (state_names' inputs, by the
    decoder's layer_kinds); then tail (logit_rows; the TokenRows wrapper's token_rows, token_scales)."""
    ar, hidden = embeds.shape
    inputs = {"inputs_embeds": embeds,
              "position_ids": torch.arange(start, start + ar, dtype=torch.int64)[None].repeat(decoder.rope_rows, 1)}
    if decoder.row_levels:
        inputs[ROW_INPUT] = torch.zeros(ar, decoder.row_levels * hidden, dtype=embeds.dtype)
    if decoder.span_input:
        inputs[SPAN_INPUT] = torch.full((ar,), -1, dtype=torch.int64)
    inputs.update(step)
    names, _ = state_names(decoder.layer_kinds)
    if len(names) != len(state):
        raise ValueError(f"the decoder's layers take {len(names)} state tensors, not {len(state)}")
    inputs.update(zip(names, state))
    inputs.update(tail or {})
    return inputs
