"""Draft heads through the lean pass's kernels (``runtime.target.lean``), without transformers' module calls around
them: EAGLE-3's one decoder layer and LM head (``LeanEagle3``), DFlash's context projection, draft layers and LM head
rows (``LeanDFlash``).

An EAGLE-3 head is one Llama layer, shaped like the target's, whose attention reads concat(norm(embed), norm(hidden))
and whose residual is the fused feature; a dynamic tree asks it for a few rows at a time, three or four times a step.
A DFlash head projects each verified row's features into its layers' keys and values and runs a block of rows
through a layer or two. Through the stock modules each of those calls costs more in Python around the products than
the products take, and on a CPU drafting grew to a quarter of a step (``scripts/benchmark.py`` reports each method's
draft share). Here every product is the packed kernel over copies packed once, the norms the norm kernel, attention
the decode attention kernel, EAGLE-3's layer the lean pass's own given the concat as its attention input (in its
compiled stack where that runs): the stock heads' operations in the same order and dtypes, so the outputs are the
stock heads' wherever their own products are the packed kernel's (``tests/test_lean_head.py``), and close to them
elsewhere. Drafts never change the output, only how much of it a pass accepts.
"""

from __future__ import annotations

import torch

from runtime.engine.kv_cache import KVCache
from runtime.target import attention
from runtime.target.decode_layers import LLAMA_FORMULA_NORMS
from runtime.target.lean import LeanLlama, stack_weights


