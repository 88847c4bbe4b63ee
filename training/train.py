"""Train a draft head: ``python training/train.py head=eagle|eagle3|medusa [key=value ...]``.

Launch alone (one process), with ``torchrun --nproc_per_node N training/train.py ...`` or with
``deepspeed --no_local_rank [--hostfile H] training/train.py ...``. See conf/train.yaml for every key.
"""

import sys
from pathlib import Path

# Running as a script from a source checkout: make the project's packages importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402

from training.config import CONFIG_NAME, register_configs, to_typed  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name=CONFIG_NAME)
def main(config) -> None:
    from training.run import run

    run(to_typed(config))


if __name__ == "__main__":
    main()
