"""DFlash: a block of tokens drafted in one pass of a few decoder layers conditioned on the target's features.

The context: the inputs of K target layers (``feature_layers``, our convention: hidden_states[i], the input of layer
i; DFlash's ids name the output of layer i - 1, so ours are theirs + 1) concatenated per token, fused by a bias-free
``fc`` (K*H -> H) and normed by ``hidden_norm``. Every draft layer projects the fused context with its own k/v
projections (k-norm, rotary at the context tokens' positions, no input norm) and puts those keys and values before
the block's own: the context is never a query, only keys and values (KV injection, ``context_kv``).

The block: B rows ``[last verified token, MASK x (B - 1)]`` at their absolute positions, attending bidirectionally to
each other and to every context token before the block (``block_hidden``). Row k's output, through ``norm`` and the
target's frozen LM head (restricted to a draft vocabulary where ``draft_vocab_size`` asks), is the draft of the token
at the block's position k: rows 1 .. B - 1 are the drafts.

The draft layers are transformers' Qwen3 decoder layers (pre-norm attention with per-head q/k norms, SwiGLU) shaped
like the target's layers, whatever the target's family, as the DFlash authors, SpecForge and SGLang build them. The
MASK rows' input is the head's own trained ``mask_embedding`` [H]: the default target has no mask token. Exports
name a token id for it (``export_mask_id``): the target's mask token where it has one, else its last vocabulary id,
whose embedding row the exported drafter replaces (llama.cpp: ``mask_embedding.pt`` for its converter, the GGUF's own
``token_embd``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead
from heads.common import FrozenProjection, cache_argument, draft_rope_parameters, output_vocab_size, softcap_logits
from heads.gguf import GGUFLayout, llama_values
from heads.layouts import SAFETENSORS, Layout, first_file, load_into, load_weights, mismatches, read_json, state_of

DFLASH_ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING = "mask_embedding.pt"  # {"mask_token_id": int, "embedding": [H]}: llama.cpp's converter reads it
# draft-layer tensors under llama.cpp's names (a DFlash draft's rotary is NeoX-style: no row permutation)
GGUF_LAYER_NAMES = {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
                    "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
                    "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
                    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
                    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
                    "mlp.down_proj.weight": "ffn_down"}


def dflash_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """DFlash's default target layer ids (the output of layer i) for ``count`` features: evenly spaced from layer 1
    to layer L - 3, or the middle layer for one feature (the authors', SpecForge's and SGLang's formula)."""
    if count == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]


def default_feature_layers(num_target_layers: int, count: int) -> list[int]:
    """Our feature layers (inputs of layers) for DFlash's default ids, clamped into the target's layers."""
    return [min(max(i + 1, 0), num_target_layers - 1) for i in dflash_layer_ids(num_target_layers, count)]


@dataclass
class DFlashConfig:
    """Architecture of a DFlash head."""

    num_layers: int = 1  # draft decoder layers
    block_size: int = 16  # B: the block's rows; B - 1 drafts per pass
    feature_layers: list[int] = field(default_factory=list)  # inputs of these target layers; []: DFlash's default
    num_features: int = 5  # K, where feature_layers is empty
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary
    mask_token_id: int = -1  # the target's own mask token, where it has one; -1: none (exports name the last id)

    def __post_init__(self):
        self.feature_layers = [int(i) for i in self.feature_layers]
        if self.feature_layers:
            self.num_features = len(self.feature_layers)
        for name, least in (("num_layers", 1), ("block_size", 2), ("num_features", 1), ("draft_vocab_size", 0),
                            ("mask_token_id", -1)):
            if int(getattr(self, name)) < least:
                raise ValueError(f"DFlash {name} must be >= {least}, got {getattr(self, name)}")


