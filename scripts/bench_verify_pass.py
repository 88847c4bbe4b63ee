"""Where a verification pass spends its time on this machine, and whether torch.compile makes it cheaper.

    python scripts/bench_verify_pass.py                       # eager cost of T = 1, 8, 16 plus an op profile
    python scripts/bench_verify_pass.py --dtype bfloat16 --sizes 1 4 8
    python scripts/bench_verify_pass.py --compile --freezing  # adds inductor-compiled passes (minutes per shape)

The eager rows are the runtime's own pass (Target.forward with its KV cache), with the decode layers
(runtime.target.decode_layers: decode_linear, the decode norms) and with the stock layers; both attend through the
runtime's backend (in bf16 on CPU the decode attention kernel); ratios are to the runtime's T = 1. Where the lean pass
runs (runtime.target.lean), "eager, greedy" is the pass greedy decoding asks for (only the argmax: the int8 LM head up
to two rows), "eager, lean layers from Python" the lean pass with its compiled layer stack turned off and "eager,
ordinary pages" the lean pass with its weight copies on ordinary pages, not huge pages (runtime.target.host_memory). The
compiled rows run the stock model (its own attention and layers, as outside the runtime's passes) through torch.compile
with static shapes: a cache that writes into a fixed buffer with ``index_copy_`` and a mask over the whole buffer
(``runtime.target.static_pass.SlotCache``), so no Python int changes between steps (the runtime's cache keeps one, which
makes dynamo recompile or fall back). ``--fixed-shapes`` adds the runtime's fixed-shape passes (CUDA graphs with
``--device cuda``; on a CPU their eager twin). The profile splits the T = 1 pass into matrix products and the rest and
converts the matrix-product time into the bandwidth at which the weights were read; the roofline line sets the T = 1
pass against the time this machine takes just to read the weights once (``runtime.target.machine.read_bandwidth``), the
floor for any engine's plain decoding. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.timing import median_of_ms
from heads.common import cache_argument
from runtime.engine.tree import Tree, verification_mask
from runtime.target.machine import read_bandwidth, synchronized_seconds
from runtime.target.model import DEFAULT_TARGET, load_target, target_from_model
from runtime.target.static_pass import SlotCache, write_index


@torch.inference_mode()
def eager_times(target, context: int, size: int, repeats: int, argmax: bool = False) -> list[float]:
    device = target.device
    cache = target.new_cache(1, context + max(size, 64) + 1)
    prompt = torch.randint(0, target.vocab_size, (1, context), device=device)
    target.forward(prompt, torch.arange(context, device=device)[None], cache, None, logits_from=context - 1)
    cache.commit(context)
    tree = Tree.chain(0, [1] * (size - 1), device=device)
    mask = verification_mask(tree.ancestor_mask(), context) if size > 1 else None
    times = []
    for _ in range(repeats + 2):  # the first two: a fixed-shape target captures its pass there
        started = time.perf_counter()
        target.forward(tree.tokens[None], tree.position_ids(context)[None], cache, mask, argmax=argmax)
        times.append(synchronized_seconds(device, started))
    return times[2:]


@torch.inference_mode()
def compiled_times(target, step, buffer: int, context: int, size: int, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first call, which compiles; then the per-call times)."""
    config = target.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = torch.zeros(config.num_hidden_layers, 2, 1, config.num_key_value_heads, buffer, head_dim, dtype=target.dtype)
    tree = Tree.chain(0, [1] * (size - 1))
    mask = torch.zeros(1, 1, size, buffer, dtype=torch.bool)
    mask[..., :context] = True  # the cached context is random keys: only the cost matters here
    mask[0, 0, :, context:context + size] = tree.ancestor_mask()
    slots = torch.arange(context, context + size)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        step(tree.tokens[None], tree.position_ids(context)[None], kv, slots, mask)
        times.append(time.perf_counter() - started)
    return times[0], times[1:]


