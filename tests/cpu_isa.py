"""The int8 dot product this CPU gives ORT's int8-compute kernels (MatMulNBits accuracy_level 4, MatMulInteger):
with AVX-512 VNNI / AVX-VNNI they sum u8 x s8 products in 32 bits; on AVX2 without VNNI in pairs of 16 bits, which
saturate, so the *a8* precisions are measurably less exact there. Accuracy floors measured on one kind of CPU say
which (session 11: Intel Xeon with VNNI; session 12: AMD EPYC with AVX2 only)."""

from __future__ import annotations

import platform


def int8_vnni() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return True  # the floors were measured on x86; other CPUs' dot products are 32-bit (ARM's sdot)
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_vnni" in flags or "avx_vnni" in flags


VNNI = int8_vnni()
