"""One training run: target, data, head, features, DeepSpeed engine, the step loop, evaluation and checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from heads.common import frozen_target_weights, target_signature, tokenizer_fingerprint
from heads.eagle import EagleConfig, EagleHead, default_feature_layers
from heads.io import save_head
from heads.medusa import MedusaConfig, MedusaHeads
from runtime.target import load_target
from runtime.assets import cache_dir
from training import engine as ds
from training.config import TrainConfig, validate
from training.data import SampleOrder, cache_key, collate, load_splits
from training.draft_vocab import build_draft_vocab, count_tokens
from training.evaluate import eval_depth, evaluate, prepare_batch
from training.features import (OfflineFeatures, extract_offline, store_complete, store_key, target_features,
                               write_manifest)
from training.metrics import acceptance_rates
from training.objectives import HeadObjective
from training.tracking import Tracker


def build_head(conf: TrainConfig, target, train_split) -> torch.nn.Module:
    head_conf = conf.head
    embed, lm_head = frozen_target_weights(target.model)
    if head_conf.type == "eagle":
        return EagleHead(EagleConfig(kind="eagle", num_layers=head_conf.num_layers, fc_bias=True), target.config,
                         embed, lm_head)
    if head_conf.type == "eagle3":
        layers = resolve_feature_layers(conf, target.num_layers)
        if len(layers) != 3 or not all(0 <= i < target.num_layers for i in layers):
            raise ValueError(f"head.feature_layers={layers}: EAGLE-3 needs 3 layer indices in 0..{target.num_layers - 1}")
        vocab = target.vocab_size
        size = head_conf.draft_vocab_size
        if size > vocab:
            raise ValueError(f"head.draft_vocab_size={size} exceeds the target's vocabulary ({vocab}); use a smaller "
                             f"size or 0 for the whole vocabulary")
        head = EagleHead(EagleConfig(kind="eagle3", fc_bias=False, feature_layers=layers,
                                     draft_vocab_size=0 if size in (0, vocab) else size), target.config, embed, None)
        if 0 < size < vocab:
            counts = count_tokens(train_split["input_ids"], train_split["assistant_mask"], vocab)
            head.set_draft_vocab(*build_draft_vocab(counts, size))
        if head_conf.init_lm_head:
            final_norm = getattr(target.model.get_decoder(), "norm", None)
            head.init_output_from_target(lm_head, None if final_norm is None else final_norm.weight.detach())
        return head
    return MedusaHeads(MedusaConfig(num_heads=head_conf.num_heads, num_layers=head_conf.num_layers,
                                    shared_lm_head=head_conf.shared_lm_head), target.config, lm_head)


def initial_head(directory: str, built: torch.nn.Module, target) -> torch.nn.Module:
    """``init_from``: the head saved in ``directory`` (checked against the target) in place of a fresh one; its type
    and architecture must be the configured head's, draft vocabulary included (it comes with the weights)."""
    from heads.io import head_type_of, load_head

    loaded = load_head(directory, target.model, identity=target.identity, tokenizer=target.tokenizer)
    saved, wanted = dataclasses.asdict(loaded.config), dataclasses.asdict(built.config)
    if head_type_of(loaded) != head_type_of(built) or saved != wanted:
        raise ValueError(f"init_from={directory} holds a {head_type_of(loaded)} head with {saved}, but this run "
                         f"configures a {head_type_of(built)} head with {wanted}; set the head options to match it")
    return loaded.train()


def resolve_feature_layers(conf: TrainConfig, num_layers: int) -> list[int]:
    """The target layers whose inputs an EAGLE-3 head fuses (empty for the other heads)."""
    if conf.head.type != "eagle3":
        return []
    return list(conf.head.feature_layers) or default_feature_layers(num_layers)


def prepare_offline_store(conf: TrainConfig, target, train_split, feature_layers: list[int], pad_id: int,
                          dist: ds.Dist) -> Path:
    """The offline feature store for this target + data + features config, extracting it first when incomplete
    (every rank extracts its share of shards; extraction resumes where a killed one stopped)."""
    tokenizer = target.tokenizer
    data_key = cache_key(conf.data, tokenizer)
    key = store_key(target.identity, tokenizer_fingerprint(tokenizer), data_key, feature_layers, conf.features.topk,
                    conf.features.dtype, conf.data.max_length)
    store = Path(conf.features.dir) if conf.features.dir else cache_dir() / "features" / key
    if not store_complete(store):
        extract_offline(target, train_split, store, feature_layers, conf.features.topk, conf.features.dtype,
                        conf.features.batch_size, pad_id, dist.rank, dist.world, conf.trainer.progress)
        ds.barrier()
        if dist.is_main:
            write_manifest(store, len(train_split), {"target": target.identity, "feature_layers": feature_layers,
                                                      "topk": conf.features.topk, "data": data_key})
        ds.barrier()
    return store


