"""The target model: loading (HF id, local dir, .gguf, alias) and one forward with a 4D mask and a cache.

The stock transformers model is used unchanged, and stays unchanged outside the runtime's own passes: inside
``Target.forward`` it attends through the tree backends of ``runtime.target.attention`` and runs the decode layers of
``runtime.target.decode_layers``; outside, it is the model as loaded or as handed over. Differences between
architectures are data read from the config (final logit soft-capping, tied embeddings).
"""

from __future__ import annotations

import hashlib
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from heads.common import cache_argument, softcap_logits
from runtime.target import attention
from runtime.target.assets import SMOLLM2_GGUF, cache_dir, packaged_file
from runtime.target.decode_layers import DecodeLayers
from runtime.target.lean import LeanLlama
from runtime.target.static_pass import StaticPasses
from runtime.engine.kv_cache import KVCache
from runtime.engine.ragged import RaggedRows
from runtime.engine.sampling import greedy_tokens

DEFAULT_TARGET = "smollm2-135m"
ALIASES = {"smollm2-135m": SMOLLM2_GGUF, "smollm2-135m-instruct": SMOLLM2_GGUF}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# families whose sliding window reaches attention only through transformers' own per-layer masks (the attention
# call never receives it), which a runtime's own tree mask replaces
MASK_ONLY_WINDOWS = ("qwen2_moe", "phimoe")


def unsupported_attention(model) -> str | None:
    """What in ``model``'s attention the runtime's attention function would not apply (a description), or None:
    attention sinks (learnt per-head logits, GPT-OSS), chunked attention (Llama-4) and windows that only
    transformers' masks apply (``MASK_ONLY_WINDOWS``)."""
    if any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules()):
        return "has sinks (learnt per-head logits beside the keys, as in GPT-OSS)"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        return f"attends in chunks of {chunk} tokens (attention_chunk_size) through transformers' own masks"
    window = getattr(config, "sliding_window", None)
    active = getattr(config, "use_sliding_window", True)
    limit = getattr(config, "max_position_embeddings", None)
    if config.model_type in MASK_ONLY_WINDOWS and window and active and (limit is None or window < limit):
        return (f"has a sliding window of {window} tokens that {config.model_type} applies only through "
                f"transformers' own masks")
    return None


RESCALING_ROPE = ("dynamic", "longrope")  # frequencies chosen from the longest position of the pass


