"""Compiled CPU kernels, built on first use, each beside the PyTorch expression it must equal.

``bf16_rows_matmul``: a few rows times a bfloat16 weight matrix, reading the weights once (bf16_rows.cpp);
``bf16_rows_linear``: the same product as a whole bf16 linear layer (bf16 rows in, bias, bf16 rows out). Built with
torch's C++ extension loader (a C++ compiler and ninja; the build is cached by torch and takes a while the first
time).
Where it cannot be built, callers get None and keep PyTorch's own product.
``bf16_dot_linear``: the bf16 linear layer with AVX512-BF16's dot-product instruction (bf16_dot_rows.cpp), on CPUs
that have it: several times more rows per weight read before compute binds.
``bf16_packed_linear``: the same layer over a weight packed once by ``pack_bf16_weight`` (bf16_packed_rows.cpp), on the
same CPUs: no per-output reduction, so many rows run near the instruction's rate.
``bf16_packed_linear_avx2``: the same layer over the same packed weight with AVX2 FMAs (bf16_packed_rows_avx2.cpp),
on CPUs without AVX512-BF16.
``bf16_amx_linear``: the same layer over the same packed weight with AMX tiles (bf16_amx_rows.cpp), on CPUs that
have them: up to 16 rows per tile product, so a few rows cost what one row costs.
``onednn_bf16_linear``: the same layer through oneDNN over a weight reordered once by ``pack_onednn_weight``, where
PyTorch's oneDNN takes bf16 (on CPUs with AMX its tile instructions, with a fixed cost per call beyond the
product).
``decode_attention``: attention of a few bf16 query rows over a bf16 KV cache (decode_attention.cpp), tested against
fp32 SDPA over the same values.
``rms_norm_rows``: the Llama-family RMSNorm over bf16 rows in one call (rms_norm.cpp), tested against the module.
``int8_argmax``: the first index of each bf16 row's largest output of a vocabulary projection, reading an int8 copy of
its weight (``Int8Rows``) and only the bf16 rows that may hold the largest (int8_candidates.cpp), equal to
``bf16_linear(x).argmax(-1)`` always.
``native_bf16_matmul``: whether the CPU has bf16 matrix instructions, which make PyTorch's own bf16 product fast.
"""

from __future__ import annotations

import functools
import hashlib
import time
import warnings
from pathlib import Path
from collections.abc import Callable

import torch

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_CPU_CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() values with AVX2 and FMA
# the instruction sets each kernel is written for: the AVX2 kernels, and the AVX512-BF16 dot-product kernel
ROW_KERNEL_FLAGS = ("-mavx2", "-mfma")
DOT_KERNEL_FLAGS = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
AMX_KERNEL_FLAGS = (*DOT_KERNEL_FLAGS, "-mamx-tile", "-mamx-bf16")


@functools.cache
def _compiled(source: str, fallback: str, isa_flags: tuple[str, ...] = ROW_KERNEL_FLAGS, variant: str = "",
              linked: tuple[str, ...] = (), defines: tuple[str, ...] = ()):
    """The compiled ``source`` (a file beside this one), or None where it cannot be built or run; ``fallback`` says
    in the warning what runs instead. ``isa_flags``: the instruction sets it is written for (the caller checks that
    the CPU has them beyond AVX2); ``variant`` names a second build of the same source with other flags; ``linked``:
    other sources built into the same module (whose own Python modules ``HEADSTART_ONE_MODULE`` leaves out);
    ``defines``: preprocessor names defined for every source."""
    if torch.backends.cpu.get_cpu_capability() not in KERNEL_CPU_CAPABILITIES:
        return None  # the kernels are written with AVX2/FMA intrinsics
    # torch's loader rebuilds when a source changes, not when a header it includes does: the headers' hash is part of
    # the name, so a changed header builds anew instead of loading a stale build
    name = f"headstart_{Path(source).stem}" + (f"_{variant}" if variant else "") + f"_{_headers_hash()}"
    stale = _stale_build_lock(name)
    if stale is not None:
        warnings.warn(f"the kernel {source} is not built: {stale} is left from a build that was killed, and the "
                      f"build would wait on it for good; delete it to build the kernel again. {fallback}",
                      stacklevel=3)
        return None
    try:
        return build_source(SOURCE_DIR / source, name, isa_flags, tuple(SOURCE_DIR / other for other in linked),
                            defines)
    except Exception as error:  # no compiler or ninja: fall back rather than fail decoding
        warnings.warn(f"the kernel {source} could not be built ({type(error).__name__}: {error}); {fallback}",
                      stacklevel=3)
        return None


