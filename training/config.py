"""The typed training configuration (Hydra structured configs), composed from conf/ in one place.

Groups: head (eagle, eagle3, medusa, dflash), target, data, deepspeed, tracker. Every group file starts from a schema,
so an unknown key or a wrong type fails at composition with Hydra's error naming the key: the schemas below, and each
head type's own (its objective's ``conf_class``: training/objectives/).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from heads.registry import HEAD_TYPES
from training.objectives import OBJECTIVES

CONFIG_NAME = "train"


def find_config_dir(package_dir: Path) -> Path:
    """The directory holding train.yaml and its groups: ``conf`` inside the package (where a wheel installs the
    checkout's top-level conf/), else the top-level conf/ beside the package (a checkout or an editable install)."""
    candidates = (package_dir / "conf", package_dir.parent / "conf")
    for candidate in candidates:
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"no {CONFIG_NAME}.yaml in {' or '.join(str(c) for c in candidates)}: the training "
                            f"configs are missing from this install; reinstall headstart (pip install .) from a "
                            f"checkout that has conf/")


CONFIG_DIR = str(find_config_dir(Path(__file__).resolve().parent))


@dataclass
class TargetConf:
    name: str | None = "smollm2-135m"  # alias, HF id, local directory or .gguf file
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    trust_remote_code: bool = False


@dataclass
class DataConf:
    source: str = "sharegpt"  # sharegpt | json | hf
    path: str | None = None  # json: file; hf: dataset id; sharegpt: another copy of the file (default: packaged)
    split: str = "train"
    subset: str | None = None
    max_samples: int | None = None  # training conversations (null: all)
    val_samples: int = 32  # held-out conversations for evaluation
    max_length: int = 512
    min_assistant_tokens: int = 2
    chat_template: str | None = None  # null: the tokenizer's; "chatml"; or a Jinja string
    seed: int = 0
    cache: bool = True


@dataclass
class FeaturesConf:
    # online: frozen target forward inside each step; offline: read dumped features; recorded: train on a store
    # recorded while self-distilling (its samples are the data; training/recorded.py)
    mode: str = "online"
    dir: str | None = None  # offline store (default: the cache directory, keyed by target + data + layers); recorded
    # store (required)
    topk: int = 0  # offline: store the target's top-k log-probs (0: recompute exact logits from the stored hidden)
    dtype: str = "float32"  # storage dtype of offline hidden states
    batch_size: int = 8  # extraction batch
    # recorded: train and hold out only the store's conversations from this id on (a grown store's new part, which a
    # head continued from an earlier stage on the same store never saw)
    first_conversation: int = 0


@dataclass
class DeepSpeedConf:
    stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False  # ZeRO-3 only
    # ZeRO-3 only: parameters of at most this many elements stay whole on every rank instead of partitioned (null:
    # DeepSpeed's default, 100000); 0 partitions every parameter, as a large target's head is
    param_persistence_threshold: int | None = None


@dataclass
class TrackerConf:
    kind: str = "wandb"  # wandb | disabled
    mode: str = "offline"
    project: str = "headstart"
    name: str | None = None


@dataclass
class TrainerConf:
    max_steps: int = 1000  # optimizer steps; the learning-rate schedule spans them
    stop_after: int | None = None  # end the run (final evaluation, head) after this many steps, schedule unchanged
    micro_batch_size: int = 4  # per process
    grad_accum: int = 1
    lr: float | None = None  # null: the head's default
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    seed: int = 0
    device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    threads: int | None = None  # torch CPU threads per process
    progress: bool = True


@dataclass
class EvalConf:
    every: int = 100
    depth: int = 5  # draft steps K of the acceptance chain (Medusa: its heads)
    max_samples: int = 16  # held-out conversations evaluated
    batch_size: int = 4
    at_start: bool = True  # evaluate the untrained head too (the baseline of the curves)


@dataclass
class CheckpointConf:
    every: int = 200
    keep: int = 2


