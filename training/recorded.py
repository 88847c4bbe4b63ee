"""Features recorded while generating: self-distilled samples with the target's hidden states from the very passes
that generated them, so a head trains on them for several epochs without running the target again.

Self-distillation (training/selfdistill.py) verifies every reply token in a target pass, and that pass computes what
a head trains on: the last hidden state (EAGLE, Medusa, and the exact target logits through the LM head) and the
inputs of EAGLE-3's fused layers. With ``DistillSettings.features_dir`` the batched decoder keeps them
(``BatchedDecoder(record_layers=...)``) and they land here. A recorded store is a directory:

  recording.json   what the features are of (``RECORDING_SETTINGS``): written before the first shard; a resumed run
                   of other settings is refused, and so is a training run of another target or other layers;
  shard-NNNNNNN.safetensors   one per chunk of conversations, named by the chunk's first conversation id, written
                   atomically. Per sample (``c{conversation}.t{turn}``, one per regenerated assistant turn):
                   ``input_ids`` int32 [T] (the prompt through the chat template, then the reply's token ids as
                   generated, not re-tokenized), ``assistant_mask`` uint8 [T] (the reply), ``hidden`` [T', H] and,
                   when layers are recorded, ``layer_hidden`` [T', k*H]; T' = T, or T - 1 where the last token came
                   as a bonus and no pass ran on it (readers pad that row; no loss reads it).
A chunk generated again after a kill rewrites its shard under the same name, so no sample is counted twice.

``features.mode=recorded features.dir=DIR`` trains from a store: its samples are the data (``data.val_samples``
conversations held out, chosen by ``data.seed``; at most ``data.max_samples`` training samples; a sample longer
than ``data.max_length`` keeps its end; ``features.first_conversation``: only conversations from that id on), its
features the target's (in the dtype they were generated in).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from heads.layouts import safetensors_damage, save_tensors
from training.features import pad_features, write_json
from training.objectives import objective_class

RECORDING = "recording.json"
RECORDING_SETTINGS = ("target", "tokenizer", "feature_layers", "dtype", "chat_template", "max_length",
                      "generation")
SAMPLE = re.compile(r"^c(\d+)\.t(\d+)$")


def recorded_layers(head_conf, num_layers: int) -> list[int]:
    """The target layers whose inputs a store made for ``head_conf`` records: EAGLE-3's fused layers (its
    configured ones, else the default), none for EAGLE and Medusa (they read only the last hidden state): the head
    type's ``HeadObjective.feature_layers``."""
    return objective_class(head_conf.head_type).feature_layers(head_conf, num_layers)


def sample_key(conversation: int, turn: int) -> str:
    return f"c{conversation}.t{turn}"


def _key_order(key: str) -> tuple[int, int]:
    conversation, turn = SAMPLE.match(key).groups()
    return int(conversation), int(turn)


