"""Compiled kernels against the PyTorch expressions they replace."""

import pytest
import torch

from heads.common import WEIGHT_MAJOR_MAX_ROWS, decode_linear
from heads.kernels import KERNEL_CPU_CAPABILITIES, bf16_rows_linear, bf16_rows_matmul


def kernel_or_fail():
    kernel = bf16_rows_matmul()
    if torch.backends.cpu.get_cpu_capability() in KERNEL_CPU_CAPABILITIES:
        assert kernel is not None, "the bf16 row kernel did not build on an AVX2 CPU"
    else:
        pytest.skip("the bf16 row kernel needs AVX2")
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 16])
@pytest.mark.parametrize("n, k", [(37, 64), (576, 576), (5, 100)])  # odd row counts, a K that is no multiple of 8
def test_bf16_rows_matmul_equals_fp32_reference(rows, n, k):
    kernel = kernel_or_fail()
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    got = kernel(x, weight)
    reference = x @ weight.float().T
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-4)  # fp32 sums in another order


def test_bf16_rows_matmul_rejects_wrong_inputs():
    kernel = kernel_or_fail()
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        kernel(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernel(torch.randn(2, 8), torch.randn(4, 6).bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_rows_linear_equals_fp32_kernel_then_one_rounding(rows, with_bias):
    kernel = kernel_or_fail()
    generator = torch.Generator().manual_seed(rows * 10 + with_bias)
    x = torch.randn(rows, 100, generator=generator).bfloat16()  # K = 100: no multiple of 8
    weight = torch.randn(300, 100, generator=generator).bfloat16()
    bias = torch.randn(300, generator=generator).bfloat16() if with_bias else None
    got = bf16_rows_linear()(x, weight, bias)
    product = kernel(x.float(), weight)
    reference = (product if bias is None else product + bias.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
    assert torch.equal(got.view(torch.int16), reference.view(torch.int16))  # bit for bit


def test_bf16_rows_linear_rejects_wrong_inputs():
    kernel_or_fail()
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        bf16_rows_linear()(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        bf16_rows_linear()(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(5).bfloat16())


@pytest.mark.parametrize("rows", [2, 4, 7, 40])  # 40 rows: a prefill, the upcast product on CPUs without bf16 units
def test_decode_linear_in_bf16_matches_f_linear_to_one_rounding_step(rows):
    if rows <= WEIGHT_MAJOR_MAX_ROWS:
        kernel_or_fail()
    generator = torch.Generator().manual_seed(rows)
    hidden = torch.randn(1, rows, 96, generator=generator).bfloat16()
    weight = torch.randn(200, 96, generator=generator).bfloat16()
    bias = torch.randn(200, generator=generator).bfloat16()
    with torch.inference_mode():
        ours = decode_linear(hidden, weight, bias)
        stock = torch.nn.functional.linear(hidden, weight, bias)
    assert ours.shape == stock.shape == (1, rows, 200) and ours.dtype == torch.bfloat16
    exact = hidden.float() @ weight.float().T + bias.float()
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7  # a bf16 step at each value's magnitude
    assert ((ours.float() - exact).abs() <= step).all()  # each kernel output is a correct rounding step away
    assert ((ours.float() - stock.float()).abs() <= 2 * step).all()
    assert (ours == stock).float().mean() > 0.9  # mostly bit-identical: only the summation order differs
