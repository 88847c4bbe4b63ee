"""A lean decode pass for Llama-family targets: the same computation as the stock layers with the decode kernels, over
the model's own weights, without transformers' module calls around it.

A decode-sized pass multiplies a few rows by every weight once; on a CPU with the packed bf16 kernels those products
cost little more than reading the weights, and the rest of a stock pass (hundreds of module calls, thousands of small
tensor ops: rotary's halves, cache views, the Python of each layer) costs as much again
(``scripts/bench_verify_pass.py`` measures both). Here each layer is a few calls: the RMSNorm kernel, one packed
product for q, k and v together (their weights packed side by side once), rotary on q and k at once (rotate_half as a
roll of the halves with its sign folded into sin: the same values), the cache write (views shared by every layer of
the pass), the decode attention kernel, the output product, the RMSNorm kernel, one packed product for the gate and
up projections, SiLU and the down product.

Every product is the packed kernel's, which computes each output from its weight row alone, so packing q, k and v (or
gate and up) side by side gives the same values as separate products; the rest follows the stock bf16 expressions.
The lean pass applies where ``LeanLlama.applies`` says so: bf16 weights on CPU with the block-packed kernels (AMX tiles,
AVX512-BF16, or AVX2 FMAs where the CPU lacks AVX512-BF16), a plain Llama layer (no biases, Llama-formula norms,
default rotary, no sliding window or soft-capping), the ``sdpa`` backend, at most ``DECODE_KERNEL_MAX_ROWS`` rows per
sequence (a verification pass, not a prefill). Everything else takes the stock layers, which are what this pass is
tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.engine.kv_cache import KVCache
from runtime.engine.ragged import RaggedRows
from runtime.target import attention
from runtime.target.attention import DECODE_KERNEL_HEAD_SIZES, DECODE_KERNEL_MAX_ROWS
from runtime.target.decode_layers import LLAMA_FORMULA_NORMS, PackedWeights
from runtime.target.linear_plan import greedy_head_rows
from runtime.engine.sampling import greedy_tokens
from runtime.target.kernels import (INT8_ARGMAX_MAX_ROWS, INT8_KERNEL_MAX_ROWS, LEAN_FORMS, Int8Rows,
                                    decode_attention, int8_argmax, int8_candidates, lean_layers, lean_product,
                                    rms_norm_rows)

LEAN_FAMILIES = ("llama",)


def stack_weights(layers: list[dict]) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """Packed layers (``LeanLlama._packed_layers``' dicts) as ``lean_layers`` takes them: per layer the packed qkv, o,
    gate_up and down weights and the two norms' weights; the four products' sizes; the norms' epsilon."""
    names = ("qkv", "o", "gate_up", "down")
    return ([t for layer in layers for t in [layer[n][0] for n in names] + [layer["input_norm"], layer["post_norm"]]],
            [layer[n][1] for layer in layers for n in names], [layer["eps"] for layer in layers])


class LeanLlama:
    """The lean pass over ``model``'s weights (a Llama-family transformers causal LM; never changed), with the packed
    products of ``packed`` (its plan's form one of ``LEAN_FORMS``). ``compiled_layers``: where every row
    has the same cache length (a batch-1 step among them), run the layer stack in one compiled call
    (``runtime.target.kernels.lean_layers``: the same operations as ``_layer``, without a Python call per operation)
    where it builds; False keeps the Python loop (what the tests hold it to)."""

    def __init__(self, model, packed: PackedWeights, compiled_layers: bool = True):
        self.model, self.config = model, model.config
        config = self.config
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = self.head_dim ** -0.5
        self.intermediate = int(config.intermediate_size)
        self.form = packed.plan.form
        self.linear = lean_product(self.form)
        self.norm = rms_norm_rows()
        self.pack, self.arena = packed.pack, packed.arena
        self.layers = None  # packed on the first pass it takes: a target that never takes one pays nothing
        decoder = model.get_decoder()
        self.embed, self.rotary, self.final_norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.lm_head = model.get_output_embeddings().weight
        self.lm_head_packed = None
        self.lm_head_int8 = None  # the LM head's int8 copy for greedy passes, made on the first (``argmax``)
        # the most rows whose greedy LM head takes the int8 path: timed on this machine with the first greedy pass
        # (runtime.target.linear_plan.greedy_head_rows)
        self.int8_rows = 0
        self._stack_args = None
        self.stack = lean_layers(self.form) if compiled_layers else None

    @staticmethod
    def supports(model, packed: PackedWeights | None) -> bool:
        """Whether ``model`` is one the lean pass computes exactly as its stock layers: a plain Llama layer stack in
        bf16 on CPU, with the kernels of a lean form (``LEAN_FORMS``) and the decode attention kernel built here."""
        config = model.config
        if (packed is None or packed.plan.form not in LEAN_FORMS or config.model_type not in LEAN_FAMILIES
                or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
                or getattr(config, "sliding_window", None) or getattr(config, "final_logit_softcapping", None)
                or getattr(config, "hidden_act", "silu") != "silu"):
            return False
        weight = model.get_output_embeddings().weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            return False
        rope = getattr(config, "rope_parameters", None) or {}
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        norms = {type(layer.input_layernorm).__name__ for layer in model.get_decoder().layers}
        kernels = (lean_product(packed.plan.form), rms_norm_rows(), attention.decode_attention())
        return (rope.get("rope_type", "default") == "default" and head_dim in DECODE_KERNEL_HEAD_SIZES
                and norms <= set(LLAMA_FORMULA_NORMS) and all(kernel is not None for kernel in kernels))

    def applies(self, input_ids: torch.Tensor, attention_mask, backend: str, ragged: RaggedRows | None,
                key_positions) -> bool:
        """Whether this pass is one the lean pass takes: a verification pass (a mask, a few rows per sequence; one
        row without a mask sees every key) on the ``sdpa`` backend, without gradients."""
        rows = ragged.width if ragged is not None else input_ids.shape[1]
        return ((attention_mask is not None or rows == 1) and backend == "sdpa" and rows <= DECODE_KERNEL_MAX_ROWS
                and not torch.is_grad_enabled())

    def _packed_layers(self) -> list[dict]:
        """Each layer's weights as ``pack_layer`` keeps them."""
        return [self.pack_layer(layer) for layer in self.model.get_decoder().layers]

    def pack_layer(self, layer) -> dict:
        """A Llama-shaped decoder layer's weights as ``_layer`` reads them: q, k, v packed side by side, gate and up
        side by side, o and down, the norms' weights and epsilon (a draft head's layer too:
        ``runtime.proposers.lean_head``)."""
        attention_module, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attention_module.q_proj.weight, attention_module.k_proj.weight,
                         attention_module.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        return {"qkv": (self.pack(qkv), qkv.shape[0]), "gate_up": (self.pack(gate_up), gate_up.shape[0]),
                "o": (self.pack(attention_module.o_proj.weight), attention_module.o_proj.weight.shape[0]),
                "down": (self.pack(mlp.down_proj.weight), mlp.down_proj.weight.shape[0]),
                "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                "eps": float(layer.input_layernorm.variance_epsilon)}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] through the packed LM head."""
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        if rows.shape[0] == 0:  # a prefill that wants no logits here
            return hidden.new_zeros(*hidden.shape[:-1], self.lm_head.shape[0])
        return self.linear(rows, self._packed_head(), self.lm_head.shape[0], None).reshape(*hidden.shape[:-1], -1)

    def _packed_head(self) -> torch.Tensor:
        """The LM head's packed copy, made on first use."""
        if self.lm_head_packed is None:
            self.lm_head_packed = self.pack(self.lm_head)
        return self.lm_head_packed

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [...] long: the greedy token of each row, ``greedy_tokens(self.logits(hidden))``
        computed from the LM head's int8 copy and the few bf16 rows it cannot rule out where the CPU has
        AVX512-VNNI and the pass has at most the rows for which that was measured faster on this machine
        (``runtime.target.kernels.int8_argmax``, ``runtime.target.linear_plan.greedy_head_rows``), else from the
        logits."""
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        if int8_candidates() is None or not 1 <= rows.shape[0] <= INT8_KERNEL_MAX_ROWS:
            return greedy_tokens(self.logits(hidden))
        if self.lm_head_int8 is None:
            self.lm_head_int8 = Int8Rows(self.lm_head, arena=self.arena)
            self.int8_rows = greedy_head_rows(self.lm_head, self.lm_head_int8, self.linear, self._packed_head(),
                                              INT8_ARGMAX_MAX_ROWS)
        if rows.shape[0] > self.int8_rows:
            return greedy_tokens(self.logits(hidden))
        tokens = int8_argmax(rows, self.lm_head, self.lm_head_int8, self.linear, self._packed_head(),
                             max_rows=self.int8_rows)
        return tokens.reshape(hidden.shape[:-1])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, attention_mask,
                ragged: RaggedRows | None = None, hidden_layers: tuple[int, ...] = ()):
        """(final hidden [B, T, H] (packed: [1, T', H]), the inputs of ``hidden_layers``) of one pass, writing the
        pass's K/V into ``cache`` (uncommitted) as the stock pass does."""
        if self.layers is None:
            self.layers = self._packed_layers()
        batch, rows = input_ids.shape
        x = self.embed(input_ids).reshape(batch * rows, -1)
        cos, sin = self.rotation(self.rotary, x, position_ids)
        views = cache.pass_views(rows) if ragged is None else None
        wanted, kept = set(hidden_layers), {}
        # the attention module's choice, looked up per pass: the same kernel the stock layers' tree attention takes
        kernel = attention.decode_attention()
        # the compiled stack attends with its own build of the kernel: where the choice is another, the loop runs it
        if views is not None and self.stack is not None and kernel is decode_attention():
            order = sorted(wanted)
            x, *inputs = self.stack(x, *self._stack_weights(), cos, sin, views[0], views[1], attention_mask, batch,
                                    rows, self.heads, self.kv_heads, self.intermediate, self.scale, order, None)
            kept = dict(zip(order, inputs))
            hidden = self.norm(x, self.final_norm.weight, float(self.final_norm.variance_epsilon))
            return hidden.reshape(batch, rows, -1), tuple(kept[i] for i in hidden_layers)
        for index, layer in enumerate(self.layers):
            if index in wanted:
                kept[index] = x.reshape(batch, rows, -1)
            x = self._layer(x, layer, index, batch, rows, cos, sin, cache, views, attention_mask, ragged, kernel)
        hidden = self.norm(x, self.final_norm.weight, float(self.final_norm.variance_epsilon))
        return hidden.reshape(batch, rows, -1), tuple(kept[i] for i in hidden_layers)

    def rotation(self, rotary, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, 1, D] of ``rotary`` (a rotary embedding module) at position_ids [B, T] in x's dtype, sin
        with its first half negated: rotate_half(x) * sin == roll(x, D / 2) * that sin, exactly, one op instead of
        four."""
        batch, rows = position_ids.shape
        cos, sin = rotary(x, position_ids)  # [B, T, D]
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.reshape(batch, rows, 1, self.head_dim), sin.reshape(batch, rows, 1, self.head_dim)

    def _stack_weights(self) -> tuple[list[torch.Tensor], list[int], list[float]]:
        """The layers' packed weights, product sizes and norm epsilons as ``lean_layers`` takes them (built once)."""
        if self._stack_args is None:
            self._stack_args = stack_weights(self.layers)
        return self._stack_args

    def layer_through_stack(self, x: torch.Tensor, layer: dict, stack_args, batch: int, rows: int, cos, sin,
                            cache: KVCache, mask, attention_input: torch.Tensor | None = None) -> torch.Tensor:
        """``_layer`` for one layer whose cache is ``cache``'s only layer (a draft head's), through the compiled stack
        where it runs (``stack_args``: ``stack_weights([layer])``), else through the Python loop."""
        views = cache.pass_views(rows)
        kernel = attention.decode_attention()
        if views is not None and self.stack is not None and kernel is decode_attention():
            return self.stack(x, *stack_args, cos, sin, views[0], views[1], mask, batch, rows, self.heads,
                              self.kv_heads, self.intermediate, self.scale, [], attention_input)[0]
        return self._layer(x, layer, 0, batch, rows, cos, sin, cache, views, mask, None, kernel, attention_input)

    def head_norm(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """A per-head RMSNorm of heads [B, T, n, D] (Qwen3's q and k norms: the norm kernel over rows of D)."""
        return self.norm(heads.reshape(-1, heads.shape[-1]).contiguous(), weight, eps).view(heads.shape)

    def _layer(self, x, layer, index, batch, rows, cos, sin, cache, views, mask, ragged, kernel,
               attention_input: torch.Tensor | None = None):
        """One decoder layer over x [B * T, H]; ``attention_input`` [B * T, K], where given, is what q, k and v read
        instead of the input norm of x (an EAGLE-3 draft layer's concat of two norms), and a layer with ``q_norm``
        and ``k_norm`` (weight, eps) norms its q and k heads before rotary (a DFlash draft layer's; both:
        ``runtime.proposers.lean_head``)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        h = self.norm(x, layer["input_norm"], layer["eps"]) if attention_input is None else attention_input
        qkv = self.linear(h, *layer["qkv"], None).view(batch, rows, heads + 2 * kv_heads, dim)
        qk = qkv[:, :, : heads + kv_heads]
        if "q_norm" in layer:  # a Qwen3 layer's per-head norms of q and k (a DFlash draft layer)
            qk = torch.cat((self.head_norm(qk[:, :, :heads], *layer["q_norm"]),
                            self.head_norm(qk[:, :, heads:], *layer["k_norm"])), dim=2)
        qk = qk * cos + qk.roll(dim // 2, -1) * sin  # the stock rotary: x cos + rotate_half(x) sin, same dtype
        query = qk[:, :, :heads].transpose(1, 2)
        key, value = qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv_heads:].transpose(1, 2)
        if views is None:
            keys, values = cache.update(key, value, index)
        else:
            written, read = views[0][index], views[1][index]
            written[0].copy_(key)
            written[1].copy_(value)
            keys, values = read[0], read[1]
        # [B, T, H, D] ([1, T', H, D] packed): the layout the output product reads
        attended = kernel(query, keys, values, mask, self.scale, None if ragged is None else ragged.counts)
        x = x + self.linear(attended.reshape(batch * rows, heads * dim), *layer["o"], None)
        h = self.norm(x, layer["post_norm"], layer["eps"])
        gate_up = self.linear(h, *layer["gate_up"], None)
        act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate:]
        return x + self.linear(act, *layer["down"], None)