def recorded_sample(prompt: torch.Tensor, reply: list[int], features: dict[str, torch.Tensor],
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One sample of a store: prompt ids [P] + reply ids up to the token the last feature row predicts, with the
    reply's mask and the features in ``dtype``. The features cover all positions but the reply's last token when
    that token came as a pass's bonus (its own pass never ran); it stays in the ids, since the row before it holds
    the distribution that predicts it (often the end of the turn), and the readers pad the missing row."""
    count = features["hidden"].shape[0]
    ids = torch.cat([prompt.cpu(), torch.tensor(reply, dtype=torch.long)])[:count + 1]
    mask = torch.zeros(ids.numel(), dtype=torch.uint8)
    mask[prompt.numel():] = 1
    sample = {"input_ids": ids.to(torch.int32), "assistant_mask": mask}
    sample.update({name: value.to(dtype).contiguous() for name, value in features.items()})
    return sample


class RecordingWriter:
    """Writes a recorded store: ``description`` first (checked against one already there), then shards."""

    def __init__(self, directory: str | Path, description: dict):
        self.directory = Path(directory).expanduser()
        found = self.directory / RECORDING
        if found.is_file():
            differences = settings_differences(json.loads(found.read_text()), description)
            if differences:
                raise ValueError(f"{self.directory} holds features recorded with other settings:\n  "
                                 + "\n  ".join(differences) + "\nrecord into another directory, or rerun with the "
                                 "store's settings to continue it")
        elif self.directory.is_dir() and any(self.directory.iterdir()):
            raise ValueError(f"{self.directory} is not empty and holds no {RECORDING}: it is not a recorded store; "
                             f"record into a new or empty directory (nothing in it is touched)")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_json(found, description)

    def write_chunk(self, first_conversation: int, samples: dict[str, dict[str, torch.Tensor]]) -> None:
        """The samples of one chunk of conversations ({sample_key: sample}), as one atomic shard."""
        if not samples:
            return
        tensors = {f"{key}.{name}": value for key, sample in samples.items() for name, value in sample.items()}
        path = self.directory / f"shard-{first_conversation:07d}.safetensors"
        partial = path.with_name(path.name + ".partial")
        save_tensors(tensors, partial)
        os.replace(partial, path)  # a shard is whole or absent


def settings_differences(found: dict, wanted: dict) -> list[str]:
    """What differs between a store's description and this run's: the ``RECORDING_SETTINGS``, and where the
    conversations come from (a store grows by recording more of the same conversations, whose ids are their
    positions there: another source's conversation 0 would overwrite this one's shards)."""
    differences = [f"{key}: {found.get(key)!r} in the store, {wanted.get(key)!r} here" for key in RECORDING_SETTINGS
                   if found.get(key) != wanted.get(key)]
    for key in ("source", "path"):
        stored, here = (found.get("data") or {}).get(key), (wanted.get("data") or {}).get(key)
        if "data" in found and stored != here:
            differences.append(f"data.{key}: {stored!r} in the store, {here!r} here")
    return differences


def held_out_conversations(conversations: list[int], count: int, seed: int) -> set[int]:
    """The ``count`` conversation ids of ``conversations`` whose hash with ``seed`` ranks lowest.

    A store grows while a long run trains on it (recording and training take turns, ``resume=true``). Ranking by a
    hash keeps the choice stable under growth: a newly recorded conversation can only push a held-out one into
    training, never move one a run has trained on into the held-out set (its rank can only rise)."""
    def rank(conversation: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{conversation}".encode(), digest_size=8).digest()

    return set(sorted(conversations, key=rank)[:count])


class RecordedStore:
    """A recorded store, read: its description, its samples (sorted by conversation, then turn) and their features.

    max_length: a longer sample keeps its last ``max_length`` positions (its features were computed over the whole
    conversation, so they stay the target's)."""

    def __init__(self, directory: str | Path, max_length: int):
        self.directory = Path(directory).expanduser()
        record = self.directory / RECORDING
        if not record.is_file():
            raise FileNotFoundError(f"features.dir={directory} is not a recorded store (no {RECORDING}); record one "
                                    f"with scripts/prepare_data.py selfdistill --features DIR")
        self.description = json.loads(record.read_text())
        self.max_length = max_length
        self._shards: dict[str, Path] = {}  # sample key -> its shard
        self._names: dict[str, set[str]] = {}  # sample key -> its tensors
        for shard in sorted(self.directory.glob("shard-*.safetensors")):
            damage = safetensors_damage(shard)
            if damage:
                raise ValueError(f"the recorded store {self.directory} is damaged: {damage}. Delete that shard to "
                                 f"train on the others, or record the store anew")
            with safe_open(str(shard), framework="pt") as handle:
                names = handle.keys()
            for name in names:
                key, tensor = name.rsplit(".", 1)
                if self._shards.setdefault(key, shard) == shard:
                    self._names.setdefault(key, set()).add(tensor)
        self.keys = sorted((key for key in self._shards if SAMPLE.match(key)), key=_key_order)
        if not self.keys:
            raise ValueError(f"the recorded store {self.directory} holds no samples yet; record some first")
        self._handles: dict[Path, object] = {}

    def check(self, target_identity: str, tokenizer_fp: str | None, feature_layers: list[int]) -> None:
        """Refuse features of another target or tokenizer, or without the layers the head reads."""
        found = self.description
        problems = []
        if found.get("target") != target_identity:
            problems.append(f"target: {found.get('target')!r} in the store, {target_identity!r} in this run")
        if found.get("tokenizer") != tokenizer_fp:
            problems.append(f"tokenizer: {found.get('tokenizer')!r} in the store, {tokenizer_fp!r} in this run")
        if list(feature_layers) and list(found.get("feature_layers", [])) != list(feature_layers):
            problems.append(f"feature_layers: {found.get('feature_layers')!r} recorded, the head reads "
                            f"{list(feature_layers)!r}")
        if problems:
            raise ValueError(f"the recorded store {self.directory} cannot train this head:\n  " + "\n  ".join(problems)
                             + "\nrecord a store for this target and head (scripts/prepare_data.py selfdistill "
                               "--features DIR head=...), or point features.dir at one")

    def _handle(self, shard: Path):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(shard), framework="pt")
        return self._handles[shard]

    def _tensor(self, key: str, name: str) -> torch.Tensor:
        return self._handle(self._shards[key]).get_tensor(f"{key}.{name}")

    def _start(self, key: str) -> int:
        length = self._handle(self._shards[key]).get_slice(f"{key}.input_ids").get_shape()[0]
        return max(0, length - self.max_length)

    def tokens(self, key: str) -> dict[str, list]:
        """{"input_ids", "assistant_mask"} of sample ``key``, as the data pipeline gives a sample."""
        start = self._start(key)
        return {"input_ids": self._tensor(key, "input_ids")[start:].tolist(),
                "assistant_mask": self._tensor(key, "assistant_mask")[start:].bool().tolist()}

    def features(self, key: str) -> dict[str, torch.Tensor]:
        start = self._start(key)
        return {name: self._tensor(key, name)[start:] for name in ("hidden", "layer_hidden")
                if name in self._names[key]}

    def splits(self, val_samples: int, max_samples: int | None, seed: int, min_assistant_tokens: int,
               first_conversation: int = 0):
        """(DatasetDict "train"/"validation" of {"input_ids", "assistant_mask"}, the train samples' keys): the
        conversations from id ``first_conversation`` on, ``val_samples`` of them (all their turns) held out
        (``held_out_conversations``)."""
        from datasets import Dataset, DatasetDict

        keys = [key for key in self.keys if _key_order(key)[0] >= first_conversation]
        conversations = sorted({_key_order(key)[0] for key in keys})
        if len(conversations) <= val_samples:
            raise ValueError(f"the recorded store {self.directory} holds {len(conversations)} conversations from id "
                             f"{first_conversation} on (features.first_conversation); data.val_samples={val_samples} "
                             f"leaves none to train on: record more or lower it")
        held_out = held_out_conversations(conversations, val_samples, seed)
        split = {"train": [], "validation": []}
        for key in keys:
            sample = self.tokens(key)
            if sum(sample["assistant_mask"]) >= min_assistant_tokens:
                split["validation" if _key_order(key)[0] in held_out else "train"].append((key, sample))
        train = split["train"][:max_samples] if max_samples is not None else split["train"]
        if not train:
            raise ValueError(f"no sample of the recorded store {self.directory} has data.min_assistant_tokens="
                             f"{min_assistant_tokens} reply tokens outside the held-out conversations")
        datasets = DatasetDict({name: Dataset.from_list([sample for _, sample in samples])
                                for name, samples in (("train", train), ("validation", split["validation"]))})
        return datasets, [key for key, _ in train]


class RecordedFeatures:
    """The training split's features from a recorded store: ``batch`` as ``features.OfflineFeatures.batch``."""

    def __init__(self, store: RecordedStore, keys: list[str]):
        self.store, self.keys = store, keys

    def batch(self, indices: list[int], length: int, device, dtype) -> dict[str, torch.Tensor]:
        return pad_features([self.store.features(self.keys[i]) for i in indices], length, device, dtype)
