"""Prepare training data once, ahead of training runs.

The command is ``cli/prepare_data.py`` (installed as ``headstart-prepare-data``); ``--help`` lists its flags.
"""

from cli.prepare_data import main

if __name__ == "__main__":
    raise SystemExit(main())
