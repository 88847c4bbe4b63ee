"""Time the KV cache's per-step bookkeeping at several batch sizes: writing a pass's entries at ragged row lengths
and compacting each row to its accepted path, against the same moves done with ``scatter_`` over an expanded index.

    python scripts/bench_kv_cache.py --rows 1 4 16 --nodes 1 4

SmolLM2-135M's cache shape (30 layers, 3 KV heads, head size 64, bf16), rows at lengths spread over --context ..
2 x --context (continuous batching makes them ragged). A write is one layer's keys and values (a pass makes 30); a
compaction keeps nodes 0, 2, 3, ... of each row's --nodes written entries (all of the model's layers at once).
Dropping a finished row (a draining batch, once no prompt takes its place): copying every kept row into a smaller
buffer (``index_select``, the earlier way) against ``KVCache.keep_rows``, for a cache sized for 256 new tokens.
Reports median milliseconds over --repeats calls. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.timing import median_ms
from runtime.engine.kv_cache import KVCache

LAYERS, KV_HEADS, HEAD_SIZE = 30, 3, 64


def scatter_write(layer: torch.Tensor, lengths: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """The reference write: scatter_ along the slot axis with the index expanded over heads and head size."""
    slots = lengths[:, None] + torch.arange(keys.shape[2])[None, :]
    index = slots[:, None, :, None].expand_as(keys)
    layer[0].scatter_(2, index, keys)
    layer[1].scatter_(2, index, values)


def scatter_compact(kv: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
    """The reference compaction: gather every kept slot and scatter it back, moved or not."""
    offsets = torch.arange(keep.shape[1])
    source = lengths[:, None] + torch.where(offsets[None, :] < n_keep[:, None], keep, offsets[None, :])
    dest = lengths[:, None] + offsets[None, :]
    layers, two, batch, heads, _, dim = kv.shape
    gathered = torch.gather(kv, 4, source[None, None, :, None, :, None].expand(layers, two, batch, heads,
                                                                               keep.shape[1], dim))
    kv.scatter_(4, dest[None, None, :, None, :, None].expand_as(gathered), gathered)


@torch.inference_mode()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, rows at lengths {args.context}..{2 * args.context}")
    print("| rows | nodes | write: scatter ms | write: ours ms | compact: scatter ms | compact: ours ms |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for nodes in args.nodes:
            cache = KVCache(LAYERS, rows, KV_HEADS, HEAD_SIZE, 2 * args.context + nodes + 1, torch.bfloat16, "cpu")
            lengths = torch.randint(args.context, 2 * args.context, (rows,), generator=generator)
            if rows > 1:
                lengths[0] = args.context  # ragged for certain
            cache.commit(lengths)
            keys = torch.randn(rows, KV_HEADS, nodes, HEAD_SIZE, generator=generator).bfloat16()
            keep = torch.tensor([0, *range(2, nodes)] if nodes > 1 else [0]).repeat(rows, 1)
            n_keep = torch.full((rows,), keep.shape[1])
            ms = {
                "write scatter": median_ms(lambda: scatter_write(cache.kv[0], cache.lengths, keys, keys),
                                           args.repeats),
                "write ours": median_ms(lambda: cache.update(keys, keys, 0), args.repeats),
                "compact scatter": median_ms(lambda: scatter_compact(cache.kv, cache.lengths, keep, n_keep),
                                             args.repeats),
                # compaction commits; undo it so every call starts from the same lengths
                "compact ours": median_ms(lambda: (cache.compact(keep, n_keep), cache.commit(-n_keep)),
                                          args.repeats),
            }
            print(f"| {rows} | {nodes} | {ms['write scatter']:.3f} | {ms['write ours']:.3f} | "
                  f"{ms['compact scatter']:.3f} | {ms['compact ours']:.3f} |")
    print("\n| rows | drop a row: index_select ms | drop a row: keep_rows ms |\n|---:|---:|---:|")
    for rows in [rows for rows in args.rows if rows > 1]:
        cache = KVCache(LAYERS, rows, KV_HEADS, HEAD_SIZE, 2 * args.context + 256, torch.bfloat16, "cpu")
        cache.commit(torch.randint(args.context, 2 * args.context, (rows,), generator=generator))
        index = torch.arange(1, rows)

        def drop_row():  # on a fresh cache object over the same buffer each time: keep_rows narrows its own view
            fresh = cache.rows(0, rows)
            fresh.commit(cache.lengths)
            fresh.keep_rows(list(range(1, rows)))

        copied = median_ms(lambda: cache.kv.index_select(2, index), max(args.repeats // 10, 3))
        print(f"| {rows} | {copied:.2f} | {median_ms(drop_row, args.repeats):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
