"""Speculative generation from the command line.

The command is ``cli/generate.py`` (installed as ``headstart-generate``); ``--help`` lists its flags.
"""

from cli.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
