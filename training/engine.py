"""DeepSpeed for every run: process setup (one process, torchrun, deepspeed launcher) and the engine.

One process needs no launcher: the distributed environment variables are filled in for a world of one. On CPU the
backend is gloo, the optimizer torch's AdamW (DeepSpeed's fused/CPU Adam would JIT-compile for about a minute), and
DeepSpeed's shared-memory collective op is not built (its JIT build takes minutes and gloo does not need it).
Every choice between the GPU and the CPU path is a small pure function of the device (``pick_device``,
``dist_backend``, ``use_bf16``, ``pin_memory``), so a CPU test runs the GPU path's decisions too. Checkpoints:
training/checkpoints.py.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pick_device(choice: str, local_rank: int, cuda_available: bool) -> torch.device:
    """trainer.device: auto is this process's GPU (cuda:LOCAL_RANK) when CUDA is available, else the CPU."""
    if choice != "auto":
        return torch.device(choice)
    return torch.device(f"cuda:{local_rank}") if cuda_available else torch.device("cpu")


def dist_backend(device: torch.device) -> str:
    """nccl between GPUs; gloo between CPU processes (nccl cannot move CPU tensors)."""
    return "nccl" if device.type == "cuda" else "gloo"


def use_bf16(precision: str, device: torch.device) -> bool:
    """trainer.precision: auto trains in bf16 on a GPU and in fp32 on a CPU."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def pin_memory(device: torch.device) -> bool:
    """ZeRO-Offload pins its CPU buffers only for a GPU to copy from; pinning for a CPU run only costs memory."""
    return device.type == "cuda"


def cpu_threads(threads: int | None, cpu_count: int | None, local_world: int) -> int:
    """torch threads of one CPU process: trainer.threads, else an equal share of the cores among this machine's
    processes (oversubscribed OpenMP pools slow every process down)."""
    return threads or max(1, (cpu_count or 1) // max(local_world, 1))


def setup_distributed(device_choice: str = "auto", threads: int | None = None) -> Dist:
    """Join (or, alone, create) the process group and pick this process's device."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:  # plain `python training/train.py`
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank, torch.cuda.is_available())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if threads:
            torch.set_num_threads(threads)
    else:
        # `import deepspeed.comm.torch as m` would bind the torch package (deepspeed.comm re-exports it): use
        # sys.modules. Skip the shared-memory op's minutes-long JIT build; gloo needs none.
        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(cpu_threads(threads, os.cpu_count(), local_world))
    deepspeed.init_distributed(dist_backend=dist_backend(device), verbose=False)
    return Dist(rank, world, local_rank, device)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        # gloo reduces float64 fine; keep the caller's device (nccl needs CUDA tensors, gloo CPU ones)
        dist.all_reduce(tensor)
    return tensor


def all_gather_object(value) -> list:
    """Every rank's ``value`` (any picklable object), in rank order; ``[value]`` alone."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def deepspeed_config(conf, dist: Dist, lr: float, betas, weight_decay: float, grad_clip: float) -> dict:
    trainer, zero = conf.trainer, conf.deepspeed
    zero_config: dict = {"stage": zero.stage}
    if zero.offload_optimizer:
        zero_config["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory(dist.device)}
    if zero.offload_param:
        zero_config["offload_param"] = {"device": "cpu", "pin_memory": pin_memory(dist.device)}
    if zero.stage == 3 and zero.param_persistence_threshold is not None:
        zero_config["stage3_param_persistence_threshold"] = zero.param_persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
        "gradient_accumulation_steps": trainer.grad_accum,
        "train_batch_size": trainer.micro_batch_size * trainer.grad_accum * dist.world,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero_config,
        "bf16": {"enabled": use_bf16(trainer.precision, dist.device)},
        # torch's AdamW: no JIT-compiled kernel, works on CPU and with ZeRO-Offload
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": 1e-8,
                                                  "weight_decay": weight_decay, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(trainer.max_steps, 2),
            "warmup_num_steps": max(1, min(trainer.warmup_steps, trainer.max_steps - 1)),
            "warmup_min_ratio": 0.0, "warmup_type": "linear", "cos_min_ratio": trainer.min_lr_ratio}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_engine(module: torch.nn.Module, ds_config: dict):
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("WARNING")
    parameters = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=parameters, config=ds_config)
    return engine


@contextmanager
def full_parameters(module: torch.nn.Module):
    """Inside: every parameter of ``module`` is whole on every rank (ZeRO-3 gathers; other stages: no-op)."""
    import deepspeed

    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if params:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield
