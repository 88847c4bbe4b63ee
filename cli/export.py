"""Export a trained head for a serving engine or the reference code, and optionally a Medusa-2 target with its LoRA
merged.

  python scripts/export.py runs/eagle3/head exported/eagle3 [--format sglang|vllm|reference|all] [--dtype bfloat16]
  python scripts/export.py runs/medusa/head exported/medusa --merged-target exported/target   # Medusa-2

--format (default: sglang for EAGLE and DFlash heads, vllm for Medusa) writes exactly what that reader loads:
  sglang     EAGLE-3 -> LlamaForCausalLMEagle3 (fc, midlayer.*, norm, lm_head, d2t, t2d); EAGLE-1 ->
             LlamaForCausalLMEagle (fc with bias, layers.{i}.*); DFlash -> DFlashDraftModel (fc, hidden_norm,
             layers.{i}.*, norm; dflash_config with mask_token_id and target_layer_ids; mask_embedding.pt, the
             head's mask embedding, which llama.cpp's converter reads), for a head over the whole vocabulary.
             SGLang has no Medusa: refused.
  vllm       EAGLE-3 as for SGLang, layer ids at the top level where vLLM reads them; EAGLE-1 -> LlamaForCausalLM
             (vLLM's EagleLlamaForCausalLM, whose fc has no bias: a head trained with one is refused); Medusa ->
             blocks.{h}.layers.{l}, lm_heads.{h} with medusa_fc_bias.
  reference  the EAGLE authors' code (config.json + pytorch_model.bin; EAGLE-3 with the default layers only) and
             FasterDecoding's Medusa (medusa_lm_head.pt); economize reads these too.
  all        one directory per format that can carry the head: OUT/sglang, OUT/vllm, OUT/reference.
  gguf       llama.cpp: OUT/draft.gguf (EAGLE-3 as arch eagle3, DFlash as dflash), with the target's tokenizer;
             --with-target also writes the target itself (OUT/target.gguf, llama family) in --dtype (default
             bfloat16), the very weights the runtime decodes with. Serve both:
               llama-server -m OUT/target.gguf -md OUT/draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 3
             (DFlash: --spec-type draft-dflash --spec-draft-n-max BLOCK-1)
EAGLE configs carry rope_theta beside rope_parameters (legacy readers default to 10000 without it). What each layout
holds and why: heads/formats.py.

A head directory in any of these layouts (or a published EAGLE-1/EAGLE-3/SpecForge/FasterDecoding Medusa head) loads
back with --head DIR in generate and benchmark, and with init_from=DIR in training.

Every export holds a marker file (headstart_export.json). OUT and --merged-target are replaced only when they are
missing, empty or an earlier export; anything else (a run directory, say) needs --force. A merged target records
which adapters it holds, so the runtime loads the Medusa-2 head with it: --target MERGED_DIR --head HEAD.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from heads.formats import EXPORT_FORMATS, export_refusal
from heads.export import (DRAFT_GGUF, TARGET_GGUF, default_export_format, export_all, export_destination_problem,
                          export_gguf, export_head, write_export)
from heads.gguf import GGUF_DTYPES, tokenizer_fields, tokenizer_fields_from_gguf
from heads.registry import head_class
from heads.io import MERGED_ADAPTERS_KEY, adapter_fingerprint, load_head, read_head_config, target_adapters
from runtime.target.model import parse_dtype, resolve_target

from cli.args import load_target_or_exit, usage_error


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head", type=Path, help="head directory written by training (OUTPUT_DIR/head)")
    parser.add_argument("out", type=Path, help="output directory (missing, empty or an earlier export)")
    parser.add_argument("--target", default=None, help="target name (default: the one the head was trained for)")
    parser.add_argument("--format", default=None, choices=(*EXPORT_FORMATS, "all", "gguf"),
                        help="the reader to write for (default: sglang for EAGLE heads, vllm for Medusa)")
    parser.add_argument("--dtype", default=None, help="cast weights (bfloat16, float16, float32)")
    parser.add_argument("--with-target", action="store_true",
                        help="--format gguf: also write the target as OUT/target.gguf (llama family)")
    parser.add_argument("--tokenizer-gguf", type=Path, default=None,
                        help="--format gguf: copy the tokenizer from this GGUF (default: the target's own GGUF, or "
                             "its HF tokenizer)")
    parser.add_argument("--merged-target", type=Path, default=None,
                        help="Medusa-2: also write the target with the head's LoRA adapters merged into this dir")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT and --merged-target even when they are not earlier exports")
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser.parse_args(argv)


def check_destinations(args) -> None:
    """Before anything loads: no output may hold the head being exported (not even with --force), the two outputs
    may not overlap, and each must be missing, empty or an earlier export unless --force."""
    head = args.head.resolve()
    outputs = {"OUT": args.out} | ({"--merged-target": args.merged_target} if args.merged_target else {})
    for flag, path in outputs.items():
        resolved = path.resolve()
        if resolved == head or resolved in head.parents:
            raise usage_error(flag, f"{path} holds the head directory {args.head}; replacing it would delete the "
                                    "head being exported. Choose another output directory")
        problem = None if args.force else export_destination_problem(path)
        if problem:
            raise usage_error(flag, f"{problem}. Choose a new or empty directory, or pass --force to replace it")
    if args.merged_target:
        out, merged = args.out.resolve(), args.merged_target.resolve()
        if out == merged or out in merged.parents or merged in out.parents:
            raise usage_error("--merged-target", f"{args.merged_target} and OUT ({args.out}) overlap; the head and "
                                                 "the merged target each need a directory of their own")


def check_head(args) -> tuple[dict, Path | None]:
    """The head's config and its Medusa-2 adapters (None for other heads), as command-line errors."""
    try:
        saved = read_head_config(args.head)
        adapters = target_adapters(args.head, saved)
    except (OSError, ValueError) as error:
        raise usage_error("HEAD", str(error)) from None
    if args.merged_target is not None and adapters is None:
        raise usage_error("--merged-target", f"{args.head} has no target LoRA adapters (training.target_lora); "
                                             "--merged-target is for Medusa-2 heads: drop it")
    if args.format == "gguf":
        problem = head_class(saved["head_type"]).gguf_refusal()
        if problem:
            raise usage_error("--format", problem)
        if args.dtype is not None and args.dtype not in GGUF_DTYPES:
            raise usage_error("--dtype", f"{args.dtype}: a GGUF holds {', '.join(GGUF_DTYPES)}")
        if args.tokenizer_gguf is not None and not args.tokenizer_gguf.is_file():
            raise usage_error("--tokenizer-gguf", f"{args.tokenizer_gguf}: no such file")
    elif args.with_target or args.tokenizer_gguf:
        raise usage_error("--with-target" if args.with_target else "--tokenizer-gguf", "is for --format gguf")
    if args.format not in (None, "all", "gguf"):
        layers = saved["target"].get("num_hidden_layers")
        problem = export_refusal(saved["head_type"], saved["head_config"], layers, args.format)
        if problem:
            raise usage_error("--format", problem)
    if args.dtype is not None:
        try:
            parse_dtype(args.dtype)
        except ValueError as error:
            raise usage_error("--dtype", str(error)) from None
    return saved, adapters


