"""The training recipe: one run of a draft head, read top to bottom as setup, train, evaluate, save, finish.

    summary = train(conf)    # what training/train.py runs on the config Hydra composed from conf/

setup     processes and devices; with resume=true the checkpoint to continue, checked before anything slow
          (training/checkpoints.py); the frozen target; the tokenized splits; the head (fresh, or ``init_from``) and
          its objective (Medusa-2: with LoRA adapters on the target); the offline feature store when asked for (or
          the recorded store, whose samples are then the data: training/recorded.py); the
          DeepSpeed engine (ZeRO 0-3); the progress of a resumed run; the tracker.
train     the optimizer steps: micro-batches in a fixed global sample order, target features (a frozen forward, or
          the offline store), the loss, DeepSpeed's backward and step; evaluation and checkpoints on their cadence.
          A run resumed at its end (stop_after) only evaluates and writes the head.
evaluate  acceptance of the head on the held-out split (acc@k, tau), appended to the history and tracked; the head
          drafts inside the engine module's forward, as in training (ZeRO-3 gathers its parameters there).
save      a DeepSpeed checkpoint (what resume=true reads), then the head directory (atomic; what the runtime loads).
finish    rank digests (every rank must hold the same head) and summary.json.

A run's state lives on the recipe (the annotations of ``TrainRecipe``): what setup builds, and the progress
(``step``, ``history``, ``step_rates``) that train, evaluate and save advance and checkpoints carry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from heads.common import frozen_target_weights, target_signature, tokenizer_fingerprint
from heads.formats import load_any_head
from heads.io import save_head
from heads.registry import build_head, head_class
from runtime.target.model import Target, load_target
from training import checkpoints
from training import engine as ds
from training.config import TrainConfig, validate
from training.data import SampleOrder, collate, load_splits, pad_token_id
from training.evaluate import eval_depth, evaluate_acceptance, evaluation_batches, prepare_batch
from training.features import OfflineFeatures, prepare_offline_store, target_features
from training.metrics import acceptance_rates
from training.objectives import HeadObjective, build_objective, objective_class
from training.recorded import RecordedFeatures, RecordedStore
from training.tracking import Tracker


def train(conf: TrainConfig, on_claimed: Callable[[Path], None] | None = None) -> dict:
    """One training run of ``conf`` -> its summary (also written to OUTPUT_DIR/summary.json). ``on_claimed(run_dir)``
    runs on the main process once the run directory is this run's (a new one, or the run ``resume=true``
    continues with its checkpoint chosen): what records the command there (training/train.py: Hydra's files)."""
    recipe = TrainRecipe(conf, on_claimed)
    recipe.setup()
    recipe.train()
    return recipe.finish()


class TrainRecipe:
    """One training run of ``conf``: ``setup()``, ``train()``, then ``finish()`` (``train(conf)`` does all three)."""

    # ----- built by setup()
    dist: ds.Dist
    target: Target
    pad_id: int
    train_split: object  # datasets.Dataset of {"input_ids", "assistant_mask"}
    val_batches: list[list[dict]]  # held-out samples (the first eval.max_samples), batch by batch
    lora_model: object | None  # Medusa-2: the peft-wrapped target whose adapters train
    objective: HeadObjective  # the head and its loss; the module DeepSpeed wraps
    feature_layers: list[int]  # target layers whose inputs the head reads (EAGLE-3), else []
    offline: OfflineFeatures | RecordedFeatures | None  # features.mode=offline or recorded: the store
    engine: object  # deepspeed.DeepSpeedEngine around the objective
    compute_dtype: torch.dtype
    tracker: Tracker
    signature: dict  # the target the head is trained for (saved with it)
    depth: int  # draft steps an evaluation checks

    def __init__(self, conf: TrainConfig, on_claimed: Callable[[Path], None] | None = None):
        validate(conf)
        self.conf = conf
        self.on_claimed = on_claimed
        self.run_dir = Path(conf.output_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        # ----- progress: optimizer steps done, tokens trained on (all ranks), evaluations so far, tokens/s of the
        # steps this process ran
        self.step = 0
        self.tokens = 0
        self.history: list[dict] = []
        self.step_rates: list[float] = []
        self.val_prepared: list[dict | None] = []  # this rank's held-out batches with features and branches

    # ----- setup

    def setup(self) -> None:
        conf = self.conf
        self.dist = ds.setup_distributed(conf.trainer.device, conf.trainer.threads)
        self.claim_run_dir()
        resume_tag = self.choose_checkpoint()
        if self.on_claimed is not None and self.dist.is_main:
            self.on_claimed(self.run_dir)
        torch.manual_seed(conf.trainer.seed)

        recorded = None  # features.mode=recorded: the store, opened (and checked) before anything slow
        if conf.features.mode == "recorded":
            recorded = RecordedStore(conf.features.dir, conf.data.max_length)
        self.target = load_target_once(conf, self.dist)
        self.pad_id = pad_token_id(self.target.tokenizer)
        if recorded is not None:  # the store's samples are the data
            recorded.check(self.target.identity, tokenizer_fingerprint(self.target.tokenizer), [])
            data = conf.data
            splits, recorded_keys = recorded.splits(data.val_samples, data.max_samples, data.seed,
                                                    data.min_assistant_tokens, conf.features.first_conversation)
        else:
            splits = load_splits(conf.data, self.target.tokenizer, self.dist.is_main, ds.barrier)
        self.train_split = splits["train"]
        self.val_batches = evaluation_batches(splits["validation"], conf.eval)

        head = training_head(conf.head, self.target, self.train_split)
        if conf.init_from:
            head = saved_head(conf.init_from, head, self.target)
        self.feature_layers = head.feature_layers
        self.lora_model = self.setup_lora()
        lora_target = None if self.lora_model is None else self.lora_model.base_model.model
        self.objective = build_objective(head, conf.head, self.target.lm_head.weight, self.target.softcap,
                                         lora_target=lora_target, pad_id=self.pad_id)
        self.offline = None
        if conf.features.mode == "offline":
            store = prepare_offline_store(conf, self.target, self.train_split, self.feature_layers, self.pad_id,
                                          self.dist)
            self.offline = OfflineFeatures(store, len(self.train_split))
        elif recorded is not None:
            recorded.check(self.target.identity, tokenizer_fingerprint(self.target.tokenizer), self.feature_layers)
            self.offline = RecordedFeatures(recorded, recorded_keys)

        self.engine, self.compute_dtype = self.setup_engine()
        tracker_id = self.restore_checkpoint(resume_tag) if resume_tag else None
        self.tracker = Tracker(conf.tracker, self.run_dir, dataclasses.asdict(conf), self.dist.is_main, tracker_id)
        self.signature = target_signature(self.target.model, self.target.identity, self.target.tokenizer)
        self.depth = eval_depth(conf.head, conf.eval)

    def claim_run_dir(self) -> None:
        """A run directory holds one run: continuing one needs resume=true. A run's head or summary counts too (its
        checkpoints may have been deleted to free space; a new run would overwrite the trained head)."""
        if not self.conf.resume and checkpoints.holds_run(self.checkpoints):
            raise ValueError(f"{self.run_dir} already holds a run (checkpoints in {self.checkpoints}); pass "
                             f"resume=true to continue it, or choose another output_dir")
        finished = [name for name in ("head", "summary.json") if (self.run_dir / name).exists()]
        if finished and not checkpoints.holds_run(self.checkpoints):
            raise ValueError(f"{self.run_dir} already holds a trained run ({', '.join(finished)}, no checkpoints to "
                             f"resume from); choose another output_dir (init_from={self.run_dir / 'head'} starts "
                             f"from its head)")
        ds.barrier()
        if self.dist.is_main:
            self.checkpoints.mkdir(parents=True, exist_ok=True)

    def setup_lora(self):
        """Medusa-2 (head.lora.enabled): LoRA adapters on the target, trained with the heads; None otherwise."""
        lora = getattr(self.conf.head, "lora", None)
        if lora is None or not lora.enabled:
            return None
        from peft import LoraConfig, get_peft_model

        return get_peft_model(self.target.model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                            target_modules=list(lora.target_modules)))

    def teacher(self):
        """Context for the target's features: Medusa-2's frozen base target (adapters off) teaches the heads."""
        return contextlib.nullcontext() if self.lora_model is None else self.lora_model.disable_adapter()

    def setup_engine(self):
        """(DeepSpeed engine around the objective, the dtype batches are computed in)."""
        conf, head_conf = self.conf, self.conf.head
        lr = conf.trainer.lr if conf.trainer.lr is not None else head_conf.lr
        ds_config = ds.deepspeed_config(conf, self.dist, lr, head_conf.betas, head_conf.weight_decay,
                                        head_conf.grad_clip)
        engine = ds.build_engine(self.objective, ds_config)
        return engine, torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32

    def choose_checkpoint(self) -> str | None:
        """resume=true: the tag to continue (intact, safe, saved with this run's head and target settings; see
        training/checkpoints.py), chosen before the slow setup; None (said) when there is none."""
        if not self.conf.resume:
            return None
        tag = checkpoints.choose_checkpoint(self.checkpoints, dataclasses.asdict(self.conf), self.dist)
        if tag is None and self.dist.is_main:
            warnings.warn(f"resume=true, but {self.checkpoints} holds no complete checkpoint: training starts at "
                          f"step 0", stacklevel=2)
        return tag

    def restore_checkpoint(self, tag: str) -> str | None:
        """The engine state and progress of checkpoint ``tag``; returns its tracker run id."""
        client = checkpoints.load_tag(self.engine, self.checkpoints, tag)
        self.step, self.history = client["step"], client["history"]
        self.tokens = client.get("tokens", 0)
        return client.get("tracker_id")

    # ----- train

    def train(self) -> None:
        conf = self.conf
        order = SampleOrder(len(self.train_split), conf.trainer.seed)
        start = self.step
        end = conf.trainer.stop_after or conf.trainer.max_steps  # stop_after: a time-boxed part of a longer schedule
        self.engine.train()
        if start == 0 and conf.eval.at_start:
            self.evaluate()
        bar = tqdm(total=end, initial=start, desc=f"train {conf.head.head_type}", unit="step",
                   disable=not (self.dist.is_main and conf.trainer.progress), dynamic_ncols=True)
        for step in range(start, end):
            loss, acc, rate, tokens = self.train_step(order, step)
            self.step = step + 1
            self.tokens += tokens
            self.step_rates.append(rate)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", tok_s=f"{rate:.0f}")
            bar.update(1)
            if self.dist.is_main:
                self.tracker.log({"train/loss": loss, "train/acc": acc, "train/tokens_per_s": rate,
                                  "train/lr": self.engine.get_lr()[0]}, self.step)
            if self.step % conf.eval.every == 0 or self.step == end:
                self.evaluate()
            if self.step % conf.checkpoint.every == 0 or self.step == end:
                self.save()
        bar.close()
        if start >= end:  # resumed at the end (a killed run finished with stop_after): evaluate, write the head
            stale = not self.history or self.history[-1]["step"] != self.step
            if stale:
                self.evaluate()
            if stale or not (self.run_dir / "head").is_dir():
                self.save()

    def train_step(self, order: SampleOrder, step: int) -> tuple[float, float, float, int]:
        """Optimizer step ``step``: grad_accum micro-batches on every rank -> (mean loss, mean acc, tokens/s,
        tokens)."""
        trainer, dist = self.conf.trainer, self.dist
        started = time.perf_counter()
        totals = torch.zeros(4, dtype=torch.float64)  # tokens, loss, acc, micro-batches
        for accumulation_index in range(trainer.grad_accum):
            indices, first = order.micro_batch(step, accumulation_index, dist.rank, dist.world,
                                               trainer.micro_batch_size, trainer.grad_accum)
            batch = self.training_batch(indices)
            batch["noise_seed"] = trainer.seed * 1_000_003 + first
            loss, stats = self.engine(batch)
            self.engine.backward(loss)
            self.engine.step()
            totals += torch.tensor([float(batch["lengths"].sum()), float(loss.detach()), float(stats["acc"]), 1.0],
                                   dtype=torch.float64)
        totals = ds.all_reduce_sum(totals.to(dist.device)).cpu()
        rate = float(totals[0]) / (time.perf_counter() - started)
        return float(totals[1] / totals[3]), float(totals[2] / totals[3]), rate, int(totals[0])

    def training_batch(self, indices: list[int]) -> dict:
        """Training samples ``indices``, padded, on this process's device, with their target features."""
        device = self.dist.device
        batch = to_device(collate([self.train_split[i] for i in indices], self.pad_id), device)
        if self.offline is not None:
            batch.update(self.offline.batch(indices, batch["input_ids"].shape[1], device, self.compute_dtype))
        else:
            with self.teacher():
                features = target_features(self.target, batch["input_ids"], self.feature_layers)
            # the target computes in its own dtype (fp32 on a CPU by default); the head trains in the engine's
            batch.update(to_dtype(features, self.compute_dtype))
        return batch

    # ----- evaluate

    def evaluate(self) -> None:
        """Acceptance of the head as it is at ``self.step`` on the held-out split, appended to the history."""
        if not self.val_batches:
            return
        if not self.val_prepared or self.lora_model is not None:  # Medusa-2 changes the target: fresh branches
            self.val_prepared = self.prepare_validation()
        dist = self.dist
        result = evaluate_acceptance(self.engine.module, self.val_prepared, self.depth, dist.rank, dist.world,
                                     ds.all_reduce_sum)
        acc, tau = acceptance_rates(result["reached"])
        self.history.append({"step": self.step, "tokens": self.tokens, "tau": tau, "val_loss": result["val_loss"],
                             "acc": acc, "decoding_tau": result["decoding_tau"]})
        if dist.is_main:
            self.tracker.log_evaluation(self.history, self.step)
            tqdm.write(f"[eval step {self.step}] tau {tau:.3f} (decoding {result['decoding_tau']:.3f})  "
                       + "  ".join(f"acc@{k} {a:.3f}" for k, a in enumerate(acc, 1)))

    def prepare_validation(self) -> list[dict | None]:
        """Target features and greedy branches of this rank's share of the held-out batches, plus batch 0 (what an
        idle rank repeats); None for the other ranks' batches."""
        dist, prepared = self.dist, []
        for index, samples in enumerate(self.val_batches):
            if index != 0 and index % dist.world != dist.rank:
                prepared.append(None)
                continue
            batch = prepare_batch(self.target, collate(samples, self.pad_id), self.conf.head, self.conf.eval,
                                  self.feature_layers, self.teacher)
            prepared.append(to_dtype(batch, self.compute_dtype))
        return prepared

    # ----- save

    def save(self) -> None:
        """A DeepSpeed checkpoint of step ``self.step`` (every rank's shard), then the head directory (main)."""
        dist = self.dist
        client = {"step": self.step, "tokens": self.tokens, "history": self.history,
                  "tracker_id": self.tracker.run_id}
        checkpoints.save_checkpoint(self.engine, self.checkpoints, self.step, client, dataclasses.asdict(self.conf),
                                    self.conf.checkpoint.keep, dist.is_main)
        with ds.full_parameters(self.engine.module):
            if dist.is_main:
                self.write_head()
        ds.barrier()

    def write_head(self) -> None:
        """OUTPUT_DIR/head, atomically: weights, the target signature, tree defaults, how it was trained (and the
        Medusa-2 target adapters)."""
        lora_model = self.lora_model
        tree = {"depth": self.depth}
        if self.history:  # Medusa calibrates its static tree from these; EAGLE reports them
            tree["acceptance"] = self.history[-1]["acc"]
        training = {"step": self.step, "config": dataclasses.asdict(self.conf),
                    "target_lora": "target_lora" if lora_model is not None else None}

        def write_extra(directory: Path) -> None:
            lora_model.save_pretrained(str(directory / "target_lora"))

        save_head(self.engine.module.head, self.run_dir / "head", self.signature, tree=tree, training=training,
                  write_extra=None if lora_model is None else write_extra)

    # ----- finish

    def finish(self) -> dict:
        """Rank digests and summary.json (main process); every rank returns the summary."""
        conf, dist = self.conf, self.dist
        digests = rank_digests(self.engine.module)
        steady = self.step_rates[2:] or self.step_rates
        summary = {"head": conf.head.head_type, "features": conf.features.mode, "steps": self.step,
                   "world_size": dist.world, "tokens_per_s_median": statistics.median(steady) if steady else None,
                   "final_eval": self.history[-1] if self.history else None, "head_dir": str(self.run_dir / "head"),
                   "rank_digests": digests}
        if dist.is_main:
            checkpoints.write_json_atomic(self.run_dir / "summary.json", summary)
            self.tracker.finish()
        ds.barrier()
        return summary


# ----- the head a run trains

def training_head(head_conf, target: Target, train_split) -> nn.Module:
    """The untrained head of ``conf.head``, attached to the target's frozen weights.

    Its architecture is the head type's ``config_class`` with each field read from ``conf.head`` by name; the rest
    is the head type's own setup (``HeadObjective.setup_head``: EAGLE-3's draft vocabulary from the training split
    and, with ``init_lm_head``, the target's LM head rows and final norm; Medusa's own LM heads start as the
    target's).
    """
    config_class = head_class(head_conf.head_type).config_class
    options = {field.name: getattr(head_conf, field.name) for field in dataclasses.fields(config_class)
               if hasattr(head_conf, field.name)}
    if options.get("draft_vocab_size") == target.vocab_size:
        options["draft_vocab_size"] = 0  # the whole vocabulary is no draft vocabulary
    try:
        head = build_head(head_conf.head_type, options, target.config)
    except ValueError as error:
        raise ValueError(f"head={head_conf.head_type} with {options}: {error}") from None
    head.attach_target_weights(*frozen_target_weights(target.model))
    objective_class(head.head_type).setup_head(head, head_conf, target, train_split)
    return head


def saved_head(directory: str, built: nn.Module, target: Target) -> nn.Module:
    """``init_from``: the head saved in ``directory`` (checked against the target) in place of a fresh one; its type
    and architecture must be the configured head's, draft vocabulary included (it comes with the weights). Any layout
    ``heads.formats.load_any_head`` reads will do: our head directories and exports, published EAGLE-1/EAGLE-3
    (the EAGLE authors', SpecForge's) and FasterDecoding Medusa heads."""
    loaded, _ = load_any_head(directory, target.model, identity=target.identity, tokenizer=target.tokenizer)
    saved, wanted = dataclasses.asdict(loaded.config), dataclasses.asdict(built.config)
    if loaded.head_type != built.head_type or saved != wanted:
        raise ValueError(f"init_from={directory} holds a {loaded.head_type} head with {saved}, but this run "
                         f"configures a {built.head_type} head with {wanted}; set the head options to match it")
    return loaded.train()


# ----- the target, offline features

def target_dtype(conf: TrainConfig, device: torch.device) -> str:
    """target.dtype, where auto is bfloat16 on a GPU and float32 on a CPU."""
    if conf.target.dtype != "auto":
        return conf.target.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def load_target_once(conf: TrainConfig, dist: ds.Dist) -> Target:
    """The main process loads first (it may dequantize a GGUF into the shared cache); the others then read it."""
    def load():
        return load_target(conf.target.name, dtype=target_dtype(conf, dist.device), device=dist.device,
                           trust_remote_code=conf.target.trust_remote_code, quiet=not dist.is_main)

    target = load() if dist.is_main else None
    ds.barrier()
    return target if target is not None else load()


def prepare_features(conf: TrainConfig) -> dict:
    """Fill the offline feature store that a ``features.mode=offline`` run of ``conf`` reads (every rank extracts
    its share) -> {"store": directory, "samples": training samples, "is_main": whether this is the main process}."""
    validate(conf)
    dist = ds.setup_distributed(conf.trainer.device, conf.trainer.threads)
    target = load_target_once(conf, dist)
    train_split = load_splits(conf.data, target.tokenizer, dist.is_main, ds.barrier)["train"]
    feature_layers = training_head(conf.head, target, train_split).feature_layers  # as the run's head reads them
    store = prepare_offline_store(conf, target, train_split, feature_layers, pad_token_id(target.tokenizer), dist)
    return {"store": store, "samples": len(train_split), "is_main": dist.is_main}


# ----- small helpers

def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_dtype(batch: dict, dtype: torch.dtype) -> dict:
    """``batch`` with its floating-point tensors in ``dtype`` (the head's compute dtype); ids and masks as they are."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def rank_digests(module: nn.Module) -> list[str]:
    """A hash of the trainable parameters as every rank holds them (ZeRO-3: gathered), in rank order."""
    digest = hashlib.sha256()
    with ds.full_parameters(module):
        for name, parameter in module.named_parameters():
            if parameter.requires_grad:
                digest.update(name.encode())
                digest.update(parameter.detach().float().cpu().numpy().tobytes())
    return ds.all_gather_object(digest.hexdigest()[:16])
