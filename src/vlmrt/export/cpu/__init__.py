"""The CPU (and CUDA) target's weight-only quantization: MatMulNBits precisions, 4-bit rules (block offsets,
GPTQ with its calibration), the constant-weight MatMuls they rewrite."""
