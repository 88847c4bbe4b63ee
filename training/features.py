"""Target features for head training: online (a frozen target forward inside the step) or offline (dumped once).

A feature batch adds to a token batch:
  hidden [B, T, H]: the target's last hidden state after the final norm (its logits are lm_head(hidden));
  layer_hidden [B, T, 3H]: EAGLE-3's fused inputs (hidden_states[i] for the feature layers), when asked for;
  topk_logprobs / topk_ids [B, T, k]: offline stores with ``topk > 0`` keep the target's top-k instead of letting
  the loss recompute exact logits from ``hidden``.
The offline store is sharded safetensors, one shard per ``SHARD_SIZE`` training samples, written atomically and
skipped when present (extraction resumes after a kill); a manifest marks the store complete. Both the manifest and the
record written when extraction starts say what the features are of (target, tokenizer, data and shuffle, layers,
storage): ``prepare_offline_store`` finds (or fills) the store of a run's settings and refuses one of other settings.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm

from heads.common import tokenizer_fingerprint
from heads.layouts import safetensors_damage, save_tensors
from runtime.target.assets import cache_dir
from runtime.target.model import parse_dtype
from training import engine as ds
from training.data import cache_key

SHARD_SIZE = 64
MANIFEST = "manifest.json"  # marks a store complete; records what it holds features of (``store_description``)
EXTRACTION = "extraction.json"  # the same record, written when extraction starts (a resumed one is checked)


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, feature_layers: list[int] = (),
                    topk: int = 0) -> dict[str, torch.Tensor]:
    """One frozen target forward over right-padded ids [B, T] (causal; padding never reaches real rows)."""
    decoder = target.model.get_decoder()  # the stock transformers model: no cache, causal attention
    outputs = decoder(input_ids=input_ids, use_cache=False, output_hidden_states=bool(feature_layers))
    features = {"hidden": outputs.last_hidden_state}
    if feature_layers:
        features["layer_hidden"] = torch.cat([outputs.hidden_states[i] for i in feature_layers], dim=-1)
    if topk:
        logprobs = F.log_softmax(target.logits(outputs.last_hidden_state).float(), dim=-1)
        values, ids = logprobs.topk(topk, dim=-1)
        features["topk_logprobs"], features["topk_ids"] = values, ids
    return features


def store_key(target_identity: str, tokenizer_fp: str | None, data_key: str, feature_layers: list[int], topk: int,
              dtype: str, max_length: int) -> str:
    parts = [target_identity, tokenizer_fp, data_key, list(feature_layers), topk, dtype, max_length]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _shard_path(directory: Path, shard: int) -> Path:
    return directory / f"shard-{shard:05d}.safetensors"


def extract_offline(target, dataset, directory: Path, feature_layers: list[int], topk: int, dtype: str,
                    batch_size: int, pad_id: int, rank: int = 0, world: int = 1, progress: bool = True) -> None:
    """Dump features of every sample of ``dataset`` (rank r writes shards r, r+world, ...). Resumable."""
    directory.mkdir(parents=True, exist_ok=True)
    storage_dtype = parse_dtype(dtype)
    num_shards = (len(dataset) + SHARD_SIZE - 1) // SHARD_SIZE
    mine = [s for s in range(rank, num_shards, world) if not _shard_path(directory, s).is_file()]
    total = sum(min(SHARD_SIZE, len(dataset) - s * SHARD_SIZE) for s in mine)
    bar = tqdm(total=total, desc="extracting target features", unit="seq", disable=not progress or rank != 0)
    for shard in mine:
        tensors = {}
        indices = list(range(shard * SHARD_SIZE, min((shard + 1) * SHARD_SIZE, len(dataset))))
        for start in range(0, len(indices), batch_size):
            chunk = indices[start: start + batch_size]
            samples = [dataset[i] for i in chunk]
            length = max(len(s["input_ids"]) for s in samples)
            ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
            for row, sample in enumerate(samples):
                ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
            features = target_features(target, ids.to(target.device), feature_layers, topk)
            for row, (index, sample) in enumerate(zip(chunk, samples)):
                n = len(sample["input_ids"])
                for name, value in features.items():
                    value = value[row, :n].cpu()
                    if value.is_floating_point() and name != "topk_logprobs":
                        value = value.to(storage_dtype)
                    if name == "topk_ids":
                        value = value.to(torch.int32)
                    tensors[f"{index}.{name}"] = value.contiguous()
            bar.update(len(chunk))
        path = _shard_path(directory, shard)
        partial = path.with_name(path.name + f".partial-{rank}")
        save_tensors(tensors, partial)
        os.replace(partial, path)  # a shard is either complete or absent
    bar.close()


def write_json(path: Path, value: dict) -> None:
    """Atomically: a reader sees the whole file or none."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2))
    os.replace(partial, path)