def rescaling_rope_context(config) -> int | None:
    """The original context of a rotary embedding whose frequencies depend on the longest position in a pass
    (``RESCALING_ROPE``), or None for any other."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    groups = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for group in groups:
        if isinstance(group, dict) and group.get("rope_type", group.get("type")) in RESCALING_ROPE:
            original = group.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
            return int(original) if original else None
    return None


@dataclass
class TargetOutput:
    """logits [B, T', V] (T' = positions asked for; None where a pass asked only for their argmax and computed just
    that); hidden [B, T, H]: last layer after the final norm; layer_hidden: the inputs of the requested decoder
    layers, each [B, T, H] (EAGLE-3 fusion); argmax [B, T'] long: where asked for, the greedy token at each position
    (the first largest logit, as ``runtime.engine.sampling.greedy_tokens`` takes it)."""

    logits: torch.Tensor | None
    hidden: torch.Tensor
    layer_hidden: tuple[torch.Tensor, ...] = ()
    argmax: torch.Tensor | None = None


class Target:
    """A frozen causal LM plus its tokenizer. ``identity`` names the weights (checked by heads).

    The model is never changed: the tree attention (``runtime.target.attention``) and, with ``decode_kernels``, the
    decode layers (``runtime.target.decode_layers``: faster few-row products and compiled bf16 kernels on CPU, same
    results) are switched on only for the duration of ``forward``. The model must be in eval mode.
    ``fixed_shapes``: verification passes run at fixed shapes (``runtime.target.static_pass``), captured as CUDA
    graphs on a GPU; on a CPU they run eagerly (the CPU twin of the graphed path, slower than the ordinary pass).
    """

    def __init__(self, model, tokenizer, identity: str, decode_kernels: bool = True, fixed_shapes: bool = False):
        if model.training:
            raise ValueError("the target model is in training mode (dropout would change its outputs); call "
                             "model.eval() before handing it to Target")
        problem = unsupported_attention(model)
        if problem:
            raise ValueError(f"the target's attention {problem}, which this runtime's tree attention does not "
                             f"apply: decoding it here would not give the target's output")
        self.model = model
        self.tokenizer = tokenizer
        self.identity = identity
        self.config = model.config
        self.backbone = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self._tree_attention = attention.register_with_transformers()
        self._decode_layers = DecodeLayers(model) if decode_kernels else None
        packed = self._decode_layers.packed if self._decode_layers is not None else None
        self._lean = LeanLlama(model, packed) if LeanLlama.supports(model, packed) else None
        self._static = None
        if fixed_shapes:
            if rescaling_rope_context(self.config) is not None:
                raise ValueError("this target's rotary embedding rescales with the longest position of each pass, "
                                 "which a captured pass cannot follow; decode it without fixed shapes (CUDA graphs)")
            self._static = StaticPasses(self._fixed_shape_pass, capture=self.device.type == "cuda")

    @contextmanager
    def _runtime_layers(self):
        """Tree attention and decode layers for one pass; the model's own settings come back afterwards."""
        with attention.attention_set_to(self._tree_attention, [self.config]):
            if self._decode_layers is None:
                yield
            else:
                with self._decode_layers.active():
                    yield

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def lean(self) -> LeanLlama | None:
        """The lean decode pass this target's verification passes take (``runtime.target.lean``), None where it does
        not apply; a draft head shaped like the target's layers may run its layer through it."""
        return self._lean

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def max_positions(self) -> int:
        """The longest prompt + generation decoded here: the model's context, or for a rotary embedding that
        rescales with the longest position of each pass (dynamic NTK, LongRoPE) its original context, past which
        a tree pass's frequencies would depend on its deepest draft and the output would no longer be the
        target's (``context_note`` says so)."""
        original = rescaling_rope_context(self.config)
        return self._model_context if original is None else min(self._model_context, original)

    @property
    def _model_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 20))

    @property
    def context_note(self) -> str:
        """Why ``max_positions`` is below the model's context, or ''."""
        limit = self.max_positions
        if limit >= self._model_context:
            return ""
        return (f" (its rotary embedding rescales past {limit} positions with the longest position of each "
                f"pass, so a verification pass would change the frequencies its drafts see)")

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return KVCache(config.num_hidden_layers, batch_size, kv_heads, head_dim, max_length, self.dtype, self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] through the LM head (and the final soft-capping, if any)."""
        return softcap_logits(self.lm_head(hidden), self.softcap)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                attention_mask: torch.Tensor | None, *, logits_from: int = 0, hidden_layers: tuple[int, ...] = (),
                backend: str = "sdpa", prefix_len: int | None = None,
                key_positions: torch.Tensor | None = None, ragged: RaggedRows | None = None,
                argmax: bool = False) -> TargetOutput:
        """Run new tokens through the target; writes their K/V into ``cache`` (uncommitted).

        input_ids, position_ids: [B, T]; attention_mask: [B, 1, T, S] bool over cache slots (S = cache's max
        committed length + T), or None for a causal pass over an empty cache. Logits are computed for positions
        ``logits_from ..`` only (a prefill needs just the last one). ``hidden_layers`` are decoder-layer indices
        whose inputs are returned (layer i's input is hidden_states[i]). ``key_positions`` [B, S]: the position each
        key slot holds, for sliding-window layers when rows have different committed lengths (by default slot j of
        the committed cache holds position j and the pass's own entries come last; ``sliding_window_mask``).
        ``ragged``: the rows' tokens come packed, input_ids and position_ids [1, T'] (``runtime.engine.ragged``), while
        the mask is the padded [B, 1, N, S]; outputs are then packed too ([1, T', ...]). ``argmax``: also return
        the greedy token at each position; the lean pass then computes only those (its LM head reads an int8 copy
        of the weights and just the rows that may hold the largest logit, ``runtime.target.kernels.int8_argmax``)
        and no logits.
        """
        out = self._forward(input_ids, position_ids, cache, attention_mask, logits_from, hidden_layers, backend,
                            prefix_len, key_positions, ragged, argmax)
        if argmax and out.argmax is None:
            out.argmax = greedy_tokens(out.logits)
        return out

    def _forward(self, input_ids, position_ids, cache, attention_mask, logits_from, hidden_layers, backend, prefix_len,
                 key_positions, ragged, argmax: bool) -> TargetOutput:
        if self._static is not None and self._static.applies(input_ids, attention_mask, cache, backend, ragged,
                                                             logits_from):
            return TargetOutput(*self._static.forward(input_ids, position_ids, cache, attention_mask, logits_from,
                                                      hidden_layers, key_positions, ragged))
        # key_positions place sliding windows, which a target the lean pass takes has none of
        if self._lean is not None and self._lean.applies(input_ids, attention_mask, backend, ragged, key_positions):
            with nullcontext() if ragged is None else cache.packed(ragged):
                hidden, layer_hidden = self._lean.forward(input_ids, position_ids, cache, attention_mask, ragged,
                                                          hidden_layers)
            if argmax:
                return TargetOutput(None, hidden, layer_hidden, self._lean.argmax(hidden[:, logits_from:]))
            return TargetOutput(self._lean.logits(hidden[:, logits_from:]), hidden, layer_hidden)
        if prefix_len is None and backend == "cascade":  # the committed cache, which every new row sees whole
            prefix_len = int(cache.lengths.min())
        extra = {} if key_positions is None else {"key_positions": key_positions}
        if ragged is not None:
            extra["ragged"] = ragged
        with self._runtime_layers(), (nullcontext() if ragged is None else cache.packed(ragged)):
            outputs = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                    use_cache=True, **cache_argument(self.backbone, cache),
                                    output_hidden_states=bool(hidden_layers), tree_backend=backend,
                                    prefix_len=prefix_len, **extra)
            hidden = outputs.last_hidden_state
            layer_hidden = tuple(outputs.hidden_states[i] for i in hidden_layers) if hidden_layers else ()
            return TargetOutput(self.logits(hidden[:, logits_from:]), hidden, layer_hidden)

    def _fixed_shape_pass(self, inputs, cache, hidden_layers: tuple[int, ...]):
        """The stock pass over a fixed-shape pass's inputs (``runtime.target.static_pass``) -> (logits [B, N, V],
        hidden [B, N, H], the inputs of ``hidden_layers``)."""
        with self._runtime_layers():
            outputs = self.backbone(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                                    attention_mask=inputs.mask, use_cache=True, **cache_argument(self.backbone, cache),
                                    output_hidden_states=bool(hidden_layers), tree_backend="sdpa",
                                    key_positions=inputs.key_positions)
        hidden = outputs.last_hidden_state
        return self.logits(hidden), hidden, tuple(outputs.hidden_states[i] for i in hidden_layers)


GGUF_MAGIC = b"GGUF"


def _float_cache_for_gguf(gguf_path: Path) -> Path:
    """Where the dequantized copy of ``gguf_path`` lives: keyed on the file's content, so another file under the same
    name (and size) never loads a copy made from the first."""
    with open(gguf_path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ValueError(f"{gguf_path} is not a GGUF file (it does not start with {GGUF_MAGIC!r}); pass a .gguf "
                             f"model file, a model directory or an HF model id")
        content = hashlib.sha256(GGUF_MAGIC)
        for block in iter(lambda: handle.read(1 << 20), b""):
            content.update(block)
    return cache_dir() / "models" / f"{gguf_path.stem}-{content.hexdigest()[:16]}"


def _load_gguf(gguf_path: Path, dtype: torch.dtype, attn: str, quiet: bool):
    """Dequantize a GGUF once, keep a float copy in the cache dir, and load from that copy afterwards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    float_dir = _float_cache_for_gguf(gguf_path)
    if not (float_dir / "config.json").is_file():
        check_gguf_complete(gguf_path)
        if not quiet:
            print(f"[headstart] dequantizing {gguf_path.name} once; cached at {float_dir}",
                  file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # save_pretrained refuses a model that still looks quantized; the weights are plain floats by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        partial = float_dir.with_name(float_dir.name + ".partial")
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        if float_dir.exists():
            raise RuntimeError(f"{float_dir} exists but has no config.json; delete it and retry")
        os.replace(partial, float_dir)
    model = _from_pretrained_complete(str(float_dir), dtype=dtype, attn_implementation=attn)
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    return model, tokenizer


def check_gguf_complete(gguf_path: Path) -> None:
    """Refuse a GGUF file that is cut short (an interrupted download or copy) before dequantizing it: its tensor
    table points past the end of the file."""
    import gguf

    try:
        gguf.GGUFReader(str(gguf_path))
    except (ValueError, IndexError, OSError) as error:
        raise ValueError(f"{gguf_path} is not a complete GGUF file ({gguf_path.stat().st_size} bytes; reading its "
                         f"tensors failed: {error}); it was probably cut short: download or copy it again") from None


def _from_pretrained_complete(name_or_path: str, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` that refuses to make up weights: transformers initialises any weight
    the checkpoint lacks at random (a config whose layer count no longer matches the weights, a truncated file) and
    only warns; a target with random layers would decode garbage."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    missing = [key for key in info.get("missing_keys", ()) if "rotary_emb" not in key]
    if missing:
        raise ValueError(f"{name_or_path}: the weights lack {len(missing)} tensors the config asks for "
                         f"({_some(missing)}); the config does not match the weights (e.g. num_hidden_layers "
                         f"changed) or the checkpoint is incomplete. Fix the config or the checkpoint; a model with "
                         f"made-up weights is refused.")
    unexpected = [key for key in info.get("unexpected_keys", ()) if "rotary_emb" not in key]
    if unexpected:
        raise ValueError(f"{name_or_path}: the weights hold {len(unexpected)} tensors the config has no place for "
                         f"({_some(unexpected)}); the config does not match the weights (e.g. num_hidden_layers "
                         f"lowered). Fix the config; a model that drops part of its weights is refused.")
    return model


def _some(keys: list[str], shown: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def resolve_target(name_or_path: str) -> tuple[str, Path | None]:
    """Map an alias or .gguf path to a GGUF file; returns (identity, gguf path or None for HF ids/dirs)."""
    if name_or_path in ALIASES:
        return name_or_path, packaged_file(ALIASES[name_or_path])
    if name_or_path.endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path.name, path
    return name_or_path, None


def check_hub_model(name: str) -> None:
    """An HF model id that is neither in the local cache nor on a hub this machine reaches is named at once, not after
    transformers' retries (most of a minute) end in a traceback."""
    import huggingface_hub
    from huggingface_hub.utils import HfHubHTTPError

    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return
    hint = (f"pass a local model directory or .gguf file, the default target ({DEFAULT_TARGET}), or an id already in "
            f"the cache ({huggingface_hub.constants.HF_HUB_CACHE})")
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{name} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; {hint}")
    try:
        huggingface_hub.HfApi().model_info(name, timeout=10)
    except HfHubHTTPError as error:
        raise FileNotFoundError(f"{name} is not on the Hugging Face hub ({error.response.status_code}: a typo, or a "
                                f"gated or private model needing a token); {hint}") from None
    except Exception as error:  # the HTTP client's own connection errors: the hub is out of reach
        raise FileNotFoundError(f"{name} is not in the local Hugging Face cache and the hub cannot be reached "
                                f"({type(error).__name__}: {error}); {hint}") from None


def target_context(name_or_path: str) -> int | None:
    """The longest prompt + generation a target decodes (``Target.max_positions``), read from its config alone
    before any weights load: a cached or local config, or a GGUF's header; None where that would need a download or
    a reading fails (the check after loading stands)."""
    from transformers import AutoConfig

    try:
        _, gguf_path = resolve_target(name_or_path)
        if gguf_path is not None:
            cached = _float_cache_for_gguf(gguf_path) / "config.json"
            if not cached.is_file():
                return None
            config = AutoConfig.from_pretrained(cached.parent)
        else:
            config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return None
    context = int(getattr(config, "max_position_embeddings", 1 << 20))
    original = rescaling_rope_context(config)
    return context if original is None else min(context, original)


def same_model_identities(identity: str) -> set[str]:
    """``identity`` and every alias naming the same weights (heads trained for one alias fit the others)."""
    if identity not in ALIASES:
        return {identity}
    return {alias for alias, packaged in ALIASES.items() if packaged == ALIASES[identity]}


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", trust_remote_code: bool = False, quiet: bool = False,
                attn_implementation: str = "sdpa", fixed_shapes: bool = False) -> Target:
    """Load a target from an HF id, a local dir, a .gguf file or an alias (``smollm2-135m``).

    ``target.model`` is a stock transformers model in eval mode with ``attn_implementation`` (what HF ``generate``
    and training use); the runtime's own passes switch on tree attention and the decode layers for their duration.
    ``fixed_shapes``: see ``Target`` (CUDA graphs on a GPU).
    """
    from transformers import AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    identity, gguf_path = resolve_target(name_or_path)
    if gguf_path is not None:
        model, tokenizer = _load_gguf(gguf_path, torch_dtype, attn_implementation, quiet)
    else:
        local = Path(name_or_path).expanduser()
        if (name_or_path.startswith((".", "/", "~")) or local.exists()) and not (local / "config.json").is_file():
            raise FileNotFoundError(f"{local} is not a model directory (no config.json)")
        if not local.exists():
            check_hub_model(name_or_path)
        model = _from_pretrained_complete(name_or_path, dtype=torch_dtype, attn_implementation=attn_implementation,
                                          trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    model = model.to(device).eval()
    for parameter in model.parameters():  # a model loaded here is ours to freeze
        parameter.requires_grad_(False)
    return Target(model, tokenizer, identity, fixed_shapes=fixed_shapes)


def target_from_model(model, tokenizer=None, identity: str = "in-memory", decode_kernels: bool = True,
                      fixed_shapes: bool = False) -> Target:
    """Wrap a model built or loaded elsewhere (in eval mode); the model is not changed (see ``Target``)."""
    return Target(model, tokenizer, identity, decode_kernels, fixed_shapes)
