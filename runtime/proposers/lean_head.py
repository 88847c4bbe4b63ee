"""EAGLE-3 drafting through the lean pass's layer: the head's one decoder layer and its LM head as the target's lean
pass computes a layer (``runtime.target.lean``), without transformers' module calls around them.

An EAGLE-3 head is one Llama layer, shaped like the target's, whose attention reads concat(norm(embed), norm(hidden))
and whose residual is the fused feature; a dynamic tree asks it for a few rows at a time, three or four times a step.
Through the stock modules each of those calls costs more in Python around the products than the products take, and
on a CPU drafting grew to a quarter of a step (``scripts/benchmark.py`` reports each method's draft share). Here
the layer is the lean pass's ``_layer`` given the concat as its attention input, every product the packed kernel over
copies packed once, the norms the norm kernel, attention the decode attention kernel: the stock head's operations in
the same order and dtypes, so its outputs are the stock head's wherever the head's own products are the packed
kernel's (``tests/test_lean_head.py``), and close to them elsewhere. Drafts never change the output, only how much of
it a pass accepts.
"""

from __future__ import annotations

import torch

from runtime.engine.kv_cache import KVCache
from runtime.target import attention
from runtime.target.decode_layers import LLAMA_FORMULA_NORMS
from runtime.target.lean import LeanLlama


class LeanEagle3:
    """``head`` (a ``heads.eagle3.Eagle3Head`` on the target's device and dtype) drafting through ``lean``, the
    target's lean pass. Its weights are packed once, here: a head whose weights change afterwards drafts from the
    copies (the runtime's heads are loaded for inference and never change)."""

    def __init__(self, head, lean: LeanLlama):
        self.head, self.lean = head, lean
        layer, hidden = head.midlayer, head.hidden_size
        attention_module, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attention_module.q_proj.weight, attention_module.k_proj.weight,
                         attention_module.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.layer = {"qkv": (lean.pack(qkv), qkv.shape[0]), "gate_up": (lean.pack(gate_up), gate_up.shape[0]),
                      "o": (lean.pack(attention_module.o_proj.weight), hidden),
                      "down": (lean.pack(mlp.down_proj.weight), hidden),
                      "input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                      "eps": float(layer.input_layernorm.variance_epsilon)}
        self.hidden_norm = (layer.hidden_norm.weight, float(layer.hidden_norm.variance_epsilon))
        self.final_norm = (head.norm.weight, float(head.norm.variance_epsilon))
        self.fc = (lean.pack(head.fc.weight), hidden)
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
        linears = (head.fc, head.lm_head, attention_module.q_proj, attention_module.k_proj, attention_module.v_proj,
                   attention_module.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm)
        config = head.layer_config
        return (all(linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"
                    and linear.bias is None for linear in linears)
                # the runtime's heads run decode norms: subclasses of the stock norm classes
                and all(any(cls.__name__ in LLAMA_FORMULA_NORMS for cls in type(norm).__mro__) for norm in norms)
                and getattr(config, "hidden_act", "silu") == "silu"
                and attention_module.q_proj.out_features == lean.heads * lean.head_dim
                and attention_module.k_proj.out_features == lean.kv_heads * lean.head_dim
                and mlp.gate_proj.out_features == lean.intermediate
                and float(getattr(attention_module, "scaling", lean.scale)) == lean.scale
                and (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default") == "default")

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
        views = cache.pass_views(rows)
        x = lean._layer(x, self.layer, 0, batch, rows, cos, sin, cache, views, attention_mask, None,
                        attention.decode_attention(), attention_input)
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
