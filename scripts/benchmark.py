"""Side-by-side decoding benchmark: HF generate baselines and our proposers on the same prompts, in one process.

The command is ``cli/benchmark.py`` (installed as ``headstart-benchmark``); ``--help`` lists its flags.
"""

from cli.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