def write_manifest(directory: Path, num_samples: int, description: dict) -> None:
    num_shards = (num_samples + SHARD_SIZE - 1) // SHARD_SIZE
    missing = [s for s in range(num_shards) if not _shard_path(directory, s).is_file()]
    if missing:
        raise RuntimeError(f"offline feature store {directory} is missing shards {missing[:5]}...; rerun extraction")
    write_json(directory / MANIFEST, {"num_samples": num_samples, "shard_size": SHARD_SIZE, **description})


def store_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


class OfflineFeatures:
    """Reads one sample's features from the store and pads a micro-batch of them like ``data.collate``."""

    def __init__(self, directory: Path, num_samples: int):
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest["num_samples"] != num_samples:
            raise RuntimeError(f"offline store {directory} holds {manifest['num_samples']} samples, the training "
                               f"split has {num_samples}; delete the store or point features.dir elsewhere")
        self.directory = directory
        self.shard_size = manifest["shard_size"]
        self._handles: dict[int, object] = {}
        for shard in range(-(-num_samples // self.shard_size)):  # before the first step, not when a read fails
            path = _shard_path(directory, shard)
            damage = safetensors_damage(path) if path.is_file() else f"{path} is missing"
            if damage:
                raise ValueError(f"the offline feature store {directory} is damaged: {damage}. Delete {path} (the "
                                 f"store's manifest too: {directory / MANIFEST}) and run again to extract it anew")

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(_shard_path(self.directory, shard)), framework="pt")
        return self._handles[shard]

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        handle = self._handle(index // self.shard_size)
        prefix = f"{index}."
        return {key[len(prefix):]: handle.get_tensor(key) for key in handle.keys() if key.startswith(prefix)}

    def batch(self, indices: list[int], length: int, device, dtype) -> dict[str, torch.Tensor]:
        return pad_features([self.sample(i) for i in indices], length, device, dtype)


def pad_features(samples: list[dict[str, torch.Tensor]], length: int, device, dtype) -> dict[str, torch.Tensor]:
    """Samples' features ({name: [T_i, ...]}) right-padded with zeros to [B, length, ...] like ``data.collate``;
    hidden states in ``dtype`` (top-k log-probs stay fp32, top-k ids become long), on ``device``."""
    out = {}
    for name in samples[0]:
        first = samples[0][name]
        padded = torch.zeros((len(samples), length, *first.shape[1:]), dtype=first.dtype)
        for row, sample in enumerate(samples):
            padded[row, : sample[name].shape[0]] = sample[name]
        if name == "topk_ids":
            padded = padded.long()
        elif padded.is_floating_point() and name != "topk_logprobs":
            padded = padded.to(dtype)
        out[name] = padded.to(device)
    return out


DATA_SETTINGS = ("source", "path", "split", "subset", "max_samples", "val_samples", "seed", "max_length",
                 "chat_template", "min_assistant_tokens")
FEATURE_SETTINGS = ("target", "tokenizer", "feature_layers", "topk", "dtype")
UNRECORDED = "(unrecorded)"


def store_description(conf, target, data_key: str, feature_layers: list[int]) -> dict:
    """What an offline store holds features of. A run uses a store only when it would extract exactly this: the
    target, its tokenizer, the conversations (``data_key`` covers the file, shuffle seed and split; the data
    settings are kept to name a difference), the feature layers and how they are stored. The head type is kept
    for the messages: heads reading the same layers (eagle, medusa) share a store."""
    return {"target": target.identity, "tokenizer": tokenizer_fingerprint(target.tokenizer), "data": data_key,
            "data_settings": {key: getattr(conf.data, key) for key in DATA_SETTINGS},
            "feature_layers": list(feature_layers), "topk": conf.features.topk, "dtype": conf.features.dtype,
            "head_type": conf.head.head_type}


def description_differences(found: dict, wanted: dict) -> list[str]:
    """'key: the store's value, this run's value' for each setting that differs. The conversations differ when the
    data keys do; the data settings then name why (or, when they are equal, the data file itself changed)."""
    def show(key, stored, value) -> str:
        return f"{key}: {stored!r} in the store, {value!r} in this run"

    differences = []
    if found.get("data", UNRECORDED) != wanted["data"]:
        stored_data = found.get("data_settings") or {}
        differences = [show(f"data.{name}", stored_data.get(name, UNRECORDED), value)
                       for name, value in wanted["data_settings"].items()
                       if stored_data.get(name, UNRECORDED) != value]
        differences = differences or [show("the conversations (the data file changed)",
                                           found.get("data", UNRECORDED), wanted["data"])]
    differences += [show(key, found.get(key, UNRECORDED), wanted[key]) for key in FEATURE_SETTINGS
                    if found.get(key, UNRECORDED) != wanted[key]]
    return differences


def check_store(directory: Path, wanted: dict) -> None:
    """Refuse a store (complete, or partly extracted) that holds features of other settings, or shards of an
    extraction that recorded nothing."""
    fix = "point features.dir at another directory (or unset it to use the cache), or delete this store"
    record = next((directory / name for name in (MANIFEST, EXTRACTION) if (directory / name).is_file()), None)
    if record is None:
        if any(directory.glob("shard-*.safetensors")):
            raise ValueError(f"offline feature store {directory} holds shards but no {MANIFEST} or {EXTRACTION} "
                             f"saying what they are features of; {fix}")
        return
    found = json.loads(record.read_text())
    differences = description_differences(found, wanted)
    if differences:
        raise ValueError(f"offline feature store {directory} holds features of other settings (extracted for "
                         f"head={found.get('head_type', '?')}):\n  " + "\n  ".join(differences)
                         + f"\ntraining on them would be silently wrong: {fix}")


def prepare_offline_store(conf, target, train_split, feature_layers: list[int], pad_id: int, dist: ds.Dist) -> Path:
    """The offline feature store for this target + data + features config, extracting it first when incomplete
    (every rank extracts its share of shards; extraction resumes where a killed one stopped). A store of other
    settings is refused before any extraction."""
    tokenizer = target.tokenizer
    data_key = cache_key(conf.data, tokenizer)
    key = store_key(target.identity, tokenizer_fingerprint(tokenizer), data_key, feature_layers, conf.features.topk,
                    conf.features.dtype, conf.data.max_length)
    store = Path(conf.features.dir) if conf.features.dir else cache_dir() / "features" / key
    description = store_description(conf, target, data_key, feature_layers)
    check_store(store, description)
    if not store_complete(store):
        ds.barrier()  # every rank has checked the store before the main process marks it as this run's
        if dist.is_main:
            store.mkdir(parents=True, exist_ok=True)
            if not (store / EXTRACTION).is_file():
                write_json(store / EXTRACTION, description)
        extract_offline(target, train_split, store, feature_layers, conf.features.topk, conf.features.dtype,
                        conf.features.batch_size, pad_id, dist.rank, dist.world, conf.trainer.progress)
        ds.barrier()
        if dist.is_main:
            write_manifest(store, len(train_split), description)
        ds.barrier()
    return store