def layer_linears(layer) -> list:
    """A Llama-shaped decoder layer's seven linear layers."""
    attention_module, mlp = layer.self_attn, layer.mlp
    return [attention_module.q_proj, attention_module.k_proj, attention_module.v_proj, attention_module.o_proj,
            mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def plain_layers(linears, norms, config) -> bool:
    """Whether a head's ``linears`` (modules with ``weight``, and ``bias`` where they have one) and ``norms`` are what
    the lean kernels compute as the stock modules do: bf16 weights on CPU without biases, Llama-formula norms (the
    runtime's heads run the decode norms: subclasses of the stock classes), and its layer ``config`` SiLU with the
    default rotary."""
    return (all(linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"
                and getattr(linear, "bias", None) is None for linear in linears)
            and all(any(cls.__name__ in LLAMA_FORMULA_NORMS for cls in type(norm).__mro__) for norm in norms)
            and getattr(config, "hidden_act", "silu") == "silu"
            and (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default") == "default")


class LeanEagle3:
    """``head`` (a ``heads.eagle3.Eagle3Head`` on the target's device and dtype) drafting through ``lean``, the
    target's lean pass. Its weights are packed once, here: a head whose weights change afterwards drafts from the
    copies (the runtime's heads are loaded for inference and never change)."""

    def __init__(self, head, lean: LeanLlama):
        self.head, self.lean = head, lean
        layer = head.midlayer
        self.layer = lean.pack_layer(layer)  # q, k and v read 2H: the concat of the two norms
        self.hidden_norm = (layer.hidden_norm.weight, float(layer.hidden_norm.variance_epsilon))
        self.final_norm = (head.norm.weight, float(head.norm.variance_epsilon))
        self.stack_args = stack_weights([self.layer])
        self.fc = (lean.pack(head.fc.weight), head.hidden_size)
        self.lm_head = (lean.pack(head.lm_head.weight), head.lm_head.out_features)

    @staticmethod
    def supports(head, lean: LeanLlama | None) -> bool:
        """Whether ``head`` drafts through ``lean`` exactly as through its modules: an EAGLE-3 head in bf16 on CPU
        whose layer has the lean pass's shapes (heads, KV heads, head size, MLP width), no biases, Llama-formula norms
        and SiLU."""
        if lean is None or getattr(head, "head_type", None) != "eagle3":
            return False
        layer = head.midlayer
        attention_module, mlp = layer.self_attn, layer.mlp
        return (plain_layers([head.fc, head.lm_head, *layer_linears(layer)],
                             [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm],
                             head.layer_config)
                and attention_module.q_proj.out_features == lean.heads * lean.head_dim
                and attention_module.k_proj.out_features == lean.kv_heads * lean.head_dim
                and mlp.gate_proj.out_features == lean.intermediate
                and float(getattr(attention_module, "scaling", lean.scale)) == lean.scale)

    def hidden_states(self, input_ids: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``heads.eagle3.Eagle3Head.hidden_states``: input_ids [B, T], features [B, T, 3H] (fused target layers) or
        [B, T, H] (the head's own hidden), position_ids [B, T], attention_mask [B, 1, T, S] bool; writes the rows'
        K/V into ``cache`` (uncommitted) -> hidden [B, T, H]."""
        lean, hidden_size = self.lean, self.head.hidden_size
        batch, rows = input_ids.shape
        x = features.reshape(batch * rows, -1).contiguous()
        if x.shape[-1] == 3 * hidden_size:
            x = lean.linear(x, *self.fc, None)
        elif x.shape[-1] != hidden_size:
            raise ValueError(f"EAGLE-3 features must be 3H={3 * hidden_size} (fused target layers) or H={hidden_size} "
                             f"(the head's own hidden), got {x.shape[-1]}")
        embeds = self.head.embed(input_ids, x.dtype).reshape(batch * rows, -1)
        attention_input = torch.cat((lean.norm(embeds, self.layer["input_norm"], self.layer["eps"]),
                                     lean.norm(x, *self.hidden_norm)), dim=-1)
        cos, sin = lean.rotation(self.head.rotary, x, position_ids)
        x = lean.layer_through_stack(x, self.layer, self.stack_args, batch, rows, cos, sin, cache, attention_mask,
                                     attention_input)
        return x.reshape(batch, rows, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> the head's logits [..., V'] over its draft vocabulary."""
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        normed = self.lean.norm(rows, *self.final_norm)
        return self.lean.linear(normed, *self.lm_head, None).reshape(*hidden.shape[:-1], -1)

    def __call__(self, input_ids, features, position_ids, attention_mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, logits) as the head's ``forward``."""
        hidden = self.hidden_states(input_ids, features, position_ids, attention_mask, cache)
        return hidden, self.logits(hidden)


class LeanDFlash:
    """``head`` (a ``heads.dflash.DFlashHead`` on the target's device and dtype) drafting through ``lean``'s kernels:
    its context projection, its Qwen3 draft layers (q/k norms per head, the block's bidirectional attention over the
    context's keys) and its LM head rows, each product the packed kernel over copies packed once, in the stock layers'
    order and dtypes. Its weights are packed here: a head whose weights change afterwards drafts from the copies."""

    def __init__(self, head, lean: LeanLlama):
        self.head, self.lean = head, lean
        self.layers = []
        for layer in head.layers:
            attention_module = layer.self_attn
            kv = torch.cat([attention_module.k_proj.weight, attention_module.v_proj.weight])
            # the lean layer, with the q/k norms it applies where present and k, v alone for the context
            self.layers.append({
                **lean.pack_layer(layer), "kv": (lean.pack(kv), kv.shape[0]),
                "q_norm": (attention_module.q_norm.weight, float(attention_module.q_norm.variance_epsilon)),
                "k_norm": (attention_module.k_norm.weight, float(attention_module.k_norm.variance_epsilon))})
        self.fc = (lean.pack(head.fc.weight), head.hidden_size)
        self.hidden_norm = (head.hidden_norm.weight, float(head.hidden_norm.variance_epsilon))
        self.final_norm = (head.norm.weight, float(head.norm.variance_epsilon))
        self.lm_head = (lean.pack(head.lm_head.weight), head.lm_head.weight.shape[0])

    @staticmethod
    def supports(head, lean: LeanLlama | None) -> bool:
        """Whether ``head`` drafts through ``lean``'s kernels exactly as through its modules: a DFlash head in bf16 on
        CPU whose layers have the lean pass's shapes, no biases, Qwen3 norms, SiLU, default rotary, no soft-capping."""
        if (lean is None or getattr(head, "head_type", None) != "dflash" or getattr(head, "softcap", None)
                or not head.lm_head.attached):  # the target's LM head rows, which a loaded head has
            return False
        config = head.layer_config
        linears = [head.fc, head.lm_head] + [linear for layer in head.layers for linear in layer_linears(layer)]
        norms = [head.hidden_norm, head.norm] + [norm for layer in head.layers for norm in (
            layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)]
        return (plain_layers(linears, norms, config)
                and int(config.num_attention_heads) == lean.heads and int(config.num_key_value_heads) == lean.kv_heads
                and int(config.head_dim) == lean.head_dim and int(config.intermediate_size) == lean.intermediate)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """``heads.dflash.DFlashHead.context``: features [B, T, K*H] -> context [B, T, H]."""
        rows = features.reshape(-1, features.shape[-1]).to(self.fc[0].dtype).contiguous()
        fused = self.lean.linear(rows, *self.fc, None)
        return self.lean.norm(fused, *self.hidden_norm).reshape(*features.shape[:-1], -1)

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``heads.dflash.DFlashHead.context_kv``: each layer's (keys, values) [B, Hkv, T, D] of context [B, T, H]."""
        lean = self.lean
        batch, rows = context.shape[:2]
        cos, sin = lean.rotation(self.head.rotary, context, position_ids)
        flat = context.reshape(batch * rows, -1).contiguous()
        kv = []
        for layer in self.layers:
            both = lean.linear(flat, *layer["kv"], None).view(batch, rows, 2 * lean.kv_heads, lean.head_dim)
            keys = lean.head_norm(both[:, :, :lean.kv_heads], *layer["k_norm"])
            keys = keys * cos + keys.roll(lean.head_dim // 2, -1) * sin
            kv.append((keys.transpose(1, 2), both[:, :, lean.kv_heads:].transpose(1, 2)))
        return kv

    def block_hidden(self, embeddings: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                     cache: KVCache) -> torch.Tensor:
        """``heads.dflash.DFlashHead.block_hidden``: embeddings [B, Q, H] of block rows at position_ids [B, Q], their
        keys and values written into ``cache`` (uncommitted) after its context -> normed hidden [B, Q, H]."""
        lean = self.lean
        batch, rows = embeddings.shape[:2]
        x = embeddings.reshape(batch * rows, -1).to(self.fc[0].dtype).contiguous()
        cos, sin = lean.rotation(self.head.rotary, x, position_ids)
        views = cache.pass_views(rows)
        kernel = attention.decode_attention()
        for index, layer in enumerate(self.layers):
            x = lean._layer(x, layer, index, batch, rows, cos, sin, cache, views, attention_mask, None, kernel)
        return lean.norm(x, *self.final_norm).reshape(batch, rows, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (normed) -> logits [..., V'] over the draft vocabulary."""
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        return self.lean.linear(rows, *self.lm_head, None).reshape(*hidden.shape[:-1], -1)
