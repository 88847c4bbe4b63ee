"""Train a draft head: ``python training/train.py head=eagle|eagle3|medusa [key=value ...]`` in a checkout, or
``python -m training.train ...`` / ``headstart-train ...`` anywhere once installed (the configs ship in the package).

Launch alone (one process), with ``torchrun --nproc_per_node N training/train.py ...`` or with
``deepspeed --no_local_rank [--hostfile H] training/train.py ...``. See conf/train.yaml for every key (``--cfg job``
prints the composed config); the run itself is training/recipe.py.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from training.checkpoints import write_text_atomic
from training.config import CONFIG_DIR, CONFIG_NAME, compose_config, register_configs, to_typed, validate
from training.recipe import train

register_configs()


def record_run(config, run_dir: Path) -> None:
    """The run's composed config, its overrides and Hydra's settings in ``run_dir/.hydra`` (where Hydra keeps them),
    written once the recipe has claimed the run directory: a command refused before that changes nothing there."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    hydra_config = HydraConfig.get()
    write_text_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(config))
    write_text_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(hydra_config.overrides.task))
    write_text_atomic(hydra_dir / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_config}))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=CONFIG_NAME)
def run(config) -> None:
    try:
        train(to_typed(config), on_claimed=lambda run_dir: record_run(config, run_dir))
    except (ValueError, FileNotFoundError) as error:  # a refused run: the sentence, not a traceback
        sys.exit(f"error: {error}")


def main() -> None:
    """Check the overrides (unknown keys, values, the output directory) before Hydra sets up the run, then run it;
    Hydra's own flags (``--cfg job``, ``--help``, ...) go to Hydra unchecked."""
    overrides = sys.argv[1:]
    if not any(argument.startswith("-") for argument in overrides):
        try:
            validate(compose_config(overrides))
        except ValueError as error:
            sys.exit(f"error: {error}")
    run()


if __name__ == "__main__":
    main()
