"""Heads in the layouts other code reads and writes: export for SGLang, vLLM and the reference code, and import of
published heads (the EAGLE authors', SpecForge's, FasterDecoding's Medusa, our own exports).

Export formats (``export_files``), each exactly what its reader loads (checked against the readers' source):

- ``sglang`` (the default for EAGLE heads; ``vllm`` is Medusa's): EAGLE-3 ``LlamaForCausalLMEagle3`` (``fc``,
  ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``); EAGLE-1 ``LlamaForCausalLMEagle`` (``fc`` with bias,
  ``layers.{i}.*``). SGLang has no Medusa.
- ``vllm``: EAGLE-3 as above (vLLM renames the keys itself); EAGLE-1 as ``LlamaForCausalLM``, which vLLM prefixes to
  its registered ``EagleLlamaForCausalLM`` (its fc has no bias: a head with a non-zero bias is refused); Medusa
  ``blocks.{h}.layers.{l}.*`` and ``lm_heads.{h}`` with ``medusa_fc_bias: true`` (else vLLM builds bias-free blocks
  and drops the trained biases); a shared LM head is written once per head, as vLLM builds one per head.
- ``reference``: the EAGLE authors' code (``config.json`` + ``pytorch_model.bin``; EAGLE-1 with the embedding and
  ``bias``, which their strict loader needs; EAGLE-3 only for the default layers, the only ones it fuses) and
  FasterDecoding's Medusa (``medusa_lm_head.pt``: ``{h}.{l}.linear.*``, ``{h}.{L}.weight``). economize reads these.

Every EAGLE config is a Llama config of the draft layer (heads.common.draft_layer_config) with ``rope_theta`` at the
top level beside ``rope_parameters``: readers of the legacy key (speculators' converter, older engines) would
otherwise fall back to 10000. EAGLE-3 layer ids are written in each engine's convention: vLLM reads a top-level
``eagle_aux_hidden_state_layer_ids`` (the index i of hidden_states[i], our ``feature_layers``), SGLang
``eagle_config.eagle_aux_hidden_state_layer_ids`` and adds 1 (so i - 1). The nested ids are written only for
non-default layers: SGLang's default is ours, and economize reads the nested ids in vLLM's convention.

Import (``load_any_head``) detects the layout from the files, converts it to our head and checks every shape and
setting against the target, naming what differs. Pickles load with ``weights_only=True`` only.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from heads.common import draft_layer_config, draft_rope_parameters, output_vocab_size
from heads.eagle import EagleConfig, EagleHead
from heads.eagle3 import Eagle3Config, Eagle3Head, default_feature_layers
from heads.medusa import MedusaConfig, MedusaHeads

EXPORT_FORMATS = ("sglang", "vllm", "reference")
READERS = {"sglang": "SGLang", "vllm": "vLLM",
           "reference": "the EAGLE authors' / FasterDecoding Medusa code and economize"}
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SAFETENSORS = "model.safetensors"
PICKLE = "pytorch_model.bin"
MEDUSA_REFERENCE_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# EAGLE-3 options of SpecForge / speculators that change the computation; our head implements none of them.
UNSUPPORTED_EAGLE3_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "input_norm")
# Draft-layer weights of a target-style (non-Llama) layer: Qwen2 q/k/v biases, Qwen3 q/k norms.
TARGET_STYLE_KEYS = re.compile(r"self_attn\.(q_proj|k_proj|v_proj)\.bias$|self_attn\.(q_norm|k_norm)\.")
MEDUSA_REFERENCE_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")

# What import looks for, in the order it tries, for the error that lists them.
LAYOUTS = {
    "headstart": "our head directory: config.json with format headstart-head + model.safetensors",
    "medusa-reference": "FasterDecoding Medusa (and our reference export): config.json with medusa_num_heads + "
                        "medusa_lm_head.safetensors or medusa_lm_head.pt",
    "medusa-vllm": "vLLM Medusa (our vllm export): config.json with model_type medusa + model.safetensors",
    "eagle3": "EAGLE-3 (the EAGLE authors, SpecForge, our exports): config.json with draft_vocab_size or an Eagle3 "
              "architecture + model.safetensors or pytorch_model.bin",
    "eagle": "EAGLE-1 (the EAGLE authors, our exports): config.json + model.safetensors or pytorch_model.bin holding "
             "fc.weight [H, 2H] and layers.{i}.*",
}


# ----- export

def export_refusal(head_type: str, head_config: dict, target_layers: int | None, fmt: str) -> str | None:
    """Why ``fmt`` cannot carry this head (a message naming the fix), or None. Needs only the head's config, so a
    command line can refuse before loading anything."""
    if fmt not in EXPORT_FORMATS:
        return f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}"
    if head_type == "medusa" and fmt == "sglang":
        return ("SGLang has no Medusa drafter; export a Medusa head for vLLM (--format vllm) or the Medusa authors' "
                "code and economize (--format reference)")
    if head_type == "eagle" and fmt == "vllm" and head_config.get("fc_bias", True):
        return ("vLLM's EAGLE-1 drafter has no bias on fc and this head was trained with one (fc_bias), which vLLM "
                "would not load; serve it with SGLang (--format sglang) or the EAGLE authors' code (--format "
                "reference)")
    if head_type == "medusa" and fmt == "reference" and int(head_config.get("num_layers", 1)) > 1:
        return (f"the Medusa authors' code repeats one residual block in each head (medusa_num_layers copies of the "
                f"same weights) and this head has {head_config['num_layers']} different ones, which it would load "
                f"as the last one repeated; export it for vLLM (--format vllm)")
    if head_type == "eagle3" and fmt in ("sglang", "vllm") and target_layers:
        layers = [int(i) for i in head_config.get("feature_layers") or default_feature_layers(target_layers)]
        if any(low >= high for low, high in zip(layers, layers[1:])):
            return (f"SGLang and vLLM capture the fused layers' inputs while running the target's layers in order, "
                    f"once each, so they fuse them in ascending order; this head fuses {layers} in that order, "
                    f"which they would serve as another head. Train it with ascending head.feature_layers "
                    f"(or export it for the EAGLE authors' code, --format reference, if they are its defaults)")
    if head_type == "eagle3" and fmt == "reference" and target_layers and head_config.get("feature_layers"):
        default = default_feature_layers(target_layers)
        if [int(i) for i in head_config["feature_layers"]] != default:
            return (f"the EAGLE authors' code always fuses the inputs of target layers {default} (2, N//2, N-3) and "
                    f"reads no layer ids; this head fuses {head_config['feature_layers']}. Export it for SGLang or "
                    f"vLLM (--format sglang / vllm), which read the ids")
    return None


def _state(head: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}


def _draft_layer_json(head, **overrides) -> dict:
    """The draft layer's Llama config as config.json data, with the legacy rope keys beside ``rope_parameters``."""
    target = head.target_config
    data = draft_layer_config(target, head.cache_layers).to_dict()
    for key in ("_name_or_path", "transformers_version", "output_attentions", "output_hidden_states", "return_dict",
                "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "dtype",
                "pretraining_tp", "use_cache"):  # transformers' generic fields: no reader's business
        data.pop(key, None)
    rope = draft_rope_parameters(target)
    data["rope_theta"] = float(rope["rope_theta"])
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    data["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        data[key] = getattr(target, key, None)
    data.update(model_type="llama", vocab_size=output_vocab_size(target), **overrides)
    return data


def _eagle3_files(head: Eagle3Head, fmt: str) -> dict:
    config = _draft_layer_json(head, architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=head.draft_vocab_size)
    layers = head.feature_layers
    eagle_config = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True}
    if fmt in ("sglang", "vllm"):
        config["eagle_aux_hidden_state_layer_ids"] = list(layers)  # vLLM: hidden_states[i] as we index them
    if fmt == "sglang" and layers != default_feature_layers(int(head.target_config.num_hidden_layers)):
        eagle_config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in layers]  # SGLang adds 1
    if fmt != "reference":
        config["eagle_config"] = eagle_config
    weights = PICKLE if fmt == "reference" else SAFETENSORS
    return {"config.json": config, weights: _state(head)}