def pad_token_id(tokenizer) -> int:
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)


def target_dtype(conf: TrainConfig, device: torch.device) -> str:
    if conf.target.dtype != "auto":
        return conf.target.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def load_target_once(conf: TrainConfig, dist: ds.Dist):
    """The main process loads first (it may dequantize a GGUF into the shared cache); the others then read it."""
    def load():
        return load_target(conf.target.name, dtype=target_dtype(conf, dist.device), device=dist.device,
                           trust_remote_code=conf.target.trust_remote_code, quiet=not dist.is_main)

    target = load() if dist.is_main else None
    ds.barrier()
    return target if target is not None else load()


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def rank_digests(module: torch.nn.Module, dist: ds.Dist) -> list[str]:
    """A hash of the trainable parameters as every rank holds them (ZeRO-3: gathered), in rank order."""
    import hashlib

    import torch.distributed as torch_dist

    digest = hashlib.sha256()
    with ds.full_parameters(module):
        for name, parameter in module.named_parameters():
            if parameter.requires_grad:
                digest.update(name.encode())
                digest.update(parameter.detach().float().cpu().numpy().tobytes())
    mine = digest.hexdigest()[:16]
    if dist.world == 1:
        return [mine]
    gathered: list = [None] * dist.world
    torch_dist.all_gather_object(gathered, mine)
    return gathered


