"""Train a draft head: ``python training/train.py head=eagle|eagle3|medusa [key=value ...]`` in a checkout, or
``python -m training.train ...`` / ``headstart-train ...`` anywhere once installed (the configs ship in the package).

Launch alone (one process), with ``torchrun --nproc_per_node N training/train.py ...`` or with
``deepspeed --no_local_rank [--hostfile H] training/train.py ...``. See conf/train.yaml for every key (``--cfg job``
prints the composed config); the run itself is training/recipe.py.
"""

import hydra

from training.config import CONFIG_DIR, CONFIG_NAME, register_configs, to_typed
from training.recipe import train

register_configs()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=CONFIG_NAME)
def main(config) -> None:
    train(to_typed(config))


if __name__ == "__main__":
    main()
