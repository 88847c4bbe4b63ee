"""Compiled kernels against the PyTorch expressions they replace."""

import pytest
import torch
import torch.nn.functional as F

import runtime.target.kernels as kernels
from runtime.target.decode_layers import DOT_KERNEL_MAX_ROWS, WEIGHT_MAJOR_MAX_ROWS, decode_linear
from runtime.target.kernels import (KERNEL_CPU_CAPABILITIES, Int8Rows, bf16_amx_linear, bf16_dot_linear,
                                    bf16_packed_linear, bf16_packed_linear_avx2, bf16_rows_linear, bf16_rows_matmul,
                                    decode_attention, decode_attention_avx2, int8_argmax, int8_candidates,
                                    onednn_bf16_linear, pack_bf16_weight, pack_onednn_weight, rms_norm_rows)


def built_or_fail(accessor=bf16_rows_matmul):
    """The kernel ``accessor`` returns; on an AVX2 CPU it must have built, elsewhere the test is skipped."""
    kernel = accessor()
    if torch.backends.cpu.get_cpu_capability() in KERNEL_CPU_CAPABILITIES:
        assert kernel is not None, f"{accessor.__name__}: the kernel did not build on an AVX2 CPU"
    else:
        pytest.skip(f"{accessor.__name__}: the kernel needs AVX2")
    return kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 16])
@pytest.mark.parametrize("n, k", [(37, 64), (576, 576), (5, 100)])  # odd row counts, a K that is no multiple of 8
def test_bf16_rows_matmul_equals_fp32_reference(rows, n, k):
    kernel = built_or_fail()
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    got = kernel(x, weight)
    reference = x @ weight.float().T
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-4)  # fp32 sums in another order