def _eagle_files(head: EagleHead, fmt: str) -> dict:
    state = _state(head)
    if "fc.bias" not in state and fmt != "vllm":  # SGLang's and the reference fc have a bias: a zero one is exact
        state["fc.bias"] = torch.zeros(head.hidden_size, dtype=state["fc.weight"].dtype)
    if fmt == "vllm":
        bias = state.pop("fc.bias", None)
        if bias is not None and bool(bias.any()):
            raise ValueError(export_refusal("eagle", {"fc_bias": True}, None, "vllm"))
        return {"config.json": _draft_layer_json(head, architectures=["LlamaForCausalLM"]), SAFETENSORS: state}
    if fmt == "sglang":
        return {"config.json": _draft_layer_json(head, architectures=["LlamaForCausalLMEagle"]), SAFETENSORS: state}
    # the authors' loader is strict and builds the embedding too; "bias" tells it fc has one
    state["embed_tokens.weight"] = head.embed_weight.detach().contiguous().cpu().clone()
    config = _draft_layer_json(head, architectures=["LlamaForCausalLM"], bias=True)
    return {"config.json": config, PICKLE: state}


def _medusa_lm_heads(head: MedusaHeads) -> list[torch.Tensor]:
    if head.config.shared_lm_head:
        if head.target_lm_head_weight.numel() == 0:
            raise RuntimeError("exporting a shared-LM-head Medusa needs the target attached (load the head with the "
                               "target model)")
        return [head.target_lm_head_weight.detach().contiguous().cpu()] * head.num_heads
    return [layer.weight.detach().contiguous().cpu() for layer in head.lm_heads]