@dataclass
class TrainConfig:
    head: Any = MISSING
    target: TargetConf = field(default_factory=TargetConf)
    data: DataConf = field(default_factory=DataConf)
    features: FeaturesConf = field(default_factory=FeaturesConf)
    deepspeed: DeepSpeedConf = field(default_factory=DeepSpeedConf)
    tracker: TrackerConf = field(default_factory=TrackerConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    eval: EvalConf = field(default_factory=EvalConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    output_dir: str = "runs/${head.head_type}"
    resume: bool = False
    init_from: str | None = None  # a head directory whose weights start this run (continue training a head)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for head_type, objective in OBJECTIVES.items():  # conf/head/NAME.yaml starts from schema_NAME
        store.store(group="head", name=f"schema_{head_type}", node=objective.conf_class)
    for group, node in (("target", TargetConf), ("data", DataConf), ("deepspeed", DeepSpeedConf),
                        ("tracker", TrackerConf)):
        store.store(group=group, name=f"schema_{group}", node=node)


def compose_config(overrides: list[str] = ()) -> TrainConfig:
    """Compose conf/train.yaml with overrides (tests, scripts) into the typed config object."""
    return compose_many([overrides])[0]


def compose_many(override_lists: list[list[str]]) -> list[TrainConfig]:
    """Compose several override lists under one Hydra initialisation. A key the typed config does not know is a
    ValueError naming it and the keys of its section, with or without ``+`` (Hydra's own error suggests ``+key``,
    which it then accepts and the typed config drops)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        configs = []
        for overrides in override_lists:
            try:
                composed = compose(config_name=CONFIG_NAME, overrides=list(overrides))
            except ConfigCompositionException as error:
                key = re.search(r"Could not override '([^']+)'", str(error))
                if key is None:
                    cause = str(error.__cause__).splitlines()[0] if error.__cause__ else ""
                    raise ValueError(f"the overrides {list(overrides)} do not compose: {error}"
                                     + (f" ({cause})" if cause else "")) from None
                base = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key[1]]
                raise ValueError(unknown_key_message(key[1], compose(config_name=CONFIG_NAME,
                                                                     overrides=base))) from None
            configs.append(to_typed(composed))
        return configs


def to_typed(config) -> TrainConfig:
    """The composed config as typed objects; a key the schema does not know (``+key=value``) is a ValueError rather
    than a setting silently dropped."""
    from omegaconf import OmegaConf

    unknown = unknown_keys(config)
    if unknown:
        raise ValueError(unknown_key_message(unknown[0], config))
    return OmegaConf.to_object(config)


def unknown_keys(config, prefix: str = "") -> list[str]:
    """Dotted keys of ``config`` (a composed DictConfig) that its typed sections have no field for."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(config)
    names = {item.name for item in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    found = []
    for key in config.keys():
        if names is not None and key not in names:
            found.append(f"{prefix}{key}")
            continue
        child = config._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def unknown_key_message(key: str, config) -> str:
    """What to say about ``key`` (dotted) that the typed config lacks: the keys its section has, the closest one."""
    from omegaconf import OmegaConf

    section, _, name = key.rpartition(".")
    node = OmegaConf.select(config, section) if section else config
    schema = OmegaConf.get_type(node) if node is not None else None
    if dataclasses.is_dataclass(schema):
        known = sorted(item.name for item in dataclasses.fields(schema))
    else:
        known = sorted(str(k) for k in node.keys() if k != name) if hasattr(node, "keys") else []
    close = difflib.get_close_matches(name, known, n=1)
    where = f"{section} has" if section else "the top level has"
    hint = f"; did you mean {section + '.' if section else ''}{close[0]}?" if close else "."
    return (f"{key} is not a training setting ({where} {', '.join(known)}){hint} The settings are typed: an unknown "
            f"key is refused, with or without '+', rather than dropped")


def validate(config: TrainConfig) -> None:
    """Value checks Hydra's types cannot express; each error names the key and the fix."""
    problems = []
    if config.head.head_type not in HEAD_TYPES:
        problems.append(f"head.head_type={config.head.head_type!r}: choose one of "
                        + ", ".join(f"head={name}" for name in HEAD_TYPES))
    if config.features.mode not in ("online", "offline", "recorded"):
        problems.append(f"features.mode={config.features.mode!r}: choose online, offline or recorded")
    if config.features.first_conversation < 0:
        problems.append(f"features.first_conversation={config.features.first_conversation} must be >= 0 (a "
                        f"conversation id of the recorded store)")
    if config.features.mode == "recorded" and not config.features.dir:
        problems.append("features.mode=recorded trains on a recorded store: pass features.dir=<DIR written by "
                        "scripts/prepare_data.py selfdistill --features DIR>")
    if config.head.targets not in ("soft", "hard"):
        problems.append(f"head.targets={config.head.targets!r}: choose soft (the target's distribution) or hard "
                        f"(its greedy token)")
    if config.deepspeed.stage not in (0, 1, 2, 3):
        problems.append(f"deepspeed.stage={config.deepspeed.stage}: choose 0, 1, 2 or 3")
    if config.deepspeed.offload_param and config.deepspeed.stage != 3:
        problems.append("deepspeed.offload_param needs deepspeed=zero3")
    threshold = config.deepspeed.param_persistence_threshold
    if threshold is not None and (config.deepspeed.stage != 3 or threshold < 0):
        problems.append(f"deepspeed.param_persistence_threshold={threshold} needs deepspeed=zero3 and a value >= 0 "
                        f"(null: DeepSpeed's default)")
    if config.tracker.kind not in ("wandb", "disabled"):
        problems.append(f"tracker.kind={config.tracker.kind!r}: choose tracker=wandb or tracker=disabled")
    if config.trainer.max_steps < 1 or config.trainer.micro_batch_size < 1 or config.trainer.grad_accum < 1:
        problems.append("trainer.max_steps, trainer.micro_batch_size and trainer.grad_accum must be >= 1")
    if config.trainer.stop_after is not None and not 1 <= config.trainer.stop_after <= config.trainer.max_steps:
        problems.append(f"trainer.stop_after={config.trainer.stop_after} must be between 1 and trainer.max_steps "
                        f"({config.trainer.max_steps})")
    problems += cadence_problems(config)
    if not config.target.name:
        problems.append("target.name is empty: pass target.name=<alias | HF id | local dir | file.gguf>")
    if config.data.source in ("json", "hf") and not config.data.path:
        problems.append(f"data.path is required for data.source={config.data.source}: pass data.path="
                        + ("<file.json|file.jsonl>" if config.data.source == "json" else "<HF dataset id>"))
    local = config.data.source in ("json", "sharegpt") and config.features.mode != "recorded"
    if local and config.data.path and not Path(config.data.path).expanduser().is_file():
        problems.append(f"data.path={config.data.path}: no such file (a .json array or .jsonl of conversations)")
    output = Path(config.output_dir).expanduser()
    if output.exists() and not output.is_dir():
        problems.append(f"output_dir={config.output_dir} is a file; a run writes a directory there: choose another "
                        f"output_dir")
    if config.init_from and not Path(config.init_from).expanduser().is_dir():
        problems.append(f"init_from={config.init_from}: no such directory (a trained head: a run's OUTPUT_DIR/head, "
                        f"an export, or heads/shipped/NAME)")
    lora = getattr(config.head, "lora", None)
    if lora is not None and lora.enabled and config.features.mode != "online":
        problems.append("head.lora.enabled (Medusa-2) trains the target itself: it needs features.mode=online")
    if lora is not None and lora.enabled and config.deepspeed.stage == 3:
        # the adapted target is part of the engine's module, but its teacher pass and the held-out branches run
        # outside the engine, where ZeRO-3 would leave its weights partitioned
        problems.append("head.lora.enabled (Medusa-2) cannot train under deepspeed=zero3 (it would partition the "
                        "target that the teacher pass reads): use deepspeed=zero1 or deepspeed=zero2")
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))


# every value here divides a step count or sizes a batch: 0 would crash mid-run (ZeroDivisionError, an empty batch)
AT_LEAST_ONE = {
    "eval.every": "evaluate every N optimizer steps; eval.every=<trainer.max_steps> evaluates only at the end",
    "checkpoint.every": "checkpoint every N optimizer steps; checkpoint.every=<trainer.max_steps> saves only at "
                        "the end",
    "checkpoint.keep": "the newest checkpoints kept; resume falls back to an older one when the newest is damaged",
    "eval.depth": "draft steps an evaluation checks",
    "eval.batch_size": "held-out conversations per evaluation batch",
    "features.batch_size": "conversations per offline extraction batch",
}


def cadence_problems(config: TrainConfig) -> list[str]:
    """The keys of ``AT_LEAST_ONE`` below 1, and a precision that is not auto, bf16 or fp32."""
    problems = []
    for key, meaning in AT_LEAST_ONE.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value < 1:
            problems.append(f"{key}={value} must be >= 1 ({meaning}): pass {key}=1 or more")
    if config.trainer.precision not in ("auto", "bf16", "fp32"):
        problems.append(f"trainer.precision={config.trainer.precision!r}: choose auto (bf16 on GPU, fp32 on CPU), "
                        f"bf16 or fp32")
    return problems