@functools.cache
def _headers_hash() -> str:
    """A short hash of the kernels' shared headers (the .h files beside them)."""
    digest = hashlib.sha1()
    for header in sorted(SOURCE_DIR.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()[:8]


def build_source(path: Path, name: str, isa_flags: tuple[str, ...], linked: tuple[Path, ...] = (),
                 defines: tuple[str, ...] = ()):
    """Compile the kernel source ``path`` (with the sources ``linked``) as extension module ``name`` (cached by
    torch); raises where it cannot be built. The kernels' shared header is on the include path, so another version of
    a kernel's source (a benchmark's baseline) builds the same way."""
    from torch.utils.cpp_extension import load

    flags = ["-O3", *isa_flags, "-fopenmp", *(f"-D{define}" for define in defines)]
    if linked:
        flags.append("-DHEADSTART_ONE_MODULE")
    return load(name=name, sources=[str(path), *map(str, linked)], extra_include_paths=[str(SOURCE_DIR)],
                # without OpenMP, at::parallel_for runs on one thread
                extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


STALE_LOCK_SECONDS = 600  # a first build takes well under this; an older lock outlived the build that made it


def _stale_build_lock(name: str) -> Path | None:
    """A build lock of extension ``name`` older than ``STALE_LOCK_SECONDS``, or None. Loaders that lock with a file
    whose existence blocks (torch's ``FileBaton``) wait without a timeout while it exists, and a build killed outright
    leaves it behind. Newer loaders hold an advisory lock on a file that stays after every build and blocks nobody
    once its holder is gone: there a lock file says nothing, and judging it by age would turn the kernels off for
    good ten minutes after the first build."""
    try:
        import torch.utils.cpp_extension as cpp_extension

        if not hasattr(cpp_extension, "FileBaton"):
            return None
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        return lock if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS else None
    except Exception:  # a private helper of torch's: where it changed, the loader decides as before
        return None


def _bf16_rows_module():
    return _compiled("bf16_rows.cpp", "bf16 passes of several rows use PyTorch's product, which costs about one "
                                      "one-row pass per row on CPUs without bf16 matrix instructions")


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


def avx512_bf16_kernels() -> bool:
    """Whether the AVX512-BF16 builds may run here: the CPU's AVX512-BF16, and torch's own AVX-512 capability
    (AVX512F/BW/VL/DQ, which the kernels' loads need). A user who pins torch to AVX2 (ATEN_CPU_CAPABILITY=avx2) gets
    no AVX-512 code from here either."""
    return (torch.backends.cpu.get_cpu_capability() == "AVX512"
            and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


@functools.cache
def bf16_dot_linear() -> Callable[..., torch.Tensor] | None:
    """(x [M, K] bfloat16, weight [N, K] bfloat16, bias [N] or None) -> [M, N] bfloat16 through AVX512-BF16's
    dot-product instruction, or None where the CPU lacks it (or it cannot be built).

    fp32 sums of exact products, the bias added in fp32, one rounding: the reference it is tested against is
    ``(x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)``, equal up to summation order.
    """
    if not avx512_bf16_kernels():
        return None
    module = _compiled("bf16_dot_rows.cpp", "bf16 rows use the AVX2 row kernel or PyTorch's product", DOT_KERNEL_FLAGS)
    return None if module is None else module.bf16_dot_linear


PACKED_BLOCK_COLUMNS = 32  # output columns per packed block (bf16_packed_rows.cpp)


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 -> [ceil(N / 32), ceil(K / 2), 32, 2] bfloat16, the layout ``bf16_packed_linear``
    reads: element [b, p, c, e] = weight[32 b + c, 2 p + e], zeros beyond N and K. A copy; the weight is untouched."""
    n, k = weight.shape
    blocks, pairs = -(-n // PACKED_BLOCK_COLUMNS), -(-k // 2)
    padded = torch.nn.functional.pad(weight.detach(), (0, 2 * pairs - k, 0, blocks * PACKED_BLOCK_COLUMNS - n))
    return padded.reshape(blocks, PACKED_BLOCK_COLUMNS, pairs, 2).transpose(1, 2).contiguous()


@functools.cache
def bf16_packed_linear() -> Callable[..., torch.Tensor] | None:
    """(x [M, K] bfloat16, packed (``pack_bf16_weight(weight)``), N, bias [N] or None) -> [M, N] bfloat16 through
    AVX512-BF16's dot-product instruction, or None where ``bf16_dot_linear`` is None.

    Each output is one fp32 sum over k of exact products, the bias added in fp32, one rounding; the reference it is
    tested against is ``(x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)``, equal up to summation
    order. A row's outputs never depend on the other rows of the call.
    """
    if bf16_dot_linear() is None:  # the same CPU and build conditions
        return None
    module = _compiled("bf16_packed_rows.cpp", "bf16 rows use the unpacked dot-product kernel", DOT_KERNEL_FLAGS)
    return None if module is None else module.bf16_packed_linear


@functools.cache
def bf16_amx_linear() -> Callable[..., torch.Tensor] | None:
    """(x [M, K] bfloat16, packed (``pack_bf16_weight(weight)``), N, bias [N] or None) -> [M, N] bfloat16 through
    AMX tiles, or None where the CPU lacks AMX-BF16, Linux does not grant the tile state, or it cannot be built.

    fp32 sums of exact products, the bias added in fp32, one rounding: the reference it is tested against is
    ``(x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)``, equal up to summation order. A row's
    outputs never depend on the other rows of the call.
    """
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if not amx or bf16_dot_linear() is None:  # the tail of k runs on AVX512-BF16
        return None
    module = _compiled("bf16_amx_rows.cpp", "bf16 rows use the other products", AMX_KERNEL_FLAGS)
    if module is None or not module.enable_amx():
        return None
    return module.bf16_amx_linear


@functools.cache
def decode_attention_avx2() -> Callable[..., torch.Tensor] | None:
    """``decode_attention``'s AVX2 build, or None: what CPUs without AVX512-BF16 run (benchmarks time it beside the
    other build, tests hold both to the same reference)."""
    module = _compiled("decode_attention.cpp", "bf16 decode steps use PyTorch's SDPA")
    return None if module is None else module.decode_attention


@functools.cache
def decode_attention() -> Callable[..., torch.Tensor] | None:
    """(query [B, H, T, D] bf16, key/value [B, Hkv, S, D] bf16, mask [B or 1, 1, T, S] bool or None, scale,
    counts [B] or None) -> out [B, T, H, D] bf16, for 1-16 query rows and head size 64 or 128 (last dimensions
    contiguous), or None. With ``counts`` the query rows come packed (``runtime.engine.ragged``): query [1, H, T', D]
    holds batch row b's counts[b] rows after those of the rows before it, each reads its row of the mask (T = max
    counts), and the output is [1, T', H, D] in that order.

    Scores, softmax and the weighted sum are fp32 over the bf16 values, with one rounding at the end; the reference it
    is tested against is fp32 SDPA over the same values. A row that may attend to nothing gets zeros. On a CPU with
    AVX512-BF16 the same source is built with those instructions (scores by bf16 dot products, 16 lanes wide).
    """
    if avx512_bf16_kernels():
        module = _compiled("decode_attention.cpp", "bf16 decode steps use the AVX2 build", DOT_KERNEL_FLAGS,
                           variant="avx512bf16")
        if module is not None:
            return module.decode_attention
    return decode_attention_avx2()


@functools.cache
def rms_norm_rows() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """(x [..., H] bf16 contiguous, weight [H] bf16, eps) -> ``weight * bf16(x * rsqrt(mean(x^2) + eps))`` bf16, or
    None.

    The reference it is tested against is transformers' LlamaRMSNorm: the same operations, the sum of squares in
    another order.
    """
    module = _compiled("rms_norm.cpp", "bf16 RMSNorm runs as PyTorch's eight calls")
    return None if module is None else module.rms_norm_rows


@functools.cache
def bf16_packed_linear_avx2() -> Callable[..., torch.Tensor] | None:
    """``bf16_packed_linear`` with AVX2 FMAs over the same packed weight (bf16_packed_rows_avx2.cpp), for CPUs without
    AVX512-BF16 (it builds on any with AVX2 and FMA), or None where it cannot be built.

    Each output is one fp32 sum over k of exact products, the bias added in fp32, one rounding: the reference it is
    tested against is ``(x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)``, equal up to summation
    order. A row's outputs never depend on the other rows of the call.
    """
    module = _compiled("bf16_packed_rows_avx2.cpp", "bf16 rows use the AVX2 row kernel")
    return None if module is None else module.bf16_packed_linear_avx2


# The forms of the weights' copies the lean pass reads (runtime.target.linear_plan.FORMS), all pack_bf16_weight's
# layout: the AVX512-BF16 packed kernel, the AMX tile kernel and the AVX2 packed kernel read it.
LEAN_FORMS = ("blocks", "amx", "avx2")


@functools.cache  # asked for every product of a decode-layers pass
def lean_product(form: str) -> Callable[..., torch.Tensor] | None:
    """The product over packed weights of ``form`` (``LEAN_FORMS``) as (x [M, K] bf16, packed copy, N, bias [N] or
    None) -> [M, N] bf16, or None where it does not run here."""
    return {"amx": bf16_amx_linear, "blocks": bf16_packed_linear, "avx2": bf16_packed_linear_avx2}[form]()


@functools.cache
def lean_layers(form: str) -> Callable[..., list[torch.Tensor]] | None:
    """The lean pass's decoder layers in one call (lean_layers.cpp; ``runtime.target.lean.LeanLlama`` says what it
    takes), with the products of ``form`` (``LEAN_FORMS``), or None where those do not run here or it cannot be
    built. Each layer is ``LeanLlama._layer``'s operations in its order and dtypes, equal bit for bit (the test holds
    the two to each other)."""
    if lean_product(form) is None or decode_attention() is None:
        return None
    amx, avx2 = form == "amx", form == "avx2"
    products = ("bf16_packed_rows_avx2.cpp",) if avx2 else ("bf16_packed_rows.cpp",) + (
        ("bf16_amx_rows.cpp",) if amx else ())
    # the stack's attention is the build decode_attention() returns (the loop's): the AVX512-BF16 one where it runs
    wide = avx512_bf16_kernels()
    module = _compiled("lean_layers.cpp", "the lean pass calls each layer's operations from Python",
                       AMX_KERNEL_FLAGS if amx else DOT_KERNEL_FLAGS if wide else ROW_KERNEL_FLAGS,
                       "avx2" + ("_512" if wide else "") if avx2 else "amx" if amx else "",
                       products + ("rms_norm.cpp", "decode_attention.cpp"),
                       ("HEADSTART_AMX",) if amx else ("HEADSTART_AVX2",) if avx2 else ())
    if module is None or (amx and not module.enable_amx()):
        return None
    return module.lean_layers


INT8_BLOCK_ROWS = 16  # weight rows per packed int8 block (int8_candidates.cpp)


@functools.cache
def int8_candidates() -> Callable[..., torch.Tensor] | None:
    """int8_candidates.cpp's function (``Int8Rows.candidates`` calls it), or None where the CPU lacks AVX512-BF16 or
    AVX512-VNNI or it cannot be built."""
    if not avx512_bf16_kernels() or not getattr(torch.cpu, "_is_vnni_supported", lambda: False)():
        return None
    module = _int8_module()
    return None if module is None else module.int8_candidates


def _int8_module():
    return _compiled("int8_candidates.cpp", "greedy steps compute every logit", (*DOT_KERNEL_FLAGS, "-mavx512vnni"))


class Int8Rows:
    """An int8 copy of a bf16 weight [N, K] (one scale per row, rounded to nearest) packed for int8_candidates.cpp,
    with what its bound needs per row: the sum of the int8 row, |w - s q| + gamma_K |w| and s |q|, each rounded up.
    Half the weight's memory, in ``arena`` (a ``runtime.target.host_memory.HugePageArena``) where given; the weight
    itself is untouched."""

    def __init__(self, weight: torch.Tensor, chunk: int = 4096, arena=None):
        n, k = weight.shape
        blocks, quads = -(-n // INT8_BLOCK_ROWS), -(-k // 4)
        padded = blocks * INT8_BLOCK_ROWS
        q = torch.zeros(padded, 4 * quads, dtype=torch.int8)
        self.sums = torch.zeros(padded, dtype=torch.int32)
        self.scale, self.c1, self.c2 = (torch.zeros(padded) for _ in range(3))
        # any order of K fp32 additions of exact products is within gamma of the exact sum times the sum of |terms|
        unit = 2.0 ** -24
        gamma = (k + 2) * unit / (1 - (k + 2) * unit)
        for start in range(0, n, chunk):
            rows = weight[start:start + chunk].detach().double()
            scale = (rows.abs().amax(-1) / 127).float().double()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            ints = (rows / scale[:, None]).round().clamp(-127, 127)
            end = start + rows.shape[0]
            q[start:end, :k] = ints.to(torch.int8)
            self.sums[start:end] = ints.sum(-1).to(torch.int32)
            self.scale[start:end] = scale.float()
            error = (rows - scale[:, None] * ints).norm(dim=-1)
            up = 1 + 2.0 ** -20  # fp64 norms rounded up past fp32's rounding
            self.c1[start:end] = ((error + gamma * rows.norm(dim=-1)) * up).float()
            self.c2[start:end] = (scale * ints.norm(dim=-1) * up).float()
        self.packed = q.reshape(blocks, INT8_BLOCK_ROWS, quads, 4).transpose(1, 2)
        self.packed = self.packed.contiguous() if arena is None else arena.copy(self.packed)
        self.rows = n

    def candidates(self, x: torch.Tensor, cap: int) -> torch.Tensor | None:
        """x [M, K] bf16 (M <= 16) -> sorted indices [C] of the weight rows that may hold some row's largest bf16
        output, or None when it cannot tell (a row not finite or all zero, or more than ``cap`` candidates)."""
        found = int8_candidates()(x.contiguous(), self.packed, self.sums, self.scale, self.c1, self.c2, self.rows,
                                  cap)
        return found if found.numel() else None


# Rows up to which the int8 candidates cost less than the bf16 product where that is not timed (a small model): each
# row is two int8 rows of integer dot products, which bind on the instruction beyond a few rows while the product
# stays bound on reading the weights (scripts/bench_bf16_rows.py --argmax times both; the runtime times them once per
# machine for a model's LM head: runtime.target.linear_plan.greedy_head_rows).
INT8_ARGMAX_MAX_ROWS = 2
INT8_KERNEL_MAX_ROWS = 16  # the most input rows int8_candidates.cpp takes


def int8_argmax(x: torch.Tensor, weight: torch.Tensor, int8: Int8Rows, linear: Callable[..., torch.Tensor],
                packed: torch.Tensor, cap: int = 4096, max_rows: int = INT8_ARGMAX_MAX_ROWS) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 -> [M] long: the first index of each row's largest output of
    ``linear(x, packed, N, None)`` (``packed``: ``pack_bf16_weight(weight)`` for one of the block kernels), computing
    only the outputs ``int8`` cannot rule out, with the same kernel: each output depends on its own weight row alone,
    so they are the full product's values, and every output ruled out is smaller than one of them. Falls back to the
    full product where the bound rules out too little (over ``cap`` candidates) or x has more than ``max_rows`` rows
    (at most 16)."""
    found = int8.candidates(x, cap) if 1 <= x.shape[0] <= min(max_rows, INT8_KERNEL_MAX_ROWS) else None
    if found is None:
        return linear(x, packed, weight.shape[0], None).argmax(-1)
    rows = _int8_module().gather_packed(weight.contiguous(), found)  # pack_bf16_weight(weight[found])
    return found[linear(x, rows, found.numel(), None).argmax(-1)]


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX tiles or AVX512-BF16), where PyTorch's bf16
    product is fast; without them it converts operands piecewise and runs several times slower than fp32."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


@functools.cache
def onednn_bf16_linear() -> Callable[..., torch.Tensor] | None:
    """(x [M, K] bfloat16, packed (``pack_onednn_weight(weight)``), bias [N] or None) -> [M, N] bfloat16 through
    PyTorch's oneDNN, or None where oneDNN is not built in or does not take bf16 on this CPU.

    fp32 sums of exact products, one rounding: the reference it is tested against is
    ``(x.float() @ weight.float().T + bias.float()).to(torch.bfloat16)``, equal up to summation order. PyTorch's own
    ``F.linear`` reaches the same library but reorders the weight into its blocked layout at every call, which on a
    decode step costs more than the product (scripts/bench_bf16_rows.py)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if not torch.backends.mkldnn.is_available() or supported is None or not supported():
        return None
    product = torch.ops.mkldnn._linear_pointwise

    def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return product(x, packed, bias, "none", [], "")

    return linear


def pack_onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 -> oneDNN's blocked copy of it for ``onednn_bf16_linear`` (an opaque tensor, as much
    memory as the weight). A copy; the weight is untouched."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
