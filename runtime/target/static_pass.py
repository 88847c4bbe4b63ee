"""Verification passes of fixed shapes, which a GPU captures once as CUDA graphs and then replays.

A decode-sized pass on a GPU is bound by launches, not arithmetic: hundreds of kernels of a few microseconds each,
with the Python of transformers' layers between them (on a CPU the lean pass, ``runtime.target.lean``, removes the
same overhead). A CUDA graph replays every kernel of a pass with one launch, but only with the shapes and addresses
it was captured with. So a fixed-shape pass: pads its rows up to a bucket (``BUCKETS``: a tree of 6 nodes runs as
8), takes the slots its keys and values go to as a tensor (one index copy per layer into the runtime's own cache
buffer), and attends over the cache's whole buffer with a mask over all of it, the slots past each row's pass masked
off; the positions each key slot holds go to sliding-window layers the same way. Nothing about a pass but tensor
contents changes from one step to the next. A pad row sees its own slot alone (a row that sees nothing would be NaN)
and writes past the pass's rows, slots no mask lets anything read before a later pass overwrites them.

Where capture is off (a CPU), the same fixed-shape passes run eagerly over the same static buffers: the CPU twin
the default tests check against the ordinary pass and the target's greedy decoding; ``scripts/gpu_check.sh`` checks
the captured side on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.kv_cache import KVCache
from runtime.engine.ragged import RaggedRows

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows per sequence a pass is padded up to; more rows take the ordinary pass
WARMUP_PASSES = 2  # eager passes on a side stream before capture, as CUDA graph capture asks
CACHES_KEPT = 2  # cache buffers with captured passes (a target and its own draft cache alternate)


def bucket_for(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket that holds ``rows`` rows, or None when none does."""
    return next((bucket for bucket in buckets if bucket >= rows), None)


@dataclass
class FixedInputs:
    """One fixed-shape pass's inputs: ids and positions [B, N], the mask [B, 1, N, S] over the whole buffer of S
    slots, the slots [B, N] the rows write, and the position each key slot holds [B, S]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    key_positions: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.position_ids, self.mask, self.slots, self.key_positions

    def clone(self) -> FixedInputs:
        return FixedInputs(*(tensor.clone() for tensor in self.tensors()))

    def copy_(self, other: FixedInputs) -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)


def fixed_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 lengths: torch.Tensor, committed: int, bucket: int, buffer: int,
                 key_positions: torch.Tensor | None = None) -> FixedInputs:
    """An ordinary pass's inputs as a fixed-shape pass's: input_ids, position_ids [B, T]; mask [B or 1, 1, T, S0] bool
    over slots 0 .. S0 - 1 (S0 = committed + T, the longest committed row's length plus the pass's rows, as
    ``KVCache.update`` returns keys), or None for one row that sees all S0 of them; lengths [B] the rows' committed
    lengths. Row t of row b writes slot lengths[b] + t, as the ordinary pass does. Pad rows (T .. bucket - 1) repeat
    the last token and position and see only their own slot. key_positions [B, S0]: the position each of those slots
    holds, where the caller says (by default slot j holds position j); the pass's own slots hold its rows'
    positions. Returns tensors on the inputs' device, shapes [B, bucket] and [B, 1, bucket, buffer].
    """
    batch, rows = input_ids.shape
    device = input_ids.device
    pad = bucket - rows
    ids = torch.cat((input_ids, input_ids[:, -1:].expand(batch, pad)), dim=1)
    positions = torch.cat((position_ids, position_ids[:, -1:].expand(batch, pad)), dim=1)
    slots = lengths[:, None] + torch.arange(bucket, device=device)[None]
    full = torch.zeros(batch, 1, bucket, buffer, dtype=torch.bool, device=device)
    if mask is None:
        full[:, :, :rows, : committed + rows] = True
    else:
        full[:, :, :rows, : mask.shape[-1]] = mask
    full[:, 0, rows:].scatter_(2, slots[:, rows:, None], True)  # each pad row: its own slot
    keys = torch.arange(buffer, device=device).repeat(batch, 1)
    if key_positions is not None:
        keys[:, : key_positions.shape[-1]] = key_positions
    keys.scatter_(1, slots, positions)
    return FixedInputs(ids, positions, full, slots, keys)


def write_index(slots: torch.Tensor, kv_heads: int, buffer: int) -> torch.Tensor:
    """slots [B, N] -> [B * Hkv * N] indices into a layer's keys viewed as [B * Hkv * buffer, D], in the order of
    key_states [B, Hkv, N, D] flattened (as ``KVCache._write_index`` orders them)."""
    batch = slots.shape[0]
    base = (torch.arange(batch, device=slots.device)[:, None] * kv_heads
            + torch.arange(kv_heads, device=slots.device)[None]) * buffer  # [B, Hkv]
    return (base[:, :, None] + slots[:, None, :]).reshape(-1)


class SlotCache:
    """The cache object of a fixed-shape pass: each layer writes its keys and values at the slots of ``index``
    (``write_index``) of ``kv`` [L, 2, B, Hkv, S, D] and reads the whole buffer."""

    is_compileable = False

    def __init__(self, kv: torch.Tensor, index: torch.Tensor):
        self.kv, self.index = kv, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.kv[layer_idx]
        dim = layer.shape[-1]
        layer[0].view(-1, dim).index_copy_(0, self.index, key_states.reshape(-1, dim))
        layer[1].view(-1, dim).index_copy_(0, self.index, value_states.reshape(-1, dim))
        return layer[0], layer[1]

    # informational, as KVCache's: every pass brings its 4D mask and position ids
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv.shape[4], 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.kv.shape[4]

    def __len__(self) -> int:
        return self.kv.shape[0]


class FixedShapePass:
    """One shape's pass: static input buffers, the pass ``run(inputs, cache) -> (logits, hidden, layer hidden)``
    over them, and, with ``capture``, the CUDA graph of it (captured on the first call, replayed after)."""

    def __init__(self, run, inputs: FixedInputs, kv: torch.Tensor, capture: bool):
        self.run, self.inputs, self.kv = run, inputs, kv
        self.capture = capture
        self.graph = None
        self.outputs = None

    def _pass(self):
        index = write_index(self.inputs.slots, self.kv.shape[3], self.kv.shape[4])
        return self.run(self.inputs, SlotCache(self.kv, index))

    def __call__(self, inputs: FixedInputs):
        self.inputs.copy_(inputs)
        if not self.capture:
            return self._pass()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.outputs

    def _capture(self) -> None:
        """Warm up on a side stream (each warm-up pass writes the same keys and values the replay writes), then
        record one pass into the graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_PASSES):
                self._pass()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self._pass()
        self.graph = graph


