"""Benchmark and CLI prompts: MT-bench from its PyPI wheel, or a JSONL file; chat-template encoding; batches."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.assets import MTBENCH_QUESTIONS, packaged_file


def read_prompts(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """[{"id", "prompt"}] from a JSONL file with a ``prompt`` field or MT-bench's ``turns`` (first turn is used).
    Without a path: the 80 MT-bench questions."""
    source = Path(path) if path is not None else packaged_file(MTBENCH_QUESTIONS)
    if not source.is_file():
        raise FileNotFoundError(f"prompts file not found: {source}")
    prompts = []
    for number, line in enumerate(source.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}:{number} is not valid JSON ({error.msg})") from None
        if "prompt" in record:
            text = record["prompt"]
        elif record.get("turns"):
            text = record["turns"][0]
        else:
            raise ValueError(f"{source}:{number} has neither a 'prompt' nor a 'turns' field")
        prompts.append({"id": record.get("id", record.get("question_id", len(prompts))), "prompt": text})
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def encode_prompt(tokenizer, text: str) -> torch.Tensor:
    """Token ids [P] of ``text`` as a user turn, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor(ids, dtype=torch.long).reshape(-1)
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def batch_pad_token_id(tokenizer) -> int:
    """The id ``encode_prompt_batch`` pads with: the tokenizer's pad token, else its end-of-sequence token."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError("the tokenizer has neither a pad token nor an end-of-sequence token to pad a batch with")


def encode_prompt_batch(tokenizer, prompts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """A left-padded batch of already formatted prompts for ``generate``: ``{"input_ids", "attention_mask"}``, each
    [B, T] long with T = min(longest prompt, ``max_length``).

    No special tokens are added (a chat template has put them in already). A prompt longer than ``max_length`` loses
    its start, not its end: the end is the generation prompt that the reply follows. Padding uses
    ``batch_pad_token_id(tokenizer)`` (the end-of-sequence token when there is no pad token). The tokenizer is not
    changed: padding and truncation are done here, not through its ``padding_side`` / ``truncation_side`` /
    ``pad_token`` settings.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][-max_length:] for text in prompts]
    width = max((len(row) for row in rows), default=0)
    pad = batch_pad_token_id(tokenizer)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            input_ids[index, width - len(row):] = torch.tensor(row, dtype=torch.long)
            attention_mask[index, width - len(row):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