def dflash_layer_config(target_config, num_layers: int):
    """A ``Qwen3Config`` for the draft layers, shaped like the target's layers (SpecForge's default draft config)."""
    from transformers import Qwen3Config

    heads = int(target_config.num_attention_heads)
    hidden = int(target_config.hidden_size)
    config = Qwen3Config(
        hidden_size=hidden, intermediate_size=int(target_config.intermediate_size), num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads), hidden_act="silu",
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 2048)),
        rope_parameters=draft_rope_parameters(target_config), attention_bias=False, use_sliding_window=False,
        vocab_size=output_vocab_size(target_config), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"  # takes the 4D boolean block masks
    return config


def rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary of states [B, heads, T, D] by cos/sin [B, T, D] (what the draft layers apply to their own keys)."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    return states * cos[:, None] + rotate_half(states) * sin[:, None]


class ContextKV:
    """The cache object of a training pass: each layer's ``update`` returns the context's keys and values [B, Hkv, S,
    D] before the block's own (nothing is kept between passes)."""

    is_compileable = False

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.kv[layer_idx]
        return torch.cat((keys, key_states), dim=2), torch.cat((values, value_states), dim=2)


class DFlashHead(DraftHead):
    head_type = "dflash"
    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig, target_config):
        super().__init__(config, target_config)
        num_layers = int(target_config.num_hidden_layers)
        if not config.feature_layers:
            config = replace(config, feature_layers=default_feature_layers(num_layers, config.num_features))
            self.config = config
        bad = [i for i in config.feature_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"DFlash feature layers {bad} are outside the target's layers 0..{num_layers - 1}")
        vocab = output_vocab_size(target_config)
        if config.draft_vocab_size > vocab or config.mask_token_id >= vocab:
            raise ValueError(f"DFlash draft_vocab_size={config.draft_vocab_size} / mask_token_id="
                             f"{config.mask_token_id} do not fit the target's vocabulary of {vocab}")
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

        self.layer_config = dflash_layer_config(target_config, config.num_layers)
        hidden, eps = self.hidden_size, self.layer_config.rms_norm_eps
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(self.layer_config, i) for i in range(config.num_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=eps)
        self.rotary = Qwen3RotaryEmbedding(self.layer_config)
        # a module, not a bare parameter: ZeRO-3 gathers a module's weights when it is called
        self.mask_embedding = nn.Embedding(1, hidden)
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("target_lm_head_weight", torch.empty(0), persistent=False)
        self.lm_head = FrozenProjection()  # the target's LM head rows of the draft vocabulary
        draft_vocab = config.draft_vocab_size or vocab
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.full((vocab,), draft_vocab == vocab))

    @property
    def feature_layers(self) -> list[int]:
        return list(self.config.feature_layers)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def cache_layers(self) -> int:
        return self.config.num_layers

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.shape[0]

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """LongTensor [V'] of target ids for draft ids; None when draft ids are target ids."""
        if self.draft_vocab_size == self.target_vocab_size:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @property
    def export_mask_id(self) -> int:
        """The token id exports give the MASK rows (their drafters' embedding row of it is the head's)."""
        return self.config.mask_token_id if self.config.mask_token_id >= 0 else self.target_vocab_size - 1

    # ----- the target's frozen weights and the draft vocabulary

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        """Point the frozen buffers at the target's embedding and LM head (its draft-vocabulary rows)."""
        if embed_weight.shape[1] != self.hidden_size or lm_head_weight is None:
            raise ValueError(f"a DFlash head needs the target's embedding and LM head of width {self.hidden_size}")
        self.embed_weight = embed_weight.detach()
        self.target_lm_head_weight = lm_head_weight.detach()
        self._select_lm_head_rows()

    def _select_lm_head_rows(self) -> None:
        weight = self.target_lm_head_weight
        if weight.numel():
            ids = self.draft_to_target
            self.lm_head.weight = weight if ids is None else weight[ids.to(weight.device)]

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"draft vocab maps have shapes {tuple(d2t.shape)}/{tuple(t2d.shape)}, the head expects "
                             f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self._select_lm_head_rows()

    def init_mask_embedding(self) -> None:
        """Start the mask embedding as the target's row of its mask token, where it has one, else as the mean of
        the target's embedding rows."""
        with torch.no_grad():
            weight = self.embed_weight
            row = weight[self.config.mask_token_id] if self.config.mask_token_id >= 0 else weight.float().mean(0)
            self.mask_embedding.weight[0] = row.to(self.mask_embedding.weight.dtype)

    def mask_row(self) -> torch.Tensor:
        """The mask embedding [H], on the CPU."""
        return self.mask_embedding.weight.detach()[0].cpu()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._select_lm_head_rows()  # a loaded d2t names other rows

    # ----- the computation

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, K*H] (the feature layers' inputs, concatenated in their order) -> context [B, T, H]."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(f"DFlash features must be K*H={self.fc.in_features} wide, got {features.shape[-1]}")
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context [B, T, H] at position_ids [B, T] -> each layer's (keys, values) [B, Hkv, T, D]: its own k/v
        projections of the context, keys k-normed and rotated at the context's positions (no input norm)."""
        cos, sin = self.rotary(context, position_ids)
        shape = (*context.shape[:2], -1, self.layer_config.head_dim)
        kv = []
        for layer in self.layers:
            attention = layer.self_attn
            keys = attention.k_norm(attention.k_proj(context).view(shape)).transpose(1, 2)
            values = attention.v_proj(context).view(shape).transpose(1, 2)
            kv.append((rotate(keys, cos, sin), values))
        return kv

    def block_embeddings(self, first_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """first_ids [B, N] (each block's first token) -> the inputs of N blocks [B, N * block_size, H]: the token's
        embedding, then the mask embedding B - 1 times."""
        if self.embed_weight.numel() == 0:
            raise RuntimeError("this DFlash head has no target embedding attached; load it with load_head(dir, "
                               "target_model) or call attach_target_weights(...)")
        batch, blocks = first_ids.shape
        first = F.embedding(first_ids, self.embed_weight).to(dtype)[:, :, None]
        mask = self.mask_embedding(torch.zeros(1, dtype=torch.long, device=first_ids.device))[0].to(dtype)
        masks = mask.expand(batch, blocks, self.block_size - 1, -1)
        return torch.cat((first, masks), dim=2).reshape(batch, blocks * self.block_size, -1)

    def block_hidden(self, embeddings: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                     cache, **attention_kwargs) -> torch.Tensor:
        """embeddings [B, Q, H] of block rows at position_ids [B, Q] -> normed hidden [B, Q, H]. ``cache``'s
        ``update`` puts the context's keys and values before the rows' own (``ContextKV``, or the runtime's cache
        holding them); attention_mask [B, 1, Q, S + Q] bool (True = attend) over [context ; rows]."""
        hidden = embeddings.to(self.fc.weight.dtype)
        position_embeddings = self.rotary(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                           position_embeddings=position_embeddings, **cache_argument(layer, cache),
                           **attention_kwargs)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V'] over the draft vocabulary (the target's LM head rows)."""
        if not self.lm_head.attached:
            raise RuntimeError("this DFlash head has no target LM head attached; load it with load_head(dir, "
                               "target_model)")
        return softcap_logits(self.lm_head(hidden), self.softcap)

    # ----- export (heads/formats.py dispatches here)

    @classmethod
    def export_refusal(cls, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
        if fmt == "reference":
            return ("the DFlash authors' code loads the same checkpoint layout as SGLang (with their dflash.py, "
                    "which is theirs to ship): export with --format sglang")
        if head_config.get("draft_vocab_size"):
            return (f"this DFlash head drafts over a draft vocabulary of {head_config['draft_vocab_size']} tokens, and "
                    f"SGLang's and vLLM's DFlash drafters take the target's whole vocabulary; export it for llama.cpp "
                    f"(--format gguf, which carries the vocabulary map), or train with head.draft_vocab_size=0")
        return None

    @classmethod
    def gguf_refusal(cls) -> str | None:
        return None

    def gguf_draft_max(self) -> int:
        """A block's drafts: llama.cpp caps ``--spec-draft-n-max`` there."""
        return self.block_size - 1

    def export_files(self, fmt: str, base_model: str | None = None) -> dict:
        """The DFlash checkpoint layout (SGLang, vLLM, llama.cpp's converter): ``config.json`` (a Qwen3 config with
        ``architectures: [DFlashDraftModel]``, ``block_size``, ``num_target_layers`` and ``dflash_config``:
        ``mask_token_id``, ``target_layer_ids`` in DFlash's convention, ours - 1) and ``model.safetensors`` (``fc``,
        ``hidden_norm``, ``layers.N.*``, ``norm``; no embedding, no LM head), and ``mask_embedding.pt``, the head's
        mask embedding for its mask id, which llama.cpp's converter writes into the draft's embedding row (SGLang
        embeds the mask rows with the target's row of the id)."""
        config = self.layer_config.to_dict()
        for key in ("_name_or_path", "transformers_version", "output_attentions", "output_hidden_states",
                    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
                    "is_encoder_decoder", "dtype", "use_cache"):
            config.pop(key, None)
        rope = draft_rope_parameters(self.target_config)
        layer_ids = [i - 1 for i in self.feature_layers]
        config.update(architectures=[DFLASH_ARCHITECTURE], model_type="qwen3", rope_theta=float(rope["rope_theta"]),
                      block_size=self.block_size, num_target_layers=int(self.target_config.num_hidden_layers),
                      dflash_config={"mask_token_id": self.export_mask_id, "target_layer_ids": layer_ids,
                                     "block_size": self.block_size})
        state = {name: tensor for name, tensor in state_of(self).items()
                 if name not in ("mask_embedding.weight", "d2t", "t2d")}
        mask = {"mask_token_id": self.export_mask_id, "embedding": self.mask_row().float().clone()}
        return {"config.json": config, SAFETENSORS: state, MASK_EMBEDDING: mask}

    def gguf_layout(self) -> GGUFLayout:
        """llama.cpp's ``dflash`` draft: ``fc``, ``enc.output_norm`` (hidden_norm), Qwen3-style blocks, ``output_norm``,
        its own ``token_embd`` (the target's with the mask id's row replaced by the head's mask embedding) and
        ``output`` (the draft vocabulary's rows, with ``d2t`` as absolute target ids where it is reduced).
        ``dflash.target_layers`` are our feature layers as they are: llama.cpp taps each layer's input, as we do."""
        target = self.target_config
        values = llama_values("dflash", self.layer_config, self.config.num_layers, self.hidden_size,
                              int(getattr(target, "max_position_embeddings", 2048)))
        values.update({"dflash.target_layers": (self.feature_layers, "i32s"),
                       "dflash.block_size": (self.block_size, "u32"),
                       "tokenizer.ggml.mask_token_id": (self.export_mask_id, "u32")})
        state = state_of(self)
        embed = self.embed_weight.detach().cpu().clone()
        embed[self.export_mask_id] = self.mask_row().to(embed.dtype)
        tensors = {"token_embd.weight": embed, "fc.weight": state["fc.weight"],
                   "enc.output_norm.weight": state["hidden_norm.weight"]}
        for index in range(self.config.num_layers):
            for name, ggml in GGUF_LAYER_NAMES.items():
                tensors[f"blk.{index}.{ggml}.weight"] = state[f"layers.{index}.{name}"]
        tensors.update({"output_norm.weight": state["norm.weight"],
                        "output.weight": self.lm_head.weight.detach().cpu().contiguous()})
        if self.draft_to_target is not None:
            tensors["d2t"] = self.draft_to_target.cpu()
        return GGUFLayout("dflash", values, tensors)


# ----- published layouts import reads (heads/formats.py: load_any_head)

def _import_dflash(directory: Path, config: dict, target_config) -> DFlashHead:
    """The DFlash checkpoint layout (the authors' published drafters, SpecForge's, our exports) as our head: its
    target layer ids + 1, its block size and mask id, and ``mask_embedding.pt`` where it ships one (else the
    target's row of the mask id is the mask embedding, as the authors' code and SGLang embed it)."""
    dflash = config.get("dflash_config") or {}
    layers = config.get("num_target_layers")
    problems = mismatches([
        ("hidden_size", config.get("hidden_size"), int(target_config.hidden_size)),
        ("num_target_layers", layers, int(target_config.num_hidden_layers)),
        ("vocab_size", config.get("vocab_size"), output_vocab_size(target_config))])
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    count = int(config.get("num_hidden_layers", 1))
    ids = [int(i) for i in ids] if ids else dflash_layer_ids(int(target_config.num_hidden_layers), count)
    unsupported = [key for key in ("conv_kernel_size", "selector_rank", "use_swa", "input_embedding_scale",
                                   "output_multiplier", "final_logit_softcapping", "is_causal") if
                   dflash.get(key) is not None or config.get(key) is not None]
    if config.get("use_sliding_window"):
        unsupported.append("use_sliding_window")
    if unsupported:
        problems.append(f"options {unsupported} (DFlash2, sliding windows and scaled inputs or outputs are not "
                        f"implemented here)")
    mask_id = dflash.get("mask_token_id")
    if mask_id is None:
        problems.append("no dflash_config.mask_token_id (the authors' code needs it too)")
    if problems:
        raise ValueError(f"the DFlash head at {directory} does not fit this target: " + "; ".join(problems))
    block = int(dflash.get("block_size", config.get("block_size", 16)))
    head = DFlashHead(DFlashConfig(num_layers=count, block_size=block, feature_layers=[i + 1 for i in ids],
                                   mask_token_id=int(mask_id)), target_config)
    weights = first_file(directory, (SAFETENSORS,))
    state = load_weights(weights)
    for key in ("embed_tokens.weight", "lm_head.weight"):  # the target's own, where a checkpoint carries a copy
        state.pop(key, None)
    mask_path = directory / MASK_EMBEDDING
    mask = None
    if mask_path.is_file():
        mask = torch.load(mask_path, map_location="cpu", weights_only=True)
        if not isinstance(mask, dict) or mask.get("mask_token_id") != int(mask_id) or tuple(
                getattr(mask.get("embedding"), "shape", ())) != (head.hidden_size,):
            raise ValueError(f"{mask_path} is not {{'mask_token_id': {mask_id}, 'embedding': [{head.hidden_size}]}}")
    state["mask_embedding.weight"] = (mask["embedding"] if mask else torch.zeros(head.hidden_size))[None]
    state.update(d2t=head.d2t.clone(), t2d=head.t2d.clone())
    load_into(head, state, weights, "DFlash")
    head.imported_mask = mask is not None
    return head


def _import(directory: Path, config: dict, target) -> DFlashHead:
    head = _import_dflash(directory, config, getattr(target, "config", target))
    if isinstance(target, nn.Module) and not head.imported_mask:
        head.attach_target_weights(*_frozen(target))
        head.init_mask_embedding()  # the target's row of the mask id, as the authors' code embeds the mask rows
    return head


def _frozen(target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()


def _is_dflash(directory: Path, config: dict | None) -> bool:
    architectures = (config or {}).get("architectures") or []
    return DFLASH_ARCHITECTURE in architectures and (directory / SAFETENSORS).is_file()


LAYOUTS = (
    Layout("dflash", "dflash", f"DFlash (the authors' drafters, SpecForge, our exports): config.json with "
           f"architectures [{DFLASH_ARCHITECTURE}] + {SAFETENSORS} (+ {MASK_EMBEDDING})", 20, _is_dflash,
           lambda directory, config, target: _import(directory, read_json(directory / "config.json"), target)),
)