def _medusa_files(head: MedusaHeads, fmt: str, base_model: str | None) -> dict:
    blocks = {name: tensor for name, tensor in _state(head).items() if name.startswith("blocks.")}
    lm_heads = _medusa_lm_heads(head)
    num_layers = head.config.num_layers
    if fmt == "vllm":
        tensors = dict(blocks)
        for index, weight in enumerate(lm_heads):
            tensors[f"lm_heads.{index}.weight"] = weight.clone()
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": head.hidden_size,
                  "vocab_size": head.vocab_size, "truncated_vocab_size": head.vocab_size, "num_heads": head.num_heads,
                  "num_hidden_layers": num_layers, "medusa_num_heads": head.num_heads,
                  "medusa_num_layers": num_layers, "medusa_fc_bias": True, "original_lm_head": False}
        return {"config.json": config, SAFETENSORS: tensors}
    tensors = {}
    for name, tensor in blocks.items():  # blocks.{h}.layers.{l}.{weight,bias} -> {h}.{l}.linear.{weight,bias}
        _, h, _, layer, leaf = name.split(".")
        tensors[f"{h}.{layer}.linear.{leaf}"] = tensor
    for index, weight in enumerate(lm_heads):
        tensors[f"{index}.{num_layers}.weight"] = weight.clone()
    config = {"medusa_num_heads": head.num_heads, "medusa_num_layers": num_layers,
              "base_model_name_or_path": base_model, "hidden_size": head.hidden_size, "vocab_size": head.vocab_size}
    return {"config.json": config, "medusa_lm_head.pt": tensors}


def export_files(head: nn.Module, fmt: str = "sglang", *, base_model: str | None = None) -> dict:
    """{file name: config dict (``.json``) or tensors (``.safetensors``, ``.bin``, ``.pt``)} of ``head`` in ``fmt``.
    ``head`` needs its target weights attached; ``base_model`` names the target in the Medusa reference config."""
    config = asdict(head.config)
    problem = export_refusal(head.head_type, config, int(head.target_config.num_hidden_layers), fmt)
    if problem:
        raise ValueError(problem)
    if head.head_type == "eagle3":
        return _eagle3_files(head, fmt)
    if head.head_type == "eagle":
        return _eagle_files(head, fmt)
    return _medusa_files(head, fmt, base_model)


def write_files(directory: Path, files: dict, dtype: torch.dtype | None = None) -> None:
    """Write ``export_files`` output into ``directory``, casting floating tensors to ``dtype``."""
    from safetensors.torch import save_file

    for name, content in files.items():
        path = Path(directory) / name
        if name.endswith(".json"):
            if dtype is not None and "hidden_size" in content:
                content = {**content, "torch_dtype": str(dtype).removeprefix("torch.")}
            path.write_text(json.dumps(content, indent=2) + "\n")
            continue
        tensors = {key: value.to(dtype) if dtype is not None and value.is_floating_point() else value
                   for key, value in content.items()}
        if name.endswith(".safetensors"):
            # shared storage (a shared LM head written once per Medusa head) must be separate tensors here
            save_file({key: value.contiguous().clone() for key, value in tensors.items()}, str(path),
                      metadata={"format": "pt"})
        else:
            torch.save(tensors, path)


