"""GPTQ's calibration: the Hessians H = Σ xᵀx of every decoder Linear's input over calibration sequences.

The sequences are the chat-templated calibration prompts (eval/samples.CALIBRATION_PROMPTS: kept apart from the
built-in evaluation prompts and the held-out ones) followed by the float decoder's own greedy answer (`tokens`
tokens), run through the float torch decoder the exporter traces. Linears that read the same tensor (q/k/v,
gate/up) share one H (`Hessians.of`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache_kinds import CACHE_KINDS
from ..decoder_inputs import decoder_inputs

TOKENS = 32  # generated tokens per calibration prompt


def empty_state(decoder) -> list[torch.Tensor]:
    """The state of an empty cache, per layer by its cache kind (export/cache_kinds.py: attention K and V
    [0, kv_dim], a conv layer's window [width, channels] of zeros)."""
    return [t for layer, kind in zip(decoder.layers, decoder.layer_kinds) for t in CACHE_KINDS[kind].empty(decoder, layer)]


def next_state(decoder, past: list[torch.Tensor], new: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state after a step, per layer by its cache kind (the new K/V rows appended, a conv window's last `width`
    rows kept)."""
    out: list[torch.Tensor] = []
    for kind in decoder.layer_kinds:
        at, n = len(out), CACHE_KINDS[kind].tensors
        out += CACHE_KINDS[kind].advance(decoder, past[at:at + n], new[at:at + n])
    return out


def _step(decoder, x: torch.Tensor, start: int, mask: torch.Tensor, past: list[torch.Tensor]):
    """decoder on the text rows x [n, hidden] at positions start.. under mask, after the state past (its inputs:
    export/decoder_inputs.py, as the export traces it)."""
    return decoder(*decoder_inputs(decoder, x, start=start, step={"attention_mask": mask}, state=past).values())


def greedy_sequence(decoder, embed: np.ndarray, ids: list[int], tokens: int) -> np.ndarray:
    """Embeddings [len(ids) + tokens, hidden] of the prompt ids and the decoder's greedy continuation."""
    x = torch.from_numpy(np.asarray(embed[ids], np.float32))  # [n, hidden]
    n = len(ids)
    mask = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
    past = empty_state(decoder)
    rows = [x]
    with torch.no_grad():
        for step in range(tokens):
            logits, *new = _step(decoder, x, n - len(x), mask, past)
            past = next_state(decoder, past, new)
            tok = int(logits[-1].argmax())
            x = torch.from_numpy(np.asarray(embed[[tok]], np.float32))
            rows.append(x)
            n += 1
            mask = torch.zeros(1, n)
    return torch.cat(rows).numpy()


class Hessians:
    """Forward pre-hooks on every nn.Linear of a decoder accumulating xᵀx (float32) of its input."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.h: dict[str, torch.Tensor] = {}
        self.leader: dict[str, str] = {}  # module name -> the module whose H it shares (same input tensor)
        self._last: tuple = (None, None)  # (input tensor, module) of the last call: consecutive calls on one tensor share

    def _hook(self, name):
        def f(_mod, args):
            x = args[0]
            last_x, last_name = self._last
            lead = self.leader.setdefault(name, self.leader[last_name] if x is last_x else name)
            self._last = (x, name)
            if lead != name:
                return
            x = x.detach().reshape(-1, x.shape[-1]).float()
            self.h[name] = self.h.get(name, 0) + x.T @ x
        return f

    def collect(self, sequences: list[np.ndarray]) -> "Hessians":
        linears = {n: m for n, m in self.decoder.named_modules() if isinstance(m, torch.nn.Linear)}
        hooks = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears.items()]
        try:
            with torch.no_grad():
                for seq in sequences:
                    self._last = (None, None)
                    n = len(seq)
                    mask = torch.triu(torch.full((n, n), torch.finfo(torch.float32).min), 1)
                    _step(self.decoder, torch.from_numpy(seq), 0, mask, empty_state(self.decoder))
        finally:
            for h in hooks:
                h.remove()
        return self

    def of(self, module: str) -> np.ndarray:
        """H [in, in] (float64) of the named Linear's input."""
        if module not in self.leader:
            raise KeyError(f"no calibration Hessian for {module!r}")
        return self.h[self.leader[module]].double().numpy()

    def for_weight(self, weight_name: str) -> np.ndarray:
        """H of the MatMul whose weight initializer is weight_name: the exporter keeps the module path
        (`inner.layers.0.self_attn.q_proj.weight_kn`; a fused group joins its members' names with '+')."""
        first = weight_name.split("+")[0]
        module = first.removesuffix(".weight_kn").removesuffix(".weight")
        while module.startswith("inner."):  # each export wrapper (CastIO, TokenRows) adds one
            module = module.removeprefix("inner.")
        return self.of(module)


def hessians(decoder, embed: np.ndarray, prompt_ids: list[list[int]], tokens: int = TOKENS) -> Hessians:
    """Hessians of decoder's Linears over the prompts and their greedy answers."""
    decoder = decoder.float().eval()
    return Hessians(decoder).collect([greedy_sequence(decoder, embed, ids, tokens) for ids in prompt_ids])


def prompt_hessians(decoder, embed: np.ndarray, tok_json: dict, spec, p) -> Hessians:
    """Hessians over CALIBRATION_PROMPTS, each a user turn built as the runtime builds prompts (runtime/prompt/build.py
    text_prompt with the bundle's PromptSpec, spec), each followed by TOKENS greedy tokens; p: the export's Progress."""
    import json

    from tokenizers import Tokenizer

    from ...eval.samples import CALIBRATION_PROMPTS
    from ...runtime.prompt.build import text_prompt

    p.start(f"GPTQ calibration ({len(CALIBRATION_PROMPTS)} prompts + {TOKENS} generated tokens each)")
    tok = Tokenizer.from_str(json.dumps(tok_json))
    ids = [text_prompt(spec, tok, q).ids for q in CALIBRATION_PROMPTS]
    h = hessians(decoder, embed, ids, TOKENS)
    p.done()
    return h