def write_merged_target(target, adapters: Path, out: Path, dtype, force: bool) -> None:
    """The target with ``adapters`` merged in, marked with their fingerprint for the runtime's check."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(target.model, str(adapters)).merge_and_unload()
    if dtype is not None:
        merged = merged.to(dtype)
    setattr(merged.config, MERGED_ADAPTERS_KEY, adapter_fingerprint(adapters))

    def fill(tmp: Path) -> None:
        merged.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)

    write_export(out, fill, "merged-target", force=force)


def write_gguf_export(args, head, target, name: str) -> int:
    """--format gguf: the draft (and with --with-target the target) for llama.cpp, and the command that serves them."""
    source = args.tokenizer_gguf or resolve_target(name)[1]
    try:
        tokenizer = tokenizer_fields_from_gguf(source) if source else tokenizer_fields(target.tokenizer)
        out = export_gguf(head, args.out, tokenizer, args.dtype or "bfloat16", force=args.force,
                          target_model=target.model if args.with_target else None)
    except ValueError as error:
        raise usage_error("--format", str(error)) from None
    served = out / TARGET_GGUF if args.with_target else "TARGET.gguf"
    print(f"exported the {head.head_type} head for llama.cpp to {out / DRAFT_GGUF}; serve it with:\n  llama-server "
          f"-m {served} -md {out / DRAFT_GGUF} --spec-type draft-{head.head_type} --spec-draft-n-max "
          f"{head.gguf_draft_max()}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    saved, adapters = check_head(args)
    check_destinations(args)
    name = args.target or saved["target"].get("identity")
    if not name:
        raise usage_error("--target", "the head does not record its target; name it with --target")
    target = load_target_or_exit(name, "--target" if args.target else "HEAD",
                                 trust_remote_code=args.trust_remote_code, attn_implementation="sdpa")
    try:
        head = load_head(args.head, target.model, identity=target.identity, tokenizer=target.tokenizer,
                         config=saved)
    except ValueError as error:  # trained for another target, or weights that do not match the config
        raise usage_error("--target" if args.target else "HEAD", str(error)) from None
    if args.format == "gguf":
        return write_gguf_export(args, head, target, name)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    if args.format == "all":
        for fmt, where in export_all(head, args.out, dtype, force=args.force, base_model=name).items():
            print(f"{fmt}: {where}")
    else:
        fmt = args.format or default_export_format(saved["head_type"])
        export_head(head, args.out, dtype, force=args.force, fmt=fmt, base_model=name)
        print(f"exported {saved['head_type']} head for {fmt} to {args.out}")
    if adapters is not None and args.merged_target is None:
        print(f"note: {args.head} was trained with LoRA adapters on its target (Medusa-2); serve it with the target "
              "they are merged into: add --merged-target DIR", file=sys.stderr)
    if args.merged_target is not None:
        write_merged_target(target, adapters, args.merged_target, dtype, args.force)
        print(f"merged target written to {args.merged_target}; run it with --target {args.merged_target} "
              f"--head {args.head}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