# ----- import

def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a config object")
    return data


def _first(directory: Path, names) -> Path | None:
    return next((directory / name for name in names if (directory / name).is_file()), None)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or a pickled state dict read with ``weights_only=True`` (tensors only, no code)."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # an unpickling error names the global it refused
        raise ValueError(f"{path} does not load as a plain state dict with weights_only=True ({error}); only "
                         "tensors are read from pickles") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors")
    return dict(state)


def detect_layout(directory: str | Path) -> tuple[str, str]:
    """(layout, head type) of a head directory, from its files and config.json (no weights read but a few key
    names); a ValueError lists the layouts looked for and the files found."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory; pass a head directory")
    config_path = directory / "config.json"
    config = _read_json(config_path) if config_path.is_file() else None
    if config is not None:
        if config.get("format") == "headstart-head":
            return "headstart", str(config.get("head_type"))
        if "medusa_num_heads" in config and _first(directory, MEDUSA_REFERENCE_FILES):
            return "medusa-reference", "medusa"
        architectures = [str(a) for a in config.get("architectures") or []]
        weights = _first(directory, (SAFETENSORS, PICKLE))
        if weights is not None:
            if config.get("model_type") == "medusa" or "MedusaModel" in architectures:
                return "medusa-vllm", "medusa"
            if "draft_vocab_size" in config or any("eagle3" in a.lower() for a in architectures):
                return "eagle3", "eagle3"
            if weights.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(weights), "pt") as handle:
                    keys = set(handle.keys())
            else:
                keys = set(load_weights(weights))
            if "fc.weight" in keys and any(key.startswith("layers.") for key in keys):
                return "eagle", "eagle"
    found = sorted(path.name for path in directory.iterdir()) if directory.is_dir() else []
    looked_for = "; ".join(f"{name}: {what}" for name, what in LAYOUTS.items())
    raise ValueError(f"{directory} is no head layout known here (found: {', '.join(found) or 'nothing'}). Looked "
                     f"for: {looked_for}")


def _mismatches(pairs) -> list[str]:
    """'name: head X, target Y' for each (name, head value, target value) that differs (None: not recorded)."""
    problems = []
    for name, theirs, ours in pairs:
        if theirs is None:
            continue
        same = abs(float(theirs) - float(ours)) <= 1e-9 * max(1.0, abs(float(ours))) if isinstance(
            ours, float) else theirs == ours
        if not same:
            problems.append(f"{name} {theirs} (this target: {ours})")
    return problems


def _check_layer_settings(config: dict, target_config, where: Path, kind: str) -> None:
    """The draft layer's settings in a published config against those this target gives our draft layer."""
    ours = draft_layer_config(target_config)
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    our_rope = draft_rope_parameters(target_config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (int(config["hidden_size"]) // int(heads) if heads and config.get(
        "hidden_size") else None)
    problems = _mismatches([
        ("hidden_size", config.get("hidden_size"), ours.hidden_size),
        ("num_attention_heads", heads, ours.num_attention_heads),
        ("num_key_value_heads", config.get("num_key_value_heads", heads), ours.num_key_value_heads),
        ("head_dim", head_dim, ours.head_dim),
        ("intermediate_size", config.get("intermediate_size"), ours.intermediate_size),
        ("rms_norm_eps", config.get("rms_norm_eps"), float(ours.rms_norm_eps)),
        # the reference code uses 10000 where a config has no rope_theta
        ("rope_theta", 10000.0 if theta is None else float(theta), float(our_rope["rope_theta"])),
        ("rope type", rope_type, our_rope.get("rope_type", "default")),
        ("hidden_act", config.get("hidden_act"), "silu"),
    ])
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("biases on the draft layer's attention or MLP (attention_bias / mlp_bias)")
    if problems:
        raise ValueError(f"the {kind} head at {where} does not fit this target: " + "; ".join(problems)
                         + ". Load a head trained for this target")


