"""DeepSpeed for every run: process setup (one process, torchrun, deepspeed launcher), the engine, checkpoints.

One process needs no launcher: the distributed environment variables are filled in for a world of one. On CPU the
backend is gloo, the optimizer torch's AdamW (DeepSpeed's fused/CPU Adam would JIT-compile for about a minute), and
DeepSpeed's shared-memory collective op is not built (its JIT build takes minutes and gloo does not need it).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

LATEST = "latest.json"


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


def setup_distributed(device_choice: str = "auto", threads: int | None = None) -> Dist:
    """Join (or, alone, create) the process group and pick this process's device."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:  # plain `python training/train.py`
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(_free_port())})
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_choice == "auto":
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # `import deepspeed.comm.torch as m` would bind the torch package (deepspeed.comm re-exports it): use
        # sys.modules. Skip the shared-memory op's minutes-long JIT build; gloo needs none.
        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(local_world, 1)))
    if threads and device.type == "cuda":
        torch.set_num_threads(threads)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
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


def deepspeed_config(conf, dist: Dist, lr: float, betas, weight_decay: float, grad_clip: float) -> dict:
    trainer, zero = conf.trainer, conf.deepspeed
    bf16 = trainer.precision == "bf16" or (trainer.precision == "auto" and dist.device.type == "cuda")
    zero_config: dict = {"stage": zero.stage}
    if zero.offload_optimizer:
        zero_config["offload_optimizer"] = {"device": "cpu", "pin_memory": dist.device.type == "cuda"}
    if zero.offload_param:
        zero_config["offload_param"] = {"device": "cpu", "pin_memory": dist.device.type == "cuda"}
    return {
        "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
        "gradient_accumulation_steps": trainer.grad_accum,
        "train_batch_size": trainer.micro_batch_size * trainer.grad_accum * dist.world,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero_config,
        "bf16": {"enabled": bf16},
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


# ----- checkpoints: DeepSpeed state under checkpoints/<tag>, and an atomically written pointer to the last complete

def read_latest(checkpoint_root: Path) -> dict | None:
    path = checkpoint_root / LATEST
    return json.loads(path.read_text()) if path.is_file() else None


def save_checkpoint(engine, checkpoint_root: Path, step: int, client_state: dict, keep: int, is_main: bool) -> None:
    tag = f"step-{step:08d}"
    engine.save_checkpoint(str(checkpoint_root), tag=tag, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=True)
    barrier()  # every rank's shard is on disk before the pointer moves
    if is_main:
        partial = checkpoint_root / (LATEST + ".partial")
        partial.write_text(json.dumps({"tag": tag, "step": step}))
        os.replace(partial, checkpoint_root / LATEST)
        tags = sorted(p.name for p in checkpoint_root.iterdir() if p.is_dir() and p.name.startswith("step-"))
        for old in tags:
            if old != tag and old not in tags[-keep:]:
                shutil.rmtree(checkpoint_root / old, ignore_errors=True)
    barrier()


def load_checkpoint(engine, checkpoint_root: Path) -> dict | None:
    """Restore the last complete checkpoint (None when there is none); returns its client state."""
    latest = read_latest(checkpoint_root)
    if latest is None:
        return None
    path, client_state = engine.load_checkpoint(str(checkpoint_root), tag=latest["tag"], load_module_strict=False)
    if path is None:
        raise RuntimeError(f"could not load checkpoint {checkpoint_root / latest['tag']}")
    return client_state
