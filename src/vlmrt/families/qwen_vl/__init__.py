"""Qwen2.5-VL and Qwen3-VL (`model_type` qwen2_5_vl, qwen3_vl): native-resolution ViT + 2×2 patch merger + a
Qwen2-like (2.5) or Qwen3-like (3, q/k norm) decoder with M-RoPE; Qwen3-VL adds DeepStack.

One module per part (nanoVLM): config.py (the config dataclasses from config.json), vision.py (the two vision towers
as static graphs fed by host-computed inputs, runtime/vision_inputs.py; the mergers and DeepStack's mergers with
them). The image op is runtime/image_native.py (smart_resize), the processor's.

Not registered in families.REGISTRY yet: the decoder (M-RoPE positions as a graph input, DeepStack after decoder
layers 0-2) needs the positions input of the decoder contract (issue 29); until its export works end to end the
family stays out of the registry (tests build it directly).
"""
