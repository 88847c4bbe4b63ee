"""The training objectives of the head types, by name: each head type's module owns its parts (its Hydra config,
loss, evaluation matches, the setup of a fresh head; see ``HeadObjective``), and ``OBJECTIVES`` lists them.

    objective = build_objective(head, head_conf, target.lm_head.weight, target.softcap)  # the module DeepSpeed wraps
    objective_class(head_conf.head_type).eval_depth(head_conf, eval_conf)  # what a type owns, before any objective

A new head type is a ``heads.registry`` head plus an objective module here listed in ``OBJECTIVES`` (and its
conf/head/NAME.yaml, whose schema ``training.config.register_configs`` registers from the objective's
``conf_class``).
"""

from __future__ import annotations

import torch
from torch import nn

from training.objectives.base import HeadConf, HeadObjective, TargetDistribution, VocabScreen, safe_mean
from training.objectives.dflash import DFlashHeadConf, DFlashObjective, dflash_matches
from training.objectives.eagle import EagleHeadConf, EagleObjective, eagle_matches
from training.objectives.eagle3 import Eagle3HeadConf, Eagle3Objective, norm_scale
from training.objectives.medusa import LoraConf, MedusaHeadConf, MedusaObjective, medusa_matches, medusa_ranks

OBJECTIVES: dict[str, type[HeadObjective]] = {cls.head_type: cls
                                              for cls in (EagleObjective, Eagle3Objective, MedusaObjective,
                                                          DFlashObjective)}

__all__ = ["OBJECTIVES", "DFlashHeadConf", "DFlashObjective", "Eagle3HeadConf", "Eagle3Objective", "EagleHeadConf",
           "EagleObjective", "HeadConf", "HeadObjective", "LoraConf", "MedusaHeadConf", "MedusaObjective",
           "TargetDistribution", "VocabScreen", "build_objective", "dflash_matches", "eagle_matches", "head_conf_for",
           "medusa_matches", "medusa_ranks", "norm_scale", "objective_class", "safe_mean"]


def objective_class(head_type: str) -> type[HeadObjective]:
    """The objective class of a head type, or a ValueError listing the known ones."""
    if head_type not in OBJECTIVES:
        raise ValueError(f"no training objective for head type {head_type!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[head_type]


def build_objective(head: nn.Module, head_conf, target_lm_head_weight: torch.Tensor, softcap: float | None,
                    lora_target: nn.Module | None = None, pad_id: int = 0) -> HeadObjective:
    """The objective of ``head``'s type around ``head`` (``HeadObjective``'s arguments)."""
    return objective_class(head.head_type)(head, head_conf, target_lm_head_weight, softcap, lora_target=lora_target,
                                           pad_id=pad_id)


def head_conf_for(head: nn.Module) -> HeadConf:
    """The training config of ``head``'s type that scores it (the fields evaluation reads come from the head)."""
    return objective_class(head.head_type).head_conf_for(head)