@torch.inference_mode()
def profile_step(target, context: int) -> tuple[float, float]:
    """(ms per T = 1 pass inside aten::mm, ms per pass in total) from torch.profiler over 10 passes."""
    from torch.profiler import ProfilerActivity, profile

    cache = target.new_cache(1, context + 16)
    target.forward(torch.randint(0, target.vocab_size, (1, context)), torch.arange(context)[None], cache, None,
                   logits_from=context - 1)
    cache.commit(context)
    token, position = torch.zeros(1, 1, dtype=torch.long), torch.tensor([[context]])
    target.forward(token, position, cache, None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            target.forward(token, position, cache, None)
    events = prof.key_averages()
    matmul = sum(event.self_cpu_time_total for event in events if event.key in ("aten::mm", "aten::addmm"))
    total = sum(event.self_cpu_time_total for event in events)
    return matmul / 10 / 1000, total / 10 / 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default="float32", help="the target's dtype (float32, bfloat16)")
    parser.add_argument("--compile", action="store_true", help="also time inductor-compiled passes")
    parser.add_argument("--freezing", action="store_true", help="compile with inductor freezing (weights as constants)")
    parser.add_argument("--buffer", type=int, default=512, help="static KV buffer length for the compiled passes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fixed-shapes", action="store_true",
                        help="also time the fixed-shape passes (CUDA graphs on a GPU; on a CPU, their eager twin)")
    args = parser.parse_args(argv)
    if args.compile and args.device != "cpu":
        parser.error("--compile times CPU passes; leave it out with --device " + args.device)

    target = load_target(args.target, dtype=args.dtype, device=args.device, quiet=True)
    # the same weights, wrapped without the decode layers
    stock = target_from_model(target.model, target.tokenizer, target.identity, decode_kernels=False)
    print(f"threads {torch.get_num_threads()}, context {args.context}, {args.dtype}\n")
    print("| pass | T | median ms | min ms | vs eager T=1 | compile s |\n|---|---:|---:|---:|---:|---:|")
    # (target, whether the pass computes only the argmax, as greedy decoding asks)
    passes = {"eager, stock layers": (stock, False), "eager": (target, False), "eager, greedy": (target, True)}
    if target._lean is not None and target._lean.stack is not None:
        # the lean pass with its layers called from Python, as before the compiled stack
        loop = target_from_model(target.model, target.tokenizer, target.identity)
        loop._lean.stack = None
        passes["eager, lean layers from Python"] = (loop, False)
        # the lean pass's weight copies on ordinary pages, as before they went to huge pages
        ordinary = target_from_model(target.model, target.tokenizer, target.identity)
        ordinary._lean.arena.enabled = False
        passes["eager, ordinary pages"] = (ordinary, False)
    if args.fixed_shapes:
        graphs = "CUDA graphs" if target.device.type == "cuda" else "eager twin"
        passes[f"fixed shapes ({graphs})"] = (target_from_model(target.model, target.tokenizer, target.identity,
                                                                fixed_shapes=True), False)
    eager = {(label, size): [] for label in passes for size in args.sizes}
    for _ in range(3):  # interleaved rounds, so that a slow spell of the machine hits all alike
        for (label, size), times in eager.items():
            model, greedy = passes[label]
            times += eager_times(model, args.context, size, args.repeats, greedy)
    base = median_of_ms(eager[("eager", args.sizes[0])])
    for (label, size), times in eager.items():
        print(f"| {label} | {size} | {median_of_ms(times):.1f} | {min(times) * 1000:.1f} | "
              f"{median_of_ms(times) / base:.2f} | |")
    if args.compile:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = args.freezing

        def step(input_ids, position_ids, kv, slots, mask):
            out = target.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                                  **cache_argument(target.backbone, SlotCache(kv, write_index(slots[None], kv.shape[3],
                                                                                     kv.shape[4]))))
            return target.logits(out.last_hidden_state)

        compiled = torch.compile(step, dynamic=False)
        label = "compiled+freezing" if args.freezing else "compiled"
        for size in args.sizes:
            first, times = compiled_times(target, compiled, args.buffer, args.context, size, args.repeats)
            print(f"| {label} | {size} | {median_of_ms(times):.1f} | {min(times) * 1000:.1f} | "
                  f"{median_of_ms(times) / base:.2f} | {first:.0f} |")
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    embedding = target.model.get_input_embeddings().weight
    if embedding.data_ptr() != target.lm_head.weight.data_ptr():
        weight_bytes -= embedding.numel() * embedding.element_size()  # a lookup reads rows, not the whole table
    # the roofline: a one-row pass reads every weight once, so no engine's pass is faster than the weights' bytes
    # at the bandwidth this machine reads memory with these threads (llama.cpp's plain decoding included)
    bandwidth = read_bandwidth(target.device)
    floor_ms = weight_bytes / bandwidth * 1000
    print(f"\nroofline: {weight_bytes / 1e6:.0f} MB of weights per pass, memory read at {bandwidth / 1e9:.1f} GB/s "
          f"({torch.get_num_threads()} threads) -> a T=1 pass takes at least {floor_ms:.1f} ms "
          f"({1000 / floor_ms:.0f} tokens/s for plain decoding); the eager T=1 pass takes {base:.1f} ms, "
          f"{floor_ms / base:.0%} of the roofline")
    if target.device.type != "cpu":  # the operator profile below is the CPU's
        return 0
    matmul_ms, total_ms = profile_step(target, args.context)
    if matmul_ms == 0:  # the compiled bf16 kernels are not operators the profiler sees
        print(f"\nT=1 profile: the matrix products ran in the compiled kernels, which the profiler does not see "
              f"({total_ms:.1f} ms per pass in the operators it does)")
        return 0
    print(f"\nT=1 profile: matrix products {matmul_ms:.1f} of {total_ms:.1f} ms per pass "
          f"({matmul_ms / total_ms:.0%}); weights {weight_bytes / 1e6:.0f} MB read at "
          f"{weight_bytes / matmul_ms / 1e6:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