class StaticPasses:
    """The fixed-shape passes of one target: ``run(inputs, cache) -> (logits [B, N, V], hidden [B, N, H], layer
    hidden)`` is the target's pass over ``FixedInputs``; ``capture`` (default: on CUDA) records each shape as a
    CUDA graph. Shapes are kept for the last ``CACHES_KEPT`` cache buffers (a graph holds its buffer's address)."""

    def __init__(self, run, capture: bool, buckets: tuple[int, ...] = BUCKETS):
        self.run, self.capture, self.buckets = run, capture, buckets
        self.passes: dict[tuple, FixedShapePass] = {}
        self.buffers: list[torch.Tensor] = []  # the cache buffers passes are kept for, most recent last

    def applies(self, input_ids: torch.Tensor, attention_mask, cache, backend: str, ragged: RaggedRows | None,
                logits_from: int) -> bool:
        """A verification pass (a mask, or one row) of rows a bucket holds (packed rows: their widest), whose padded
        rows fit in the cache, without gradients, on SDPA or the cascade (the same attention: a fixed-shape pass
        attends with SDPA over the whole buffer)."""
        rows = input_ids.shape[1] if ragged is None else ragged.width
        bucket = bucket_for(rows, self.buckets)
        return (isinstance(cache, KVCache) and bucket is not None and (attention_mask is not None or rows == 1)
                and backend in ("sdpa", "cascade") and (ragged is None or logits_from == 0)
                and not torch.is_grad_enabled() and cache.max_committed + bucket <= cache.max_length)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, attention_mask,
                logits_from: int, hidden_layers: tuple[int, ...], key_positions: torch.Tensor | None = None,
                ragged: RaggedRows | None = None):
        """(logits [B, T - logits_from, V], hidden [B, T, H], the inputs of ``hidden_layers``) of the ordinary
        pass over input_ids [B, T] (``Target.forward``'s arguments), through the fixed-shape pass of T's bucket;
        the keys and values land in ``cache`` where the ordinary pass puts them (uncommitted). Packed rows
        (``ragged``: input_ids [1, T']) run padded, their padding rows written past each row's tokens, and come
        back packed."""
        if ragged is not None:
            input_ids, position_ids = ragged.pad(input_ids, 1), ragged.positions
        rows = input_ids.shape[1]
        bucket = bucket_for(rows, self.buckets)
        kv = cache.kv
        inputs = fixed_inputs(input_ids, position_ids, attention_mask, cache.lengths, cache.max_committed, bucket,
                              kv.shape[4], key_positions)
        logits, hidden, layer_hidden = self._pass_for(kv, bucket, tuple(hidden_layers), inputs)(inputs)
        outputs = (logits[:, logits_from:rows], hidden[:, :rows], *(h[:, :rows] for h in layer_hidden))
        outputs = [output.clone() if ragged is None else ragged.pack(output) for output in outputs]
        return outputs[0], outputs[1], tuple(outputs[2:])

    def _pass_for(self, kv: torch.Tensor, bucket: int, hidden_layers: tuple[int, ...],
                  inputs: FixedInputs) -> FixedShapePass:
        if not any(buffer is kv for buffer in self.buffers):
            self.buffers = [*self.buffers, kv][-CACHES_KEPT:]
            kept = {id(buffer) for buffer in self.buffers}
            self.passes = {key: found for key, found in self.passes.items() if key[0] in kept}
        key = (id(kv), tuple(kv.shape), inputs.input_ids.shape[0], bucket, hidden_layers)
        if key not in self.passes:
            static = inputs.clone()

            def run(fixed: FixedInputs, cache: SlotCache, layers=hidden_layers):
                return self.run(fixed, cache, layers)

            self.passes[key] = FixedShapePass(run, static, kv, self.capture)
        return self.passes[key]
