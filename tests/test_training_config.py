"""Hydra composition: every group combination composes into the typed config; bad keys and groups fail clearly."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from training.config import (Eagle3HeadConf, EagleHeadConf, MedusaHeadConf, TrainConfig, compose_config,
                             compose_many, validate)

HEADS = {"eagle": EagleHeadConf, "eagle3": Eagle3HeadConf, "medusa": MedusaHeadConf}
TARGETS = {"smollm2": [], "hf": ["target.name=some/model"]}
DATA = {"sharegpt": [], "json": ["data.path=conversations.jsonl"], "hf": ["data.path=org/dataset"],
        "selfdistill": ["data.path=selfdistill.jsonl"]}
ZERO = ["zero1", "zero2", "zero3"]
TRACKERS = ["wandb", "disabled"]


def test_every_group_option_composes_with_every_head():
    """Groups are independent of each other except through the head: compose every head with every option of
    every other group (and the engine x tracker product), then type-check and validate each result."""
    combinations = []
    for head in HEADS:
        combinations += [(head, "smollm2", "sharegpt", zero, tracker) for zero in ZERO for tracker in TRACKERS]
        combinations += [(head, target, "sharegpt", "zero2", "wandb") for target in TARGETS]
        combinations += [(head, "smollm2", data, "zero2", "wandb") for data in DATA]
    configs = compose_many([[f"head={head}", f"target={target}", f"data={data}", f"deepspeed={zero}",
                             f"tracker={tracker}", *TARGETS[target], *DATA[data]]
                            for head, target, data, zero, tracker in combinations])
    for (head, _target, data, zero, tracker), config in zip(combinations, configs):
        assert isinstance(config, TrainConfig) and isinstance(config.head, HEADS[head])
        assert config.deepspeed.stage == int(zero[-1])
        assert config.tracker.kind == tracker
        assert config.data.source == {"selfdistill": "json"}.get(data, data)
        validate(config)


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


def test_unknown_key_fails_with_hydra_error():
    with pytest.raises(ConfigCompositionException, match="head.ttt_steps"):
        compose_config(["head=medusa", "head.ttt_steps=3"])
    with pytest.raises(ConfigCompositionException, match="trainer.max_stepz"):
        compose_config(["trainer.max_stepz=3"])
    with pytest.raises(ConfigCompositionException):
        compose_config(["trainer.max_steps=many"])


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(MissingConfigException, match="Could not find 'head/eagle4'") as error:
        compose_config(["head=eagle4"])
    assert "eagle3" in str(error.value)
    with pytest.raises(MissingConfigException, match="deepspeed/zero4"):
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
