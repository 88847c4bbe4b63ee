"""Prompts as the runtime sees them: chat-template encoding, left-padded batches, the seed of each sample, the chat
template's end-of-turn tokens, and the decoded text of a token stream. Reading prompt files (MT-bench, JSONL) is the
benchmark's: ``bench.prompts``."""

from __future__ import annotations

import hashlib

import torch

# End-of-turn markers of common chat templates (ChatML, Llama 3, Gemma, Phi-3): a reply ends with one of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>")


def prompt_seed(seed: int, prompt_index: int, sample_index: int = 0) -> int:
    """The random seed of sample ``sample_index`` of prompt ``prompt_index`` in a run seeded with ``seed``.

    Every (prompt, sample) gets its own stream, so a prompt repeated in a file, or drawn several times, gives
    independent samples, and the same run gives the same outputs. A hash, not ``seed + index``: with a sum, run 7's
    second prompt would replay run 8's first.
    """
    if prompt_index < 0 or sample_index < 0:
        raise ValueError(f"prompt_index and sample_index must be >= 0, got {prompt_index} and {sample_index}")
    digest = hashlib.blake2b(f"{int(seed)}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: within what torch.Generator.manual_seed takes


def end_of_turn_token_ids(tokenizer) -> set[int]:
    """The ids that end a reply: the tokenizer's end-of-sequence token and the end-of-turn markers its chat
    template writes (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...), each where it is a single token.

    A chat model ends its turn with the template's marker, which need not be its EOS token (Llama 3 ends turns with
    ``<|eot_id|>`` but its EOS is ``<|end_of_text|>``); decoding on past it writes the next turn.
    """
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # several named templates: look in all of them
        template = " ".join(template.values()) if isinstance(template, dict) else ""
    for marker in END_OF_TURN_TOKENS:
        if marker not in template:
            continue
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


class TextStream:
    """The decoded text of a growing list of tokens, handed out piece by piece as it is ready to show.

    Chunks are decoded together with everything before them: a character split across tokens (UTF-8 bytes) or a
    word whose spacing depends on the previous token decodes right only in context. A piece is held back while the
    text ends in an unfinished character, or while the text no longer extends what was shown.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = ""

    def push(self, tokens: list[int]) -> str:
        """Add accepted tokens; returns the new text ready to show (may be empty)."""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def finish(self) -> str:
        """The text not yet shown, once the stream has ended."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        piece = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        return piece


def encode_prompt(tokenizer, text: str, **template_variables) -> torch.Tensor:
    """Token ids [P] of ``text`` as a user turn, through the chat template when the tokenizer has one (rendered with
    ``template_variables``, such as a ``date_string``)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False, **template_variables)
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
    rows = [torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][-max_length:], dtype=torch.long)
            for text in prompts]
    input_ids, attention_mask = left_padded(rows, batch_pad_token_id(tokenizer))
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each [B, longest row] long on CPU: token-id rows (each [P]) aligned on the right,
    ``pad`` before them, the mask 1 over the real tokens."""
    width = max((row.numel() for row in rows), default=0)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - row.numel():] = row.cpu()
        attention_mask[index, width - row.numel():] = 1
    return input_ids, attention_mask
