"""Export a trained head for a serving engine or the reference code, and optionally a Medusa-2 target with its LoRA

The command is ``cli/export.py`` (installed as ``headstart-export``); ``--help`` lists its flags.
"""

from cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