def test_bf16_rows_matmul_rejects_wrong_inputs():
    kernel = built_or_fail()
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        kernel(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernel(torch.randn(2, 8), torch.randn(4, 6).bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_rows_linear_equals_fp32_kernel_then_one_rounding(rows, with_bias):
    kernel = built_or_fail()
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
    built_or_fail()
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        bf16_rows_linear()(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        bf16_rows_linear()(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(5).bfloat16())


def avx512_bf16_cpu() -> bool:
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


def dot_kernel_or_skip():
    """The AVX512-BF16 kernel: it must have built on a CPU with the instruction, elsewhere the test is skipped."""
    if not avx512_bf16_cpu():
        assert bf16_dot_linear() is None  # never offered where the instruction is missing
        pytest.skip("bf16_dot_linear: the CPU has no AVX512-BF16")
    kernel = bf16_dot_linear()
    assert kernel is not None, "bf16_dot_linear: the kernel did not build on a CPU with AVX512-BF16"
    return kernel


# rows across the 8-row blocks (a last block of 1 or 2 rows after full ones) and the 32-row limit; K that is a
# multiple of 32, one that is not (the masked tail),
# one shorter than a vector; N not a multiple of the weight rows per block
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 18, 33])
@pytest.mark.parametrize("n, k", [(37, 64), (576, 576), (300, 100), (7, 20)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_dot_linear_equals_fp32_product_then_one_rounding(rows, n, k, with_bias):
    kernel = dot_kernel_or_skip()
    generator = torch.Generator().manual_seed(rows * 1000 + n + k + with_bias)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    got = kernel(x, weight, bias)
    exact = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step at each value's magnitude
    assert ((got.float() - exact).abs() <= step).all()  # a correct rounding of the fp32 sum
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.99  # only the summation order differs


def test_bf16_dot_linear_flushes_only_products_below_the_normal_range():
    """The instruction flushes denormal products and sums to zero, as the kernel's comment says: tiny terms are lost,
    each by less than 2^-126, and a normal term beside them is kept exactly."""
    kernel = dot_kernel_or_skip()
    x = torch.full((2, 64), 2.0 ** -70).bfloat16()
    x[1, 0] = 1.0
    weight = torch.full((3, 64), 2.0 ** -70).bfloat16()  # products 2^-140: denormal in fp32
    weight[2, 0] = 0.5
    got = kernel(x, weight, None).float()
    exact = x.float() @ weight.float().T
    assert ((got - exact).abs() <= 64 * 2.0 ** -126).all()
    assert got[1, 2] == 0.5  # 1 x 0.5 kept; the 63 denormal products beside it cannot move it


def test_bf16_dot_linear_rejects_wrong_inputs():
    kernel = dot_kernel_or_skip()
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        kernel(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernel(torch.randn(2, 8).bfloat16(), torch.randn(4, 6).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), torch.randn(5).bfloat16())


def test_pack_bf16_weight_layout_by_hand():
    # pure torch (no kernel): weight [N, K] -> [ceil(N / 32), ceil(K / 2), 32, 2], element [b, p, c, e] =
    # weight[32 b + c, 2 p + e], zeros beyond N and K
    weight = torch.arange(35 * 3, dtype=torch.float32).reshape(35, 3).bfloat16()
    packed = pack_bf16_weight(weight)
    assert packed.shape == (2, 2, 32, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed[0, 0, 5].tolist() == [15.0, 16.0]  # row 5, k 0 and 1
    assert packed[0, 1, 5].tolist() == [17.0, 0.0]  # k 2, then the zero beyond K = 3
    assert packed[1, 1, 2].tolist() == [weight[34, 2].item(), 0.0]  # row 34 = 32 + 2
    assert packed[1, :, 3:].abs().sum() == 0  # rows 35-63 do not exist
    assert weight[0, 0] == 0.0 and weight.shape == (35, 3)  # the weight itself is untouched


# The kernels over pack_bf16_weight's layout: AVX512-BF16's dot product, AMX tiles, and AVX2 FMAs.
PACKED_KERNELS = ("blocks", "amx", "avx2")


def packed_kernel_or_skip(which: str = "blocks"):
    """The packed AVX512-BF16 kernel, on the same CPUs as the unpacked one; the AMX kernel, on CPUs with AMX; or the
    AVX2 kernel, on every CPU with AVX2 and FMA."""
    if which == "avx2":
        if torch.backends.cpu.get_cpu_capability() not in KERNEL_CPU_CAPABILITIES:
            pytest.skip("the kernels need AVX2 and FMA")
        kernel = bf16_packed_linear_avx2()
        assert kernel is not None, "bf16_packed_linear_avx2: the kernel did not build on a CPU with AVX2"
        return kernel
    dot_kernel_or_skip()
    if which == "amx":
        if not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
            pytest.skip("the AMX kernel needs a CPU with AMX tiles")
        kernel = bf16_amx_linear()
        if kernel is None:
            import runtime.target.kernels as kernels

            module = kernels._compiled("bf16_amx_rows.cpp", "", kernels.AMX_KERNEL_FLAGS)
            assert module is not None, "bf16_amx_linear: the kernel did not build on a CPU with AMX"
            pytest.skip("the operating system does not grant this process the AMX tile state")
        return kernel
    kernel = bf16_packed_linear()
    assert kernel is not None, "bf16_packed_linear: the kernel did not build on a CPU with AVX512-BF16"
    return kernel


# rows across the row blocks (12 at most for the dot product, split evenly: 13 = 6 + 7; 16 per AMX tile), N across
# the 32-column blocks, their 16-column halves and AMX's pairs of blocks, K odd (a zero pads the last pair), shorter
# than a pair, shorter than an AMX tile (32) and past whole tiles (600 = 18 tiles and 12 pairs)
@pytest.mark.parametrize("which", PACKED_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 12, 13, 16, 17, 32])
@pytest.mark.parametrize("n, k", [(37, 64), (576, 576), (300, 101), (7, 1), (48, 20), (100, 600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_packed_linear_equals_fp32_product_then_one_rounding(which, rows, n, k, with_bias):
    kernel = packed_kernel_or_skip(which)
    generator = torch.Generator().manual_seed(rows * 1000 + n + k + with_bias)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    got = kernel(x, pack_bf16_weight(weight), n, bias)
    exact = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step at each value's magnitude
    assert ((got.float() - exact).abs() <= step).all()  # a correct rounding of the fp32 sum
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.99  # only the summation order differs


@pytest.mark.parametrize("which", PACKED_KERNELS)
def test_bf16_packed_linear_rows_do_not_depend_on_their_neighbours(which):
    """Each output is its own row's sum in one order, so a row alone and the same row among 31 others agree bit
    for bit (sampling at batch > 1 relies on it)."""
    kernel = packed_kernel_or_skip(which)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(32, 576, generator=generator).bfloat16()
    packed = pack_bf16_weight(torch.randn(100, 576, generator=generator).bfloat16())
    together = kernel(x, packed, 100, None)
    for row in (0, 13, 31):
        alone = kernel(x[row:row + 1].contiguous(), packed, 100, None)
        assert torch.equal(alone[0].view(torch.int16), together[row].view(torch.int16))


@pytest.mark.parametrize("which", PACKED_KERNELS)
def test_bf16_packed_linear_rounds_as_tensor_to_and_keeps_nan(which):
    kernel = packed_kernel_or_skip(which)
    x = torch.zeros(2, 2).bfloat16()
    x[0, 0], x[1, 0] = 1.0, float("nan")
    weight = torch.zeros(3, 2).bfloat16()
    weight[:, 0] = 1.0
    # 1 + half a bf16 step and 1 + 3 half steps: ties, to even down and up
    bias = torch.tensor([2.0 ** -8, 3 * 2.0 ** -8, 0.0]).bfloat16()
    got = kernel(x, pack_bf16_weight(weight), 3, bias)
    assert got[0].tolist() == [1.0, 1.0 + 2.0 ** -6, 1.0]
    exact = (x.float() @ weight.float().T + bias.float())
    assert torch.equal(got[0].view(torch.int16), exact[0].to(torch.bfloat16).view(torch.int16))
    assert got[1].isnan().all()


@pytest.mark.parametrize("which", PACKED_KERNELS)
def test_bf16_packed_linear_rejects_wrong_inputs(which):
    kernel = packed_kernel_or_skip(which)
    weight = torch.randn(40, 8).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        kernel(torch.randn(2, 8), pack_bf16_weight(weight), 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel(torch.randn(2, 6).bfloat16(), pack_bf16_weight(weight), 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel(torch.randn(2, 8).bfloat16(), pack_bf16_weight(weight), 70, None)
    with pytest.raises(RuntimeError, match="packed weight"):
        kernel(torch.randn(2, 8).bfloat16(), weight, 40, None)


def onednn_or_skip():
    kernel = onednn_bf16_linear()
    if kernel is None:
        pytest.skip("oneDNN does not take bf16 on this CPU")
    return kernel


@pytest.mark.parametrize("rows", [1, 3, 16, 33])
@pytest.mark.parametrize("n, k", [(37, 64), (576, 576), (300, 101)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_bf16_linear_equals_fp32_product_then_one_rounding(rows, n, k, with_bias):
    """oneDNN over a reordered copy of the weight (the product a linear plan may choose) against the fp32 reference:
    a correct rounding of each fp32 sum, the weight untouched."""
    kernel = onednn_or_skip()
    generator = torch.Generator().manual_seed(rows * 1000 + n + k + with_bias)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    kept = weight.clone()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    with torch.inference_mode():
        got = kernel(x, pack_onednn_weight(weight), bias)
    exact = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((got.float() - exact).abs() <= 2 * step).all()
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.9
    assert torch.equal(weight, kept)


@pytest.mark.parametrize("rows", [2, 4, 7, 24, 40])  # 40 rows: a prefill, the upcast product on CPUs without bf16 units
def test_decode_linear_in_bf16_matches_f_linear_to_one_rounding_step(rows):
    if rows <= WEIGHT_MAJOR_MAX_ROWS:
        built_or_fail()
    if rows <= DOT_KERNEL_MAX_ROWS and avx512_bf16_cpu():
        dot_kernel_or_skip()
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


def cache_like_case(rows, context, dim, batch=1, heads=9, kv_heads=3, seed=0):
    """bf16 query [B, H, T, D] as transformers makes it (a transposed view), keys/values as views of a longer cache
    buffer, and a tree mask: the whole context, then a random ancestor pattern over the new rows."""
    generator = torch.Generator().manual_seed(seed)
    slots = context + rows
    buffer = torch.randn(2, batch, kv_heads, slots + 13, dim, generator=generator).bfloat16()
    key, value = buffer[0, :, :, :slots], buffer[1, :, :, :slots]
    query = torch.randn(batch, rows, heads, dim, generator=generator).bfloat16().transpose(1, 2)
    mask = torch.ones(batch, 1, rows, slots, dtype=torch.bool)
    mask[..., context:] = (torch.rand(batch, 1, rows, rows, generator=generator) < 0.5).tril()
    mask[..., context:] |= torch.eye(rows, dtype=torch.bool)
    return query, key, value, mask


# the build this CPU runs (with AVX512-BF16 where it has them) and the AVX2 build every other x86 CPU runs
ATTENTION_BUILDS = pytest.mark.parametrize("build", [decode_attention, decode_attention_avx2], ids=["chosen", "avx2"])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 16])
@pytest.mark.parametrize("context, dim", [(0, 64), (37, 64), (300, 64), (21, 128)])
@ATTENTION_BUILDS
def test_decode_attention_equals_fp32_sdpa_over_the_same_values(rows, context, dim, build):
    kernel = built_or_fail(build)
    query, key, value, mask = cache_like_case(rows, context, dim, seed=rows + context)
    got = kernel(query, key, value, mask, dim ** -0.5)
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                               scale=dim ** -0.5, enable_gqa=True).transpose(1, 2)
    assert got.shape == reference.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    # fp32 throughout, one rounding at the end: within one bf16 step of the fp32 result
    torch.testing.assert_close(got.float(), reference, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("rows, heads, kv_heads", [(1, 9, 3), (16, 9, 3), (16, 8, 1), (16, 5, 1), (3, 4, 4)])
@ATTENTION_BUILDS
def test_decode_attention_rows_do_not_depend_on_the_heads_sharing_their_task(rows, heads, kv_heads, build):
    # a task takes as many heads of a KV group as fit (16 rows x 8 heads do not: two tasks; x 5: one head each)
    # while there are a few tasks per thread (hence 8 batch rows); every head's output must be bit-identical to that
    # head computed alone
    kernel = built_or_fail(build)
    query, key, value, mask = cache_like_case(rows, 50, 64, batch=8, heads=heads, kv_heads=kv_heads, seed=rows)
    together = kernel(query, key, value, mask, 0.125)
    group = heads // kv_heads
    for head in range(heads):
        kv = slice(head // group, head // group + 1)
        alone = kernel(query[:, head:head + 1], key[:, kv], value[:, kv], mask, 0.125)
        assert torch.equal(together[:, :, head:head + 1], alone)
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                               scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(together.float(), reference, rtol=2 ** -8, atol=1e-5)


@ATTENTION_BUILDS
def test_decode_attention_takes_batches_no_mask_and_gives_zeros_where_nothing_is_visible(build):
    kernel = built_or_fail(build)
    query, key, value, mask = cache_like_case(4, 10, 64, batch=2, heads=4, kv_heads=2)
    mask[1, 0, 2] = False  # row 2 of batch row 1 may attend to nothing
    got = kernel(query, key, value, mask, 0.125).float()
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                               scale=0.125, enable_gqa=True).transpose(1, 2)
    assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
    reference[1, 2] = 0.0  # SDPA gives NaN there
    torch.testing.assert_close(got, reference, rtol=2 ** -8, atol=1e-5)
    one = kernel(query[:, :, :1], key, value, None, 0.125).float()
    torch.testing.assert_close(one, F.scaled_dot_product_attention(
        query[:, :, :1].float(), key.float(), value.float(), scale=0.125, enable_gqa=True).transpose(1, 2),
        rtol=2 ** -8, atol=1e-5)


@ATTENTION_BUILDS
def test_decode_attention_takes_packed_rows_bit_identical_to_padded_ones(build):
    """Rows of different lengths packed one after another (a ragged pass, ``runtime.engine.ragged``): each real row's
    output is bit-identical to what the kernel gives it laid out padded, and padding is never computed."""
    from runtime.engine.ragged import RaggedRows

    kernel = built_or_fail(build)
    query, key, value, mask = cache_like_case(5, 40, 64, batch=3, heads=9, kv_heads=3, seed=4)
    counts = [5, 1, 3]
    padded = kernel(query, key, value, mask, 0.125)  # [B, T, H, D]
    ragged = RaggedRows.from_counts(counts, torch.arange(sum(counts)))
    packed_query = ragged.pack(query.transpose(1, 2)).transpose(1, 2)  # [1, H, T', D]
    got = kernel(packed_query, key, value, mask, 0.125, torch.tensor(counts))
    assert got.shape == (1, sum(counts), 9, 64)
    assert torch.equal(got, ragged.pack(padded))
    with pytest.raises(RuntimeError, match="add up"):
        kernel(packed_query, key, value, mask, 0.125, torch.tensor([5, 1, 2]))
    with pytest.raises(RuntimeError, match="at least 1"):
        kernel(packed_query[:, :, :8], key, value, mask, 0.125, torch.tensor([5, 0, 3]))


@ATTENTION_BUILDS
def test_decode_attention_rejects_what_it_cannot_take(build):
    kernel = built_or_fail(build)
    query, key, value, mask = cache_like_case(4, 10, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(query.float(), key, value, mask, 0.125)
    with pytest.raises(RuntimeError, match="1 to 16 query rows"):
        kernel(torch.zeros(1, 9, 17, 64).bfloat16(), key, value, None, 0.125)
    with pytest.raises(RuntimeError, match="bool mask"):
        kernel(query, key, value, mask[..., :-1], 0.125)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 4, 576), (2, 3, 100), (5, 7)])  # H no multiple of 8 too
def test_rms_norm_rows_equals_the_llama_norm_within_one_rounding(shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernel = built_or_fail(rms_norm_rows)
    generator = torch.Generator().manual_seed(sum(shape))
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=generator))
    x = (torch.randn(*shape, generator=generator) * 3).bfloat16()
    with torch.inference_mode():
        expected = norm(x)
        got = kernel(x, norm.weight, norm.variance_epsilon)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # the same operations but the order of the sum of squares: nearly always the same bits, else one bf16 step
    assert (got == expected).float().mean() > 0.98
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=0)


def test_a_build_lock_left_by_a_killed_build_falls_back_instead_of_waiting(monkeypatch, tmp_path):
    """torch's loader waits for good while a build lock exists; a build killed outright leaves one behind. An old
    lock makes the kernel fall back to PyTorch's ops with a warning naming the file; a fresh one (a build running
    now) is waited on as before."""
    import os
    import time

    import torch.utils.cpp_extension

    import runtime.target.kernels as kernels

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "FileBaton", object, raising=False)  # a loader that waits on it
    lock = tmp_path / "lock"
    lock.write_text("")
    assert kernels._stale_build_lock("headstart_rms_norm") is None  # a build may be running
    old = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert kernels._stale_build_lock("headstart_rms_norm") == lock
    if torch.backends.cpu.get_cpu_capability() in kernels.KERNEL_CPU_CAPABILITIES:
        with pytest.warns(UserWarning, match="left from a build that was killed"):
            assert kernels._compiled.__wrapped__("rms_norm.cpp", "PyTorch's ops run") is None
    assert lock.exists()  # not ours to delete


def test_an_old_lock_file_of_a_loader_with_an_advisory_lock_is_no_reason_to_fall_back(monkeypatch, tmp_path):
    """Loaders that hold an advisory lock (the OS drops it when a build is killed) leave the lock file after every
    build: its age says nothing, and the kernels keep building and loading however old it is."""
    import os
    import time

    import torch.utils.cpp_extension

    import runtime.target.kernels as kernels

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.delattr(torch.utils.cpp_extension, "FileBaton", raising=False)
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert kernels._stale_build_lock("headstart_rms_norm") is None


def test_a_changed_header_names_another_build(monkeypatch, tmp_path):
    """torch's loader rebuilds a kernel when its source changes, not when a header it includes does; the headers'
    hash in the build's name makes a changed header build anew."""
    import runtime.target.kernels as kernels

    monkeypatch.setattr(kernels, "SOURCE_DIR", tmp_path)
    (tmp_path / "shared.h").write_text("constexpr int kRows = 12;\n")
    (tmp_path / "kernel.cpp").write_text("// not a header\n")
    before = kernels._headers_hash.__wrapped__()
    (tmp_path / "kernel.cpp").write_text("// changed, but torch sees this one\n")
    assert kernels._headers_hash.__wrapped__() == before
    (tmp_path / "shared.h").write_text("constexpr int kRows = 16;\n")
    assert kernels._headers_hash.__wrapped__() != before


def test_cpus_with_avx512_bf16_run_the_attention_build_made_for_them():
    from runtime.target.kernels import avx512_bf16_kernels

    if not avx512_bf16_kernels():
        pytest.skip("the CPU (or torch's capability) has no AVX512-BF16")
    assert decode_attention() is not None and decode_attention() is not decode_attention_avx2()


# The greedy LM head: candidates from an int8 copy of the weight, then the bf16 kernel on those rows alone.
def int8_or_skip():
    dot_kernel_or_skip()
    if not getattr(torch.cpu, "_is_vnni_supported", lambda: False)():
        pytest.skip("the int8 candidates need AVX512-VNNI")
    assert int8_candidates() is not None, "int8_candidates: the kernel did not build on a CPU with AVX512-VNNI"


@pytest.mark.parametrize("which", PACKED_KERNELS)
def test_bf16_packed_linear_columns_do_not_depend_on_their_neighbours(which):
    """A weight row's output is the same bit for bit whichever rows are packed beside it (int8_argmax computes the
    candidates' rows apart from the rest)."""
    kernel = packed_kernel_or_skip(which)
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(3, 576, generator=generator).bfloat16()
    weight = torch.randn(200, 576, generator=generator).bfloat16()
    full = kernel(x, pack_bf16_weight(weight), 200, None)
    for chosen in ([5], [0, 33, 199], list(range(64, 131, 3))):
        index = torch.tensor(chosen)
        part = kernel(x, pack_bf16_weight(weight[index]), len(chosen), None)
        assert torch.equal(part.view(torch.int16), full[:, index].view(torch.int16))


@pytest.mark.parametrize("k", [576, 101, 3])
def test_gather_packed_is_pack_of_the_chosen_rows(k):
    int8_or_skip()
    weight = torch.randn(90, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    for chosen in ([0], [3, 4, 89], list(range(0, 90, 2))):
        index = torch.tensor(chosen)
        assert torch.equal(kernels._int8_module().gather_packed(weight, index), pack_bf16_weight(weight[index]))


def greedy_reference(kernel, x, weight):
    return kernel(x, pack_bf16_weight(weight), weight.shape[0], None).argmax(-1)


@pytest.mark.parametrize("which", PACKED_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("n, k", [(1000, 576), (517, 64), (33, 130)])
def test_int8_argmax_is_the_products_argmax(which, rows, n, k):
    """Random weights at an LM head's scale and hidden rows with a few large features (as after a final norm): the
    argmax of every row equals the full product's, and every index holding a row's largest bf16 output is among the
    candidates."""
    kernel = packed_kernel_or_skip(which)
    int8_or_skip()
    generator = torch.Generator().manual_seed(rows * 7 + n + k)
    weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=generator)
    x[:, :3] *= 20
    x = x.bfloat16()
    int8 = Int8Rows(weight)
    assert torch.equal(int8_argmax(x, weight, int8, kernel, pack_bf16_weight(weight)),
                       greedy_reference(kernel, x, weight))
    logits = kernel(x, pack_bf16_weight(weight), n, None).float()
    found = int8.candidates(x, n)
    assert found is not None and torch.equal(found, found.sort().values)
    largest = (logits == logits.amax(-1, keepdim=True)).any(0).nonzero().flatten()
    assert set(largest.tolist()) <= set(found.tolist())


@pytest.mark.parametrize("which", PACKED_KERNELS)
def test_int8_argmax_ties_and_near_ties_pick_the_first_largest(which):
    """Rows equal to the best one, rows one bf16 step away from it, and a row whose int8 copy ranks it first but whose
    bf16 output does not: the first index of the largest bf16 output, as argmax takes it."""
    kernel = packed_kernel_or_skip(which)
    int8_or_skip()
    generator = torch.Generator().manual_seed(11)
    k = 64
    weight = (torch.randn(300, k, generator=generator) * 0.05).bfloat16()
    x = torch.randn(2, k, generator=generator).bfloat16()
    best = int(greedy_reference(kernel, x[:1], weight))
    weight[250] = weight[best]  # an exact tie later in the vocabulary: the first stays the argmax
    weight[5] = weight[best]  # ... and earlier: it becomes the argmax
    near = weight[best].clone()
    near.view(torch.int16)[0] += 1  # one bf16 step further from zero: an output a step or two away from the best
    weight[120] = near
    packed, int8 = pack_bf16_weight(weight), Int8Rows(weight)
    for rows in (x[:1], x):
        assert torch.equal(int8_argmax(rows.contiguous(), weight, int8, kernel, packed),
                           greedy_reference(kernel, rows.contiguous(), weight))


def test_int8_candidates_leave_what_they_cannot_bound_to_the_full_product():
    """A row that is all zero or not finite, or more candidates than the cap: no candidates (the full product)."""
    int8_or_skip()
    kernel = packed_kernel_or_skip()
    weight = torch.randn(100, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    int8 = Int8Rows(weight)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert int8.candidates(x, 100) is not None and int8.candidates(x, 0) is None
    for bad in (0.0, float("inf"), float("nan")):
        rows = x.clone()
        rows[1] = bad if bad != 0.0 else rows[1] * 0
        rows[1, 0] = bad
        assert int8.candidates(rows, 100) is None
    zero = x.clone()
    zero[2] = 0
    expected = torch.cat([greedy_reference(kernel, x[:2].contiguous(), weight), torch.zeros(1, dtype=torch.long)])
    assert torch.equal(int8_argmax(zero, weight, int8, kernel, pack_bf16_weight(weight)), expected)
