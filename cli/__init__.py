"""The command-line layer: each command parses its flags into the library's typed values, checks them before
anything slow starts, and calls the library (installed as ``headstart-generate``, ``headstart-export``,
``headstart-benchmark``, ``headstart-eval-head``, ``headstart-prepare-data`` beside ``headstart-train``; in a
checkout also ``python scripts/NAME.py``). ``cli.args`` holds the spellings every command shares."""
