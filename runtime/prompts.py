"""Benchmark and CLI prompts: MT-bench from its PyPI wheel, or a JSONL file; chat-template encoding."""

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
