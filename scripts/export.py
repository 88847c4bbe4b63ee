"""Export a trained head for serving engines (DESIGN 4), and optionally a Medusa-2 target with its LoRA merged.

  python scripts/export.py runs/eagle3/head exported/eagle3 [--target smollm2-135m] [--dtype bfloat16]
  python scripts/export.py runs/medusa/head exported/medusa --merged-target exported/target   # Medusa-2

EAGLE-3 -> LlamaForCausalLMEagle3 (fc, midlayer.*, norm, lm_head, d2t, t2d); EAGLE-1 -> LlamaForCausalLMEagle
(fc, layers.0.*); Medusa -> vLLM's medusa layout (blocks.{h}.layers.{l}, lm_heads.{h}). SGLang and vLLM read the
same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from heads.io import atomic_directory, export_head, load_head, read_head_config
from runtime.target import load_target, parse_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", type=Path, help="head directory written by training (OUTPUT_DIR/head)")
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--target", default=None, help="target name (default: the one the head was trained for)")
    parser.add_argument("--dtype", default=None, help="cast weights (bfloat16, float16, float32)")
    parser.add_argument("--merged-target", type=Path, default=None,
                        help="Medusa-2: also write the target with the head's LoRA adapters merged into this dir")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args()

    saved = read_head_config(args.head)
    name = args.target or saved["target"].get("identity")
    if not name:
        raise SystemExit("the head does not record its target; pass --target")
    target = load_target(name, trust_remote_code=args.trust_remote_code, attn_implementation="sdpa")
    head = load_head(args.head, target.model, identity=target.identity, tokenizer=target.tokenizer)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    export_head(head, args.out, dtype)
    print(f"exported {saved['head_type']} head to {args.out}")
    if args.merged_target is not None:
        adapter = args.head / (saved["training"].get("target_lora") or "target_lora")
        if not adapter.is_dir():
            raise SystemExit(f"{args.head} has no LoRA adapters ({adapter}); --merged-target is for Medusa-2 heads")
        from peft import PeftModel

        merged = PeftModel.from_pretrained(target.model, str(adapter)).merge_and_unload()
        if dtype is not None:
            merged = merged.to(dtype)

        def fill(tmp: Path) -> None:
            merged.save_pretrained(tmp)
            target.tokenizer.save_pretrained(tmp)

        atomic_directory(args.merged_target, fill)
        print(f"merged target written to {args.merged_target}")


if __name__ == "__main__":
    main()
