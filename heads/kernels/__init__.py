"""Compiled CPU kernels, built on first use, each beside the PyTorch expression it must equal.

``bf16_rows_matmul``: a few rows times a bfloat16 weight matrix, reading the weights once (bf16_rows.cpp);
``bf16_rows_linear``: the same product as a whole bf16 linear layer (bf16 rows in, bias, bf16 rows out). Built with
torch's C++ extension loader (a C++ compiler and ninja; the build is cached by torch, about a minute the first time).
Where it cannot be built, callers get None and keep PyTorch's own product.
``native_bf16_matmul``: whether the CPU has bf16 matrix instructions, which make PyTorch's own bf16 product fast.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Callable

import torch

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_CPU_CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() values with AVX2 and FMA


@functools.cache
def _bf16_rows_module():
    """The compiled bf16_rows.cpp, or None where it cannot be built or run."""
    if torch.backends.cpu.get_cpu_capability() not in KERNEL_CPU_CAPABILITIES:
        return None  # the kernel is written with AVX2/FMA intrinsics
    try:
        from torch.utils.cpp_extension import load

        return load(name="headstart_bf16_rows", sources=[str(SOURCE_DIR / "bf16_rows.cpp")],
                    # without OpenMP, at::parallel_for runs on one thread
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler or ninja: fall back rather than fail decoding
        warnings.warn(f"the bf16 row kernel could not be built ({type(error).__name__}: {error}); bf16 passes of "
                      f"several rows use PyTorch's product, which costs about one one-row pass per row on CPUs "
                      f"without bf16 matrix instructions", stacklevel=3)
        return None


@functools.cache
def bf16_rows_matmul() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """x [M, K] float32 @ weight [N, K] bfloat16 ^T -> [M, N] float32 (fp32 accumulation), or None.

    The reference it is tested against: ``x @ weight.float().T``.
    """
    module = _bf16_rows_module()
    return None if module is None else module.bf16_rows_matmul


@functools.cache
def bf16_rows_linear() -> Callable[..., torch.Tensor] | None:
    """(x [M, K] bfloat16, weight [N, K] bfloat16, bias [N] or None) -> [M, N] bfloat16, or None.

    Equal bit for bit to ``(bf16_rows_matmul()(x.float(), weight) + bias.float()).to(torch.bfloat16)``: the same fp32
    products, then one rounding.
    """
    module = _bf16_rows_module()
    return None if module is None else module.bf16_rows_linear


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX512-BF16), where PyTorch's bf16
    product is fast; without them it converts operands piecewise and runs several times slower than fp32."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