def _load_into(head: nn.Module, state: dict[str, torch.Tensor], where: Path, kind: str) -> None:
    """Copy ``state`` into ``head`` (strict), naming missing and unexpected keys and every shape that differs."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{name} {tuple(state[name].shape)} (expected {tuple(expected[name].shape)})"
              for name in sorted(set(state) & set(expected)) if state[name].shape != expected[name].shape]
    if missing or unexpected or shapes:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) + (
            [f"shapes differ: {'; '.join(shapes)}"] if shapes else [])
        raise ValueError(f"the {kind} head at {where} does not fit this target: " + ", ".join(parts))
    head.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in state.items()})


def _drop_embedding(state: dict, target_config, where: Path) -> None:
    """Published EAGLE heads may carry a copy of the target's embedding; the head uses the target's own."""
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and embed.shape[1] != int(target_config.hidden_size):
        raise ValueError(f"{where}: embed_tokens.weight has width {embed.shape[1]}, this target has hidden size "
                         f"{target_config.hidden_size}")


def _refuse_target_style(state: dict, where: Path) -> None:
    odd = sorted(key for key in state if TARGET_STYLE_KEYS.search(key))
    if odd:
        raise ValueError(f"{where}: the draft layer has weights of a non-Llama layer ({', '.join(odd[:3])}); the "
                         "engines and this runtime draft with a Llama-style layer (no q/k/v bias, no q/k norm)")


def _eagle3_feature_layers(config: dict, num_layers: int, where: Path) -> list[int]:
    """Top-level ids (vLLM's convention: our indices), else the nested SGLang ids plus 1, else the default."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_nested = [int(i) + 1 for i in nested] if nested else None
    if top and from_nested and [int(i) for i in top] != from_nested:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {top} (vLLM's convention) and eagle_config's "
                         f"{nested} (SGLang's, which adds 1) name different layers; fix one of them")
    layers = [int(i) for i in top] if top else from_nested or default_feature_layers(num_layers)
    if len(layers) != 3:
        raise ValueError(f"{where}: EAGLE-3 heads here fuse 3 target layers, the config names {layers}")
    return layers


def _import_eagle3(directory: Path, config: dict, target_config) -> Eagle3Head:
    layer = config.get("transformer_layer_config")  # speculators nests the layer's fields
    config = {**layer, **{k: v for k, v in config.items() if v is not None}} if isinstance(layer, dict) else config
    eagle = config.get("eagle_config") or {}
    flags = [flag for flag in UNSUPPORTED_EAGLE3_FLAGS if config.get(flag) or eagle.get(flag)]
    if flags:
        raise ValueError(f"{directory}: EAGLE-3 options {flags} change the draft computation and are not supported")
    if config.get("target_hidden_size") not in (None, config.get("hidden_size")):
        raise ValueError(f"{directory}: a draft width other than the target's (target_hidden_size) is not supported")
    _check_layer_settings(config, target_config, directory, "EAGLE-3")
    weights = _first(directory, (SAFETENSORS, PICKLE))
    state = load_weights(weights)
    _drop_embedding(state, target_config, weights)
    _refuse_target_style(state, weights)
    renamed = {}
    for key, value in state.items():
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        elif key.startswith("layers."):
            raise ValueError(f"{weights}: EAGLE-3 heads with several draft layers are not supported ({key})")
        renamed[key] = value
    if "lm_head.weight" not in renamed:
        raise ValueError(f"{weights} has no lm_head.weight; an EAGLE-3 head has its own LM head")
    vocab = output_vocab_size(target_config)
    draft_vocab = int(renamed["lm_head.weight"].shape[0])
    problems = _mismatches([("vocab_size", config.get("vocab_size"), vocab)])
    if draft_vocab > vocab:
        problems.append(f"draft vocabulary {draft_vocab} (this target's vocabulary: {vocab})")
    if problems:
        raise ValueError(f"the EAGLE-3 head at {directory} does not fit this target: " + "; ".join(problems))
    d2t = renamed.get("d2t")
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(f"{weights}: lm_head.weight has {draft_vocab} rows but no d2t says which target tokens "
                             "they are")
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    d2t = d2t.to(torch.long)
    ids = torch.arange(d2t.shape[0]) + d2t
    if d2t.shape != (draft_vocab,) or int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != \
            draft_vocab:
        raise ValueError(f"{weights}: d2t does not map the {draft_vocab} draft tokens to distinct target tokens "
                         f"below {vocab}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    stored = renamed.get("t2d")
    if stored is not None and (stored.shape != t2d.shape or not torch.equal(stored.to(torch.bool), t2d)):
        raise ValueError(f"{weights}: t2d disagrees with d2t (or has another length than the target's vocabulary "
                         f"{vocab})")
    renamed["d2t"], renamed["t2d"] = d2t, t2d
    layers = _eagle3_feature_layers(config, int(target_config.num_hidden_layers), directory)
    head = Eagle3Head(Eagle3Config(layers, draft_vocab if draft_vocab < vocab else 0), target_config)
    _load_into(head, renamed, weights, "EAGLE-3")
    return head


def _import_eagle(directory: Path, config: dict, target_config) -> EagleHead:
    _check_layer_settings(config, target_config, directory, "EAGLE-1")
    weights = _first(directory, (SAFETENSORS, PICKLE))
    state = load_weights(weights)
    _drop_embedding(state, target_config, weights)
    _refuse_target_style(state, weights)
    vocab = output_vocab_size(target_config)
    problems = _mismatches([("vocab_size", config.get("vocab_size"), vocab)])
    if problems:
        raise ValueError(f"the EAGLE-1 head at {directory} does not fit this target: " + "; ".join(problems))
    indices = {int(key.split(".")[1]) for key in state if key.startswith("layers.") and key.split(".")[1].isdigit()}
    if not indices:
        raise ValueError(f"{weights} holds no draft layer (layers.0.*)")
    head = EagleHead(EagleConfig(num_layers=max(indices) + 1, fc_bias="fc.bias" in state), target_config)
    _load_into(head, state, weights, "EAGLE-1")
    return head


def _medusa_head(heads_blocks: dict, lm_heads: list[torch.Tensor], num_layers: int, target_model, target_config,
                 where: Path) -> MedusaHeads:
    """Medusa heads from blocks ({name: tensor} in our naming, biases optional) and one LM head weight per head:
    heads whose LM heads all equal the target's load as a shared-LM-head Medusa (same logits, no copies)."""
    hidden, vocab = int(target_config.hidden_size), output_vocab_size(target_config)
    bad = [f"LM head {i}: {tuple(w.shape)}" for i, w in enumerate(lm_heads) if tuple(w.shape) != (vocab, hidden)]
    if bad:
        raise ValueError(f"the Medusa heads at {where} do not fit this target (vocabulary {vocab}, hidden size "
                         f"{hidden}): {'; '.join(bad)}")
    target_head = target_model.get_output_embeddings().weight if isinstance(target_model, nn.Module) else None
    shared = target_head is not None and all(
        torch.equal(w.to(target_head.dtype), target_head.detach().cpu()) for w in lm_heads)
    head = MedusaHeads(MedusaConfig(num_heads=len(lm_heads), num_layers=num_layers, shared_lm_head=shared),
                       target_config)
    state = dict(heads_blocks)
    for name, tensor in head.state_dict().items():  # bias-free blocks (vLLM without medusa_fc_bias): zero biases
        if name.endswith(".bias") and name not in state:
            state[name] = torch.zeros_like(tensor)
    if not shared:
        state.update({f"lm_heads.{i}.weight": w for i, w in enumerate(lm_heads)})
    _load_into(head, state, where, "Medusa")
    return head


def _import_medusa_reference(directory: Path, config: dict, target_model, target_config) -> MedusaHeads:
    weights = _first(directory, MEDUSA_REFERENCE_FILES)
    state = load_weights(weights)
    matches = {key: MEDUSA_REFERENCE_KEY.match(key) for key in state}
    bad = [key for key, match in matches.items() if match is None]
    if bad or not state:
        raise ValueError(f"{weights}: not FasterDecoding Medusa heads (keys {{h}}.{{l}}.linear.*, {{h}}.{{L}}.weight); "
                         f"unexpected {bad[:3]}")
    num_heads = 1 + max(int(m[1]) for m in matches.values())
    projections = {int(m[2]) for m in matches.values() if m[3] == "weight"}
    if len(projections) != 1:
        raise ValueError(f"{weights}: Medusa heads with different block counts {sorted(projections)}")
    num_layers = projections.pop()
    stated = (config.get("medusa_num_heads"), config.get("medusa_num_layers", 1))
    if stated != (num_heads, num_layers):  # published configs disagree with their weights; the weights decide
        warnings.warn(f"{directory / 'config.json'} states {stated[0]} heads with {stated[1]} blocks, the weights "
                      f"hold {num_heads} with {num_layers}; using the weights", stacklevel=3)
    blocks, lm_heads = {}, [None] * num_heads
    for key, match in matches.items():
        h, index, leaf = int(match[1]), int(match[2]), match[3]
        if leaf == "weight":
            lm_heads[h] = state[key]
        else:
            blocks[f"blocks.{h}.layers.{index}.{leaf.split('.')[1]}"] = state[key]
    missing = [i for i, w in enumerate(lm_heads) if w is None]
    if missing:
        raise ValueError(f"{weights}: heads {missing} have no vocabulary projection")
    return _medusa_head(blocks, lm_heads, num_layers, target_model, target_config, weights)


def _import_medusa_vllm(directory: Path, config: dict, target_model, target_config) -> MedusaHeads:
    weights = directory / SAFETENSORS
    state = {key.removeprefix("medusa_heads."): value for key, value in load_weights(weights).items()}
    if "token_map" in state:
        raise ValueError(f"{weights}: Medusa heads over a truncated vocabulary (token_map) are not supported")
    num_heads = int(config.get("num_heads", config.get("medusa_num_heads", 0)))
    num_layers = int(config.get("num_hidden_layers", config.get("medusa_num_layers", 1)))
    problems = _mismatches([("hidden_size", config.get("hidden_size"), int(target_config.hidden_size)),
                            ("vocab_size", config.get("vocab_size"), output_vocab_size(target_config))])
    if problems:
        raise ValueError(f"the Medusa heads at {directory} do not fit this target: " + "; ".join(problems))
    blocks = {key: value for key, value in state.items() if key.startswith("blocks.")}
    if not config.get("medusa_fc_bias", False):  # what vLLM builds: bias-free blocks, any stored bias unused
        blocks = {key: value for key, value in blocks.items() if not key.endswith(".bias")}
    if config.get("original_lm_head", False):
        lm_heads = [state["lm_heads.0.weight"]] * num_heads
    else:
        lm_heads = [state.get(f"lm_heads.{i}.weight") for i in range(num_heads)]
    if any(w is None for w in lm_heads):
        raise ValueError(f"{weights} lacks LM heads lm_heads.{{0..{num_heads - 1}}}.weight")
    return _medusa_head(blocks, lm_heads, num_layers, target_model, target_config, weights)


def load_any_head(directory: str | Path, target_model_or_config, *, identity: str | None = None, tokenizer=None,
                  device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                  ) -> tuple[nn.Module, dict]:
    """(head, config) from a directory in any layout ``detect_layout`` knows, for a target (a transformers model:
    frozen weights get attached; or its config: checked only).

    Our own head directories load with ``heads.io.load_head`` (their config is the saved one); other layouts are
    converted, checked against the target (shapes, draft-layer settings, vocabulary, layers; the error names what
    differs) and get a config of ours without tree defaults: ``{"format", "layout", "head_type", "head_config",
    "tree": {}, "training": {}}``.
    """
    from heads.common import frozen_target_weights
    from heads.io import load_head, read_head_config

    directory = Path(directory)
    layout, head_type = detect_layout(directory)
    if layout == "headstart":
        config = read_head_config(directory)
        head = load_head(directory, target_model_or_config, identity=identity, tokenizer=tokenizer, device=device,
                         dtype=dtype)
        return head, config
    target_config = getattr(target_model_or_config, "config", target_model_or_config)
    config = _read_json(directory / "config.json")
    if layout == "eagle3":
        head = _import_eagle3(directory, config, target_config)
    elif layout == "eagle":
        head = _import_eagle(directory, config, target_config)
    elif layout == "medusa-reference":
        head = _import_medusa_reference(directory, config, target_model_or_config, target_config)
    else:
        head = _import_medusa_vllm(directory, config, target_model_or_config, target_config)
    bad = [i for i in head.feature_layers if not 0 <= i < int(target_config.num_hidden_layers)]
    if bad:
        raise ValueError(f"the head at {directory} reads target layers {bad}; this target has layers "
                         f"0..{target_config.num_hidden_layers - 1}")
    if isinstance(target_model_or_config, nn.Module):
        head.attach_target_weights(*frozen_target_weights(target_model_or_config))
    if device is not None or dtype is not None:
        head.to(device=device, dtype=dtype)
    saved = {"format": "imported", "layout": layout, "head_type": head_type, "head_config": asdict(head.config),
             "tree": {}, "training": {}}
    return head.eval(), saved
