"""Acceptance of any head directory (EAGLE, EAGLE-3, Medusa), by the trainer's own evaluation.

The command is ``cli/eval_head.py`` (installed as ``headstart-eval-head``); ``--help`` lists its flags.
"""

from cli.eval_head import main

if __name__ == "__main__":
    raise SystemExit(main())
