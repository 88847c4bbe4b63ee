"""The target and its backends: loading (any HF id, directory or GGUF), the tree-attention backends, the decode layers
and CPU kernels, the linear-product plan, the machine's facts and the measured cost of a verification pass.

``Target`` and ``load_target`` are handed on here: ``from runtime.target import load_target``.
"""

from runtime.target.model import Target, TargetOutput, load_target, parse_dtype, target_from_model

__all__ = ["Target", "TargetOutput", "load_target", "parse_dtype", "target_from_model"]
