"""Time the per-layer ops of a bf16 decode pass: PyTorch against the compiled kernels, in one process.

    python scripts/bench_decode_ops.py --rows 1 2 4 8 16 --context 300 [--batch 32]

Attention: SmolLM2-135M's heads (9 query heads, 3 KV heads, head size 64) over ``--context`` cached positions plus
the new rows, keys and values as views of a longer cache buffer and a tree mask, as a verification pass has them,
for ``--batch`` rows of a batch (a batched decode step: every row its own cache);
PyTorch's SDPA (what the attention module runs otherwise, with the transpose to [B, T, H, D] after it) against
``runtime.target.kernels.decode_attention`` (and, where that is the AVX512-BF16 build, its AVX2 build beside it).
RMSNorm: transformers' LlamaRMSNorm over the rows against ``runtime.target.kernels.rms_norm_rows``. A pass runs 30
attention calls and 61 norms. The greedy token: ``argmax`` over the pass's bf16 logits (49152-token vocabulary,
--batch x rows of them) against ``runtime.engine.sampling.greedy_tokens`` (an exact fp32 conversion, then the argmax by
chunk maxima), once a pass. Reports median microseconds over --repeats calls, interleaved. Run it with nothing else
on the machine.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bench.timing import median_ms
from runtime.engine.sampling import greedy_tokens
from runtime.target.kernels import decode_attention, decode_attention_avx2, rms_norm_rows

HEADS, KV_HEADS, HEAD_SIZE, HIDDEN, VOCAB = 9, 3, 64, 576, 49152


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--batch", type=int, default=1, help="batch rows (prompts decoded together)")
    args = parser.parse_args(argv)
    attention, norm_rows = decode_attention(), rms_norm_rows()
    if attention is None or norm_rows is None:
        raise SystemExit("the decode kernels are not available on this machine (need AVX2, a C++ compiler, ninja)")
    avx2 = decode_attention_avx2()
    avx2 = avx2 if avx2 is not attention else None
    norm = LlamaRMSNorm(HIDDEN, eps=1e-5).bfloat16()
    print(f"{torch.get_num_threads()} threads, context {args.context}, batch {args.batch}")
    print("| rows | SDPA us | attention kernel us | ratio | LlamaRMSNorm us | norm kernel us | ratio |"
          + (" AVX2 attention build us | AVX2 / kernel |" if avx2 is not None else "") + "\n"
          + "|---:" * (7 + 2 * (avx2 is not None)) + "|")
    for rows in args.rows:
        slots = args.context + rows
        cache = torch.randn(2, args.batch, KV_HEADS, slots + 64, HEAD_SIZE).bfloat16()
        key, value = cache[0, :, :, :slots], cache[1, :, :, :slots]
        query = torch.randn(args.batch, rows, HEADS, HEAD_SIZE).bfloat16().transpose(1, 2)
        mask = torch.ones(args.batch, 1, rows, slots, dtype=torch.bool)
        mask[..., args.context:] = torch.ones(rows, rows, dtype=torch.bool).tril()
        scale = HEAD_SIZE ** -0.5
        hidden = torch.randn(args.batch, rows, HIDDEN).bfloat16()
        times = {"sdpa": [], "kernel": [], "norm": [], "norm kernel": [], "avx2": []}
        for _ in range(3):  # interleaved rounds, so that a slow spell of the machine hits both alike
            times["sdpa"].append(median_ms(lambda: F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2).contiguous(),
                args.repeats))
            times["kernel"].append(median_ms(lambda: attention(query, key, value, mask, scale), args.repeats))
            times["norm"].append(median_ms(lambda: norm(hidden), args.repeats))
            times["norm kernel"].append(median_ms(lambda: norm_rows(hidden, norm.weight, norm.variance_epsilon),
                                                  args.repeats))
            if avx2 is not None:
                times["avx2"].append(median_ms(lambda: avx2(query, key, value, mask, scale), args.repeats))
        us = {name: sorted(values)[1] * 1000 for name, values in times.items() if values}
        line = (f"| {rows} | {us['sdpa']:.0f} | {us['kernel']:.0f} | {us['sdpa'] / us['kernel']:.1f} | "
                f"{us['norm']:.1f} | {us['norm kernel']:.1f} | {us['norm'] / us['norm kernel']:.1f} |")
        if avx2 is not None:
            line += f" {us['avx2']:.0f} | {us['avx2'] / us['kernel']:.2f} |"
        print(line)
    print("\n| rows | bf16 argmax us | greedy_tokens us | ratio |\n|---:|---:|---:|---:|")
    for rows in args.rows:
        logits = torch.randn(args.batch, rows, VOCAB).bfloat16()
        argmax, picked = [], []
        for _ in range(3):
            argmax.append(median_ms(lambda: logits.argmax(-1), args.repeats // 10 or 1))
            picked.append(median_ms(lambda: greedy_tokens(logits), args.repeats // 10 or 1))
        a, g = sorted(argmax)[1] * 1000, sorted(picked)[1] * 1000
        print(f"| {rows} | {a:.0f} | {g:.0f} | {a / g:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
