"""The target's greedy token over its whole vocabulary, without an fp32 product over the whole vocabulary.

An EAGLE-3 loss needs the target's distribution only over the draft vocabulary (a few thousand LM-head rows), but
its greedy token over all of it (whether the draft vocabulary can express it at all). On a CPU the fp32 product
over a 49k vocabulary was the largest part of a training step from recorded features. ``screened_argmax`` takes
the bf16 product's best few tokens per row, which runs several times faster on CPUs with bf16 matrix instructions,
and picks among them by their fp32 logits.

It is not a proof of the fp32 argmax: bf16 rounding moves a logit by up to about 2^-8 of its size plus the
rounding of the 8-bit operands, so the fp32 winner falls outside the bf16 top ``candidates`` only where that many
tokens sit within the rounding of the best one, a near-uniform row whose greedy token means little to a draft head.
``scripts/bench_target_logits.py`` counts how often the two differ on the target's own hidden states. (A proof
would recompute every token within the worst-case rounding of the best, which by Cauchy-Schwarz is most of a row's
plausible tokens: it cost more than the fp32 product it replaces.)
"""

from __future__ import annotations

import torch

from runtime.target.kernels import native_bf16_matmul

CANDIDATES = 16  # bf16 top tokens per row recomputed in fp32


@torch.no_grad()
def screened_argmax(hidden: torch.Tensor, weight: torch.Tensor, weight_bf16: torch.Tensor,
                    candidates: int = CANDIDATES) -> torch.Tensor:
    """The token of largest fp32 logit among each row's ``candidates`` largest bf16 logits.

    hidden [N, H] (any float dtype; computed in fp32); weight [V, H]; weight_bf16: the same in bfloat16. Returns
    [N] long. A monotonic map of the logits (soft-capping) keeps the order, so callers may skip it.
    """
    hidden = hidden.float()
    top = (hidden.to(torch.bfloat16) @ weight_bf16.T).topk(min(candidates, weight.shape[0]), dim=-1).indices
    exact = torch.einsum("nh,nkh->nk", hidden, weight[top].float())  # [N, candidates]
    return top.gather(-1, exact.argmax(-1, keepdim=True))[:, 0]


def bf16_screening_pays(device: torch.device) -> bool:
    """Whether ``screened_argmax`` beats one fp32 product on ``device``: on CPUs with bf16 matrix instructions
    (AVX512-BF16, AMX) PyTorch's bf16 product is several times faster than fp32 (scripts/bench_target_logits.py
    measures both); without them it is slower. On a GPU the fp32 product over the vocabulary is cheap."""
    return device.type == "cpu" and native_bf16_matmul()