def run(conf: TrainConfig) -> dict:
    validate(conf)
    dist = ds.setup_distributed(conf.trainer.device, conf.trainer.threads)
    run_dir = Path(conf.output_dir)
    checkpoint_root = run_dir / "checkpoints"
    if not conf.resume and ds.read_latest(checkpoint_root) is not None:
        raise ValueError(f"{run_dir} already holds a run (checkpoint at step {ds.read_latest(checkpoint_root)['step']}); "
                         f"pass resume=true to continue it, or choose another output_dir")
    ds.barrier()
    if dist.is_main:
        checkpoint_root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(conf.trainer.seed)

    target = load_target_once(conf, dist)
    tokenizer = target.tokenizer
    pad_id = pad_token_id(tokenizer)
    splits = load_splits(conf.data, tokenizer, dist.is_main, ds.barrier)
    train_split, val_split = splits["train"], splits["validation"]
    head = build_head(conf, target, train_split)
    if conf.init_from:
        head = initial_head(conf.init_from, head, target)
    feature_layers = head.feature_layers if conf.head.type == "eagle3" else []

    lora = getattr(conf.head, "lora", None)
    peft_model = None
    teacher_context = contextlib.nullcontext
    if lora is not None and lora.enabled:
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(target.model, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                                             lora_dropout=lora.dropout,
                                                             target_modules=list(lora.target_modules)))
        teacher_context = peft_model.disable_adapter  # the frozen base target teaches the heads
    objective = HeadObjective(head, conf.head, target.lm_head.weight, target.softcap,
                              lora_target=None if peft_model is None else peft_model.base_model.model, pad_id=pad_id)

    offline = None
    if conf.features.mode == "offline":
        store = prepare_offline_store(conf, target, train_split, feature_layers, pad_id, dist)
        offline = OfflineFeatures(store, len(train_split))

    head_conf = conf.head
    lr = conf.trainer.lr if conf.trainer.lr is not None else head_conf.lr
    ds_config = ds.deepspeed_config(conf, dist, lr, head_conf.betas, head_conf.weight_decay, head_conf.grad_clip)
    engine = ds.build_engine(objective, ds_config)
    compute_dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32

    start_step, history, tracker_id = 0, [], None
    if conf.resume:
        client = ds.load_checkpoint(engine, checkpoint_root)
        if client is not None:
            start_step, history, tracker_id = client["step"], client["history"], client.get("tracker_id")
    tracker = Tracker(conf.tracker, run_dir, dataclasses.asdict(conf), dist.is_main, tracker_id)
    signature = target_signature(target.model, target.identity, tokenizer)
    depth = eval_depth(conf.head, conf.eval)

    # ----- held-out batches: this rank's share plus batch 0 (what an idle rank repeats)
    val_rows = list(range(min(conf.eval.max_samples, len(val_split))))
    val_batches = [val_rows[i: i + conf.eval.batch_size] for i in range(0, len(val_rows), conf.eval.batch_size)]
    prepared: list[dict | None] = []

    def prepare_validation():
        prepared.clear()
        for index, rows in enumerate(val_batches):
            mine = index == 0 or index % dist.world == dist.rank
            batch = collate([val_split[i] for i in rows], pad_id) if mine else None
            prepared.append(None if batch is None else _cast(
                prepare_batch(target, batch, conf.head, conf.eval, feature_layers, teacher_context)))

    def _cast(batch):
        return {k: v.to(compute_dtype) if v.is_floating_point() else v for k, v in batch.items()}

    def run_evaluation(step: int) -> None:
        if not val_batches:
            return
        if not prepared or peft_model is not None:  # Medusa-2 changes the target: fresh branches every time
            prepare_validation()
        result = evaluate(engine.module, prepared, depth, dist.rank, dist.world, ds.all_reduce_sum)
        acc, tau = acceptance_rates(result["reached"])
        history.append({"step": step, "tau": tau, "val_loss": result["val_loss"], "acc": acc})
        if dist.is_main:
            tracker.log_evaluation(history, step)
            tqdm.write(f"[eval step {step}] tau {tau:.3f}  " + "  ".join(f"acc@{k} {a:.3f}"
                                                                         for k, a in enumerate(acc, 1)))

    def save(step: int) -> None:
        client = {"step": step, "history": history, "tracker_id": tracker.run_id}
        ds.save_checkpoint(engine, checkpoint_root, step, client, conf.checkpoint.keep, dist.is_main)
        with ds.full_parameters(engine.module):
            if dist.is_main:
                write_extra = None
                if peft_model is not None:
                    def write_extra(directory: Path) -> None:
                        peft_model.save_pretrained(str(directory / "target_lora"))
                tree = {"depth": depth}
                if history:  # Medusa calibrates its static tree from these; EAGLE reports them
                    tree["acceptance"] = history[-1]["acc"]
                save_head(engine.module.head, run_dir / "head", signature, tree=tree,
                          training={"step": step, "config": dataclasses.asdict(conf),
                                    "target_lora": "target_lora" if peft_model is not None else None},
                          write_extra=write_extra)
        ds.barrier()

    order = SampleOrder(len(train_split), conf.trainer.seed)
    micro, accumulation = conf.trainer.micro_batch_size, conf.trainer.grad_accum
    engine.train()
    if start_step == 0 and conf.eval.at_start:
        run_evaluation(0)
    end = conf.trainer.stop_after or conf.trainer.max_steps  # stop_after: a time-boxed part of a longer schedule
    bar = tqdm(total=end, initial=start_step, desc=f"train {conf.head.type}", unit="step",
               disable=not (dist.is_main and conf.trainer.progress), dynamic_ncols=True)
    step_rates = []
    for step in range(start_step, end):
        started = time.perf_counter()
        totals = torch.zeros(4, dtype=torch.float64)  # tokens, loss, acc, micro-batches
        for accumulation_index in range(accumulation):
            indices, first = order.micro_batch(step, accumulation_index, dist.rank, dist.world, micro, accumulation)
            batch = to_device(collate([train_split[i] for i in indices], pad_id), dist.device)
            if offline is not None:
                batch.update(offline.batch(indices, batch["input_ids"].shape[1], dist.device, compute_dtype))
            else:
                with teacher_context():
                    batch.update(target_features(target, batch["input_ids"], feature_layers))
            batch["noise_seed"] = conf.trainer.seed * 1_000_003 + first
            loss, stats = engine(batch)
            engine.backward(loss)
            engine.step()
            totals += torch.tensor([float(batch["lengths"].sum()), float(loss.detach()), float(stats["acc"]), 1.0],
                                   dtype=torch.float64)
        totals = ds.all_reduce_sum(totals.to(dist.device)).cpu()
        elapsed = time.perf_counter() - started
        rate = float(totals[0]) / elapsed
        step_rates.append(rate)
        mean_loss, mean_acc = float(totals[1] / totals[3]), float(totals[2] / totals[3])
        bar.set_postfix(loss=f"{mean_loss:.4f}", acc=f"{mean_acc:.3f}", tok_s=f"{rate:.0f}")
        bar.update(1)
        done = step + 1
        if dist.is_main:
            tracker.log({"train/loss": mean_loss, "train/acc": mean_acc, "train/tokens_per_s": rate,
                         "train/lr": engine.get_lr()[0]}, done)
        if done % conf.eval.every == 0 or done == end:
            run_evaluation(done)
        if done % conf.checkpoint.every == 0 or done == end:
            save(done)
    bar.close()
    if start_step >= end:  # resumed at the end (a killed run finished with stop_after): evaluate, write the head
        stale = not history or history[-1]["step"] != start_step
        if stale:
            run_evaluation(start_step)
        if stale or not (run_dir / "head").is_dir():
            save(start_step)
    digests = rank_digests(engine.module, dist)
    steady = step_rates[2:] or step_rates
    summary = {"head": conf.head.type, "features": conf.features.mode, "steps": max(start_step, end),
               "world_size": dist.world, "tokens_per_s_median": statistics.median(steady) if steady else None,
               "final_eval": history[-1] if history else None, "head_dir": str(run_dir / "head"),
               "rank_digests": digests}
    if dist.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        tracker.finish()
    ds.barrier()
    return summary
