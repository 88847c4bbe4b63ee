"""Facts about the machine a run is on: the CPU (model, family/model/stepping, flags), the cores this process may use,
the key under which measured costs are cached, a results file's description of it, and a device-aware clock.

Everything that measures or caches a cost (the cost curve, the linear plan, the benchmarks) reads them here, so that
two machines of the same kind but different CPUs never share a measurement.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from runtime.target.host_memory import transparent_huge_pages
from runtime.target.kernels import native_bf16_matmul

CPUINFO_FIELDS = {"model name": "cpu", "cpu family": "family", "model": "model", "stepping": "stepping",
                  "cpu MHz": "mhz", "cache size": "cache", "flags": "flags"}
# CPU features that decide the fast bf16 and decode paths (runtime.target.kernels, runtime.target.decode_layers)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info() -> dict[str, str]:
    """The first processor's entry of /proc/cpuinfo under short names (``CPUINFO_FIELDS``): the model name alone
    ("AMD EPYC") does not tell two generations apart, family, model and stepping do. Empty off Linux."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor's entry ends here
                key, _, value = line.partition(":")
                if key.strip() in CPUINFO_FIELDS:
                    found[CPUINFO_FIELDS[key.strip()]] = value.strip()
    except OSError:
        pass
    return found


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_key(device: torch.device) -> str:
    """What a cached measurement was measured on: the CPU (model, family/model/stepping, cores this process may use,
    threads) and the GPU when the device is one."""
    info = cpu_info()
    cpu = "/".join(info.get(name, "") for name in ("cpu", "family", "model", "stepping")) or platform.machine()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return f"{cpu}-{platform.machine()}-{usable_cores()}-{torch.get_num_threads()}-{gpu}"


def machine_description(device: torch.device) -> dict:
    """What a results file records about the machine: CPU model, its family/model/stepping, clock and cache (the
    model name alone does not tell two generations apart), the flags that choose kernels, torch's CPU capability,
    the cores (and those this process may use), the transparent huge page setting (the packed weights' pages:
    runtime.target.host_memory), and the GPU when the run used one."""
    info = cpu_info()  # empty off Linux: the platform string is what there is
    flags = set(info.get("flags", "").split())
    described = {"cpu": info.get("cpu") or platform.processor() or platform.machine(),
                 "cpu_id": {name: info[name] for name in ("family", "model", "stepping", "mhz", "cache")
                            if name in info},
                 "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
                 "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
                 "cores_available": usable_cores(),
                 "native_bf16_matmul": native_bf16_matmul(),
                 "transparent_huge_pages": transparent_huge_pages()}
    if device.type == "cuda":
        described["gpu"] = torch.cuda.get_device_name(device)
    return described


def synchronized_seconds(device: torch.device, started: float) -> float:
    """Seconds since ``started`` (a time.perf_counter() value) once the device's queued work is done: CUDA runs
    kernels asynchronously, so without the synchronisation a timing would measure only the launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this process reads from memory with its threads: the best of ``repeats`` sums over a bf16
    buffer of ``megabytes`` (far past any cache). A decode pass at one row reads every weight once and does little
    arithmetic per byte, so weight bytes / this is the floor of its time on this machine, whatever the engine."""
    buffer = torch.ones(megabytes * 2**20 // 2, dtype=torch.bfloat16, device=device)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, synchronized_seconds(device, started))
    return buffer.numel() * buffer.element_size() / best
