"""Hydra composition: every group combination composes into the typed config; bad keys and groups fail clearly;
the device choices of the GPU path, where the configs are found, and how saved settings are compared."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from heads.registry import HEAD_TYPES
from training.config import CONFIG_DIR, TrainConfig, compose_config, compose_many, find_config_dir, validate
from training.objectives import OBJECTIVES, Eagle3HeadConf, EagleHeadConf, MedusaHeadConf, objective_class

ROOT = Path(__file__).resolve().parents[1]

HEADS = {"eagle": EagleHeadConf, "eagle3": Eagle3HeadConf, "medusa": MedusaHeadConf}
TARGETS = {"smollm2": [], "hf": ["target.name=some/model"]}
DATA = {"sharegpt": [], "json": ["data.path={dir}/conversations.jsonl"], "hf": ["data.path=org/dataset"],
        "selfdistill": ["data.path={dir}/selfdistill.jsonl"]}
ZERO = ["zero1", "zero2", "zero3"]
TRACKERS = ["wandb", "disabled"]


def test_every_group_option_composes_with_every_head(tmp_path):
    """Groups are independent of each other except through the head: compose every head with every option of
    every other group (and the engine x tracker product), then type-check and validate each result."""
    for name in ("conversations.jsonl", "selfdistill.jsonl"):  # local data files must exist to validate
        (tmp_path / name).write_text("")
    combinations = []
    for head in HEADS:
        combinations += [(head, "smollm2", "sharegpt", zero, tracker) for zero in ZERO for tracker in TRACKERS]
        combinations += [(head, target, "sharegpt", "zero2", "wandb") for target in TARGETS]
        combinations += [(head, "smollm2", data, "zero2", "wandb") for data in DATA]
    configs = compose_many([[f"head={head}", f"target={target}", f"data={data}", f"deepspeed={zero}",
                             f"tracker={tracker}", *TARGETS[target],
                             *(item.format(dir=tmp_path) for item in DATA[data])]
                            for head, target, data, zero, tracker in combinations])
    for (head, _target, data, zero, tracker), config in zip(combinations, configs):
        assert isinstance(config, TrainConfig) and isinstance(config.head, HEADS[head])
        assert config.deepspeed.stage == int(zero[-1])
        assert config.tracker.kind == tracker
        assert config.data.source == {"selfdistill": "json"}.get(data, data)
        validate(config)


def test_every_head_type_has_an_objective_and_an_unknown_one_is_named():
    """The objective registry owns each head type's training parts: it names every head type the heads know, each
    objective trains its own type with its own schema, and an unknown type gets an error listing the known ones."""
    assert sorted(OBJECTIVES) == sorted(HEAD_TYPES)
    for head_type, objective in OBJECTIVES.items():
        assert objective_class(head_type) is objective and objective.head_type == head_type
        assert objective.conf_class().head_type == head_type
    with pytest.raises(ValueError, match="head type 'hydra'; choose one of eagle, eagle3, medusa"):
        objective_class("hydra")
    head = torch.nn.Module()
    head.head_type = "medusa"
    with pytest.raises(ValueError, match="EagleObjective cannot train a medusa head: .*build_objective"):
        OBJECTIVES["eagle"](head, EagleHeadConf(), torch.zeros(2, 2), None)


def test_defaults_are_the_embedded_ones():
    config = compose_config()
    assert config.head.head_type == "eagle" and config.target.name == "smollm2-135m"
    assert config.data.source == "sharegpt" and config.deepspeed.stage == 2
    assert config.tracker.kind == "wandb" and config.tracker.mode == "offline"
    assert config.output_dir == "runs/eagle"
    config = compose_config(["head=medusa", "trainer.max_steps=7", "data.max_samples=5", "output_dir=/tmp/x",
                             "head.lora.enabled=true", "deepspeed.offload_optimizer=true"])
    assert (config.trainer.max_steps, config.data.max_samples, config.output_dir) == (7, 5, "/tmp/x")
    assert config.head.lora.enabled and config.deepspeed.offload_optimizer


def test_an_unknown_key_is_refused_with_or_without_plus_and_never_dropped():
    """A key the typed config lacks is named with its section's keys and the closest one, whether it came with '+'
    (which Hydra accepts, and the typed config would then drop) or without (where Hydra's own error suggests '+')."""
    with pytest.raises(ValueError, match=r"head.ttt_steps is not a training setting \(head has .*num_heads"):
        compose_config(["head=medusa", "head.ttt_steps=3"])
    for spelling in ("trainer.max_step=2", "+trainer.max_step=2"):
        with pytest.raises(ValueError, match="trainer.max_step is not a training setting .*did you mean "
                                             "trainer.max_steps\\?") as error:
            compose_config([spelling])
        assert "+trainer" not in str(error.value)
    with pytest.raises(ValueError, match="bogus is not a training setting"):
        compose_config(["+bogus=1"])
    with pytest.raises(ValueError, match="trainer.max_steps=many .*could not be converted"):
        compose_config(["trainer.max_steps=many"])
    with pytest.raises(ValueError, match="output_dir=.* is a file"):
        validate(compose_config([f"output_dir={__file__}"]))


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(ValueError, match="Could not find 'head/eagle4'") as error:
        compose_config(["head=eagle4"])
    assert "eagle3" in str(error.value)
    with pytest.raises(ValueError, match="deepspeed/zero4"):
        compose_config(["deepspeed=zero4"])


def test_required_values_and_bad_values_are_named():
    with pytest.raises(ValueError, match="data.path is required"):
        validate(compose_config(["data=json"]))
    with pytest.raises(ValueError, match="target.name is empty"):
        validate(compose_config(["target=hf"]))
    with pytest.raises(ValueError, match="features.mode"):
        validate(compose_config(["features.mode=sometimes"]))
    with pytest.raises(ValueError, match="offload_param needs deepspeed=zero3"):
        validate(compose_config(["deepspeed.offload_param=true"]))
    with pytest.raises(ValueError, match="needs features.mode=online"):
        validate(compose_config(["head=medusa", "head.lora.enabled=true", "features.mode=offline"]))
    validate(compose_config(["deepspeed=zero3", "deepspeed.param_persistence_threshold=0"]))
    with pytest.raises(ValueError, match="data.path=missing.jsonl: no such file"):
        validate(compose_config(["data=json", "data.path=missing.jsonl"]))
    with pytest.raises(ValueError, match="init_from=no/such/head: no such directory"):
        validate(compose_config(["init_from=no/such/head"]))


@pytest.mark.parametrize("override, named", [
    ("eval.every=0", "eval.every=0 must be >= 1"),
    ("checkpoint.every=0", "checkpoint.every=0 must be >= 1"),
    ("checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"),
    ("eval.batch_size=0", "eval.batch_size=0 must be >= 1"),
    ("trainer.precision=fp16", "trainer.precision='fp16': choose auto"),
    ("deepspeed.param_persistence_threshold=0", "param_persistence_threshold=0 needs deepspeed=zero3"),
    ("head=medusa head.lora.enabled=true deepspeed=zero3", "cannot train under deepspeed=zero3"),
])
def test_values_that_would_fail_mid_run_are_named_before_any_work(override, named):
    """A recipe validates its config when it is made, before processes, targets or data are touched."""
    from training.recipe import TrainRecipe

    with pytest.raises(ValueError, match=re.escape(named)):
        TrainRecipe(compose_config(override.split()))


def test_gpu_choices_are_pure_functions_of_the_device():
    """What a CUDA run picks (nccl, bf16, pinned offload buffers, bf16 target) is decided by functions that a CPU
    test can call with a CUDA device."""
    from training.engine import Dist, cpu_threads, deepspeed_config, dist_backend, pick_device, pin_memory, use_bf16
    from training.recipe import target_dtype

    cuda, cpu = torch.device("cuda:1"), torch.device("cpu")
    assert pick_device("auto", 1, cuda_available=True) == cuda
    assert pick_device("auto", 1, cuda_available=False) == cpu
    assert pick_device("cpu", 1, cuda_available=True) == cpu
    assert (dist_backend(cuda), dist_backend(cpu)) == ("nccl", "gloo")
    assert use_bf16("auto", cuda) and not use_bf16("auto", cpu)
    assert use_bf16("bf16", cpu) and not use_bf16("fp32", cuda)
    assert pin_memory(cuda) and not pin_memory(cpu)
    assert cpu_threads(None, 16, 2) == 8 and cpu_threads(3, 16, 2) == 3 and cpu_threads(None, None, 4) == 1
    config = compose_config(["deepspeed=zero3", "deepspeed.offload_optimizer=true", "deepspeed.offload_param=true",
                             "deepspeed.param_persistence_threshold=0"])
    on_gpu = deepspeed_config(config, Dist(0, 2, 1, cuda), 1e-3, [0.9, 0.95], 0.0, 0.5)
    assert on_gpu["bf16"]["enabled"] and on_gpu["train_batch_size"] == 2 * config.trainer.micro_batch_size
    zero = on_gpu["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] and zero["offload_param"]["pin_memory"]
    assert zero["stage3_param_persistence_threshold"] == 0
    on_cpu = deepspeed_config(config, Dist(0, 1, 0, cpu), 1e-3, [0.9, 0.95], 0.0, 0.5)
    assert not on_cpu["bf16"]["enabled"] and not on_cpu["zero_optimization"]["offload_param"]["pin_memory"]
    assert (target_dtype(config, cuda), target_dtype(config, cpu)) == ("bfloat16", "float32")
    assert "stage3_param_persistence_threshold" not in deepspeed_config(
        compose_config(), Dist(0, 1, 0, cpu), 1e-3, [0.9, 0.95], 0.0, 0.5)["zero_optimization"]


def test_config_dir_resolves_inside_an_installed_package(tmp_path):
    """A wheel installs conf/ as training/conf: that copy wins; a checkout (or editable install) reads the top-level
    conf/ beside the package; neither is an error naming the fix."""
    installed = tmp_path / "site-packages" / "training"
    (installed / "conf").mkdir(parents=True)
    (installed / "conf" / "train.yaml").write_text("defaults: []\n")
    (tmp_path / "site-packages" / "conf").mkdir()  # someone else's conf/ beside it is not read
    assert find_config_dir(installed) == installed / "conf"
    checkout = tmp_path / "checkout"
    (checkout / "training").mkdir(parents=True)
    (checkout / "conf").mkdir()
    (checkout / "conf" / "train.yaml").write_text("defaults: []\n")
    assert find_config_dir(checkout / "training") == checkout / "conf"
    with pytest.raises(FileNotFoundError, match="pip install"):
        find_config_dir(tmp_path / "nowhere" / "training")
    assert Path(CONFIG_DIR) == ROOT / "conf"  # this checkout


def test_the_wheel_ships_every_package_and_config():
    """pyproject lists packages explicitly (training.conf is mapped from conf/): every package directory of the
    checkout must be listed, and the package-data globs must reach every config file."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {str(path.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("heads", "runtime", "bench", "training", "cli")
               for path in (ROOT / top).rglob("__init__.py")}
    assert on_disk | {"training.conf"} == set(setuptools["packages"])
    assert setuptools["package-dir"] == {"training.conf": "conf"}
    globs = setuptools["package-data"]["training.conf"]
    shipped = {path for pattern in globs for path in (ROOT / "conf").glob(pattern)}
    assert shipped == set((ROOT / "conf").rglob("*.yaml")) and (ROOT / "conf" / "train.yaml") in shipped
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["headstart-train"] == "training.train:main"
    for command in ("generate", "export", "benchmark", "eval_head", "prepare_data"):  # every command, installed
        assert scripts[f"headstart-{command.replace('_', '-')}"] == f"cli.{command}:main"
        assert (ROOT / "scripts" / f"{command}.py").read_text().count("\n") < 12  # a wrapper of it


def test_checkpoint_and_feature_store_settings_are_compared_by_name():
    from training.checkpoints import config_differences
    from training.features import description_differences

    saved = dataclasses.asdict(compose_config(["head=eagle3"]))
    current = dataclasses.asdict(compose_config(["head=eagle3", "head.ttt_steps=3", "target.name=other",
                                                 "trainer.stop_after=5", "eval.every=7"]))
    saved = json.loads(json.dumps(saved))  # as run.json holds it
    assert config_differences(saved, current) == ["head.ttt_steps: 7 in the checkpoint, 3 in this run",
                                                  "target.name: 'smollm2-135m' in the checkpoint, 'other' in this run"]
    assert config_differences(saved, dataclasses.asdict(compose_config(["head=eagle3", "eval.every=3"]))) == []
    wanted = {"target": "t", "tokenizer": "k", "data": "d1", "data_settings": {"seed": 1, "path": "a"},
              "feature_layers": [0, 1, 1], "topk": 0, "dtype": "float32", "head_type": "eagle3"}
    found = dict(wanted, data="d0", data_settings={"seed": 0, "path": "a"}, feature_layers=[], head_type="eagle")
    assert description_differences(found, wanted) == ["data.seed: 0 in the store, 1 in this run",
                                                      "feature_layers: [] in the store, [0, 1, 1] in this run"]
    assert description_differences(dict(wanted, data="d0"), wanted)[0].startswith("the conversations")
    assert description_differences(dict(wanted, head_type="medusa"), wanted) == []  # same features: shared


def test_pruning_keeps_complete_checkpoints_only(tmp_path):
    """A tag a dying save left without its run record is no fallback: pruning keeps the newest complete ones and
    removes the rest up to the current step; newer tags (a resumed run's future) stay."""
    from training.checkpoints import RUN_RECORD, prune, saved_tags, tag_name

    for step, complete in ((40, True), (50, True), (60, False), (75, True), (90, True)):
        (tmp_path / tag_name(step)).mkdir()
        if complete:
            (tmp_path / tag_name(step) / RUN_RECORD).write_text("{}")
    prune(tmp_path, 75, keep=2)
    assert saved_tags(tmp_path) == [tag_name(90), tag_name(75), tag_name(50)]


def test_a_recorded_store_refuses_conversations_from_another_source(tmp_path):
    """Conversation ids are positions in their source: recording another source's conversations into a store would
    overwrite its shards. Recording more of the same source (a larger data.max_samples) continues it."""
    from training.recorded import RecordingWriter

    description = {"target": "t", "tokenizer": "k", "feature_layers": [1], "dtype": "bfloat16",
                   "chat_template": None, "max_length": 512, "generation": {"temperature": 0.0},
                   "data": {"source": "sharegpt", "path": None, "max_samples": 100}}
    RecordingWriter(tmp_path, description)
    RecordingWriter(tmp_path, dict(description, data={"source": "sharegpt", "path": None, "max_samples": 900}))
    with pytest.raises(ValueError, match="data.source: 'sharegpt' in the store, 'json' here"):
        RecordingWriter(tmp_path, dict(description, data={"source": "json", "path": "other.jsonl",
                                                          "max_samples": 100}))


def test_the_data_cache_is_keyed_on_the_files_content_not_its_size_and_time(tmp_path):
    """A same-size edit of the data file with its modification time restored is other data: the tokenized splits
    (and the feature stores keyed on them) are made again, not read from the old file's cache."""
    import os

    from training.config import DataConf
    from training.data import cache_key

    path = tmp_path / "data.jsonl"
    path.write_text('{"conversations": [{"from": "human", "value": "hello"}]}\n')
    conf = DataConf(source="json", path=str(path))
    before, stat = cache_key(conf, None), path.stat()
    path.write_text('{"conversations": [{"from": "human", "value": "HELLO"}]}\n')
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert cache_key(conf, None) != before
    path.write_text('{"conversations": [{"from": "human", "value": "hello"}]}\n')
    assert cache_key(conf, None) == before  # the same content, whatever its time


def test_a_cut_short_feature_shard_names_its_store_before_training(tmp_path):
    """A shard cut short (a kill or a copy) is found when the store opens, naming the store, the shard and the fix,
    not as a safetensors error at the step that first reads it."""
    import pytest
    import torch

    from heads.layouts import safetensors_damage, save_tensors
    from training.features import MANIFEST, OfflineFeatures, write_manifest
    from training.recorded import RECORDING, RecordedStore

    store = tmp_path / "store"
    store.mkdir()
    save_tensors({"0.hidden": torch.zeros(5, 4), "1.hidden": torch.ones(5, 4)}, store / "shard-00000.safetensors")
    write_manifest(store, 2, {})
    assert OfflineFeatures(store, 2).sample(1)["hidden"].sum() == 20
    shard = store / "shard-00000.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-16])
    assert "cut short" in safetensors_damage(shard)
    with pytest.raises(ValueError, match=f"offline feature store {store} is damaged: .*shard-00000.safetensors is cut "
                                         f"short .*{MANIFEST}"):
        OfflineFeatures(store, 2)
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / RECORDING).write_text("{}")
    (recorded / "shard-0000000.safetensors").write_bytes(whole[:40])
    with pytest.raises(ValueError, match=f"recorded store {recorded} is damaged: .*cut short"):
        RecordedStore(recorded, 64)


def test_a_pickle_weights_only_refuses_names_its_file(tmp_path):
    """The refusal of a checkpoint pickle that holds more than tensors and plain data says which file it was."""
    import pickle
    from fractions import Fraction

    import pytest
    import torch

    from training.checkpoints import weights_only_load

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"scale": Fraction(1, 2)}, path)
    with pytest.raises(pickle.UnpicklingError, match=f"{path}: refused to unpickle \\(it needs fractions.Fraction"):
        weights_only_load(path)
