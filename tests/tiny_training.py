"""Tiny targets and conversation data for the training tests (built from configs; no downloads).

The target is a 2-layer Llama over a character-level tokenizer with a ChatML template, briefly trained on the
synthetic conversations so that its predictions are peaked (a head can then learn to agree with them quickly).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + " \n:.,?!")
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join without separators
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def conversations(count: int, seed: int = 0) -> list[dict]:
    """User asks to repeat a short word; the assistant repeats it several times (predictable text)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
        times = rng.randint(3, 6)
        out.append({"conversations": [{"from": "human", "value": f"repeat {word} {times} times"},
                                      {"from": "gpt", "value": " ".join([word] * times) + "."}]})
    return out


def build_tiny_target(directory: Path, hidden: int = 64, layers: int = 2, train_steps: int = 150,
                      seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = char_tokenizer()
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    assert len(tokenizer) <= config.vocab_size
    model = LlamaForCausalLM(config)
    if train_steps:
        texts = [tokenizer.apply_chat_template(
            [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
             for t in c["conversations"]], tokenize=False) for c in conversations(64, seed + 1)]
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(train_steps):
            batch = tokenizer(texts[(step * 8) % 64:(step * 8) % 64 + 8], return_tensors="pt", padding=True)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_conversations(path: Path, count: int, seed: int = 0) -> Path:
    path.write_text("\n".join(json.dumps(c) for c in conversations(count, seed)) + "\n")
    return path


def tiny_overrides(target_dir: Path, data_path: Path, output_dir: Path, head: str = "eagle", steps: int = 4,
                   extra: list[str] = ()) -> list[str]:
    """Config overrides for a fast run on the tiny target and data."""
    overrides = [f"head={head}", "target=hf", f"target.name={target_dir}", "data=json", f"data.path={data_path}",
                 "data.max_length=64", "data.val_samples=8", "data.cache=false", "tracker=disabled",
                 f"trainer.max_steps={steps}", "trainer.micro_batch_size=4", "trainer.warmup_steps=1",
                 "trainer.progress=false", "eval.every=1000", "eval.max_samples=8", "eval.depth=3",
                 "checkpoint.every=1000", f"output_dir={output_dir}"]
    if head == "eagle3":
        overrides += ["head.draft_vocab_size=32", "head.ttt_steps=3", "head.feature_layers=[0,1,1]"]
    if head == "medusa":
        overrides += ["head.num_heads=3"]
    if head == "dflash":
        overrides += ["head.draft_vocab_size=32", "head.block_size=4", "head.num_features=2", "head.num_anchors=8"]
    return overrides + list(extra)
