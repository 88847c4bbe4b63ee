"""Timing helpers shared by the benchmark and the micro-benchmarks of scripts/bench_*.py, and what every results
file records about the run's environment (machine, threads, torch), so that numbers from two machines or two torch
versions are never compared unawares."""

from __future__ import annotations

import statistics
import time

import torch

from runtime.target.machine import machine_description


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn()`` after one warm-up call (a micro-benchmark's timing)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return median_of_ms(times)


def median_of_ms(seconds: list[float]) -> float:
    """The median of timings in seconds, in milliseconds (the median: one slow spell of the machine moves it
    least)."""
    return statistics.median(seconds) * 1000


def run_environment(device: torch.device) -> dict:
    """What a results file records about where it ran: the machine (``machine_description``), torch's thread count
    and torch's version."""
    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "machine": machine_description(device)}


def environment_line(environment: dict) -> str:
    """A ``run_environment`` in a few words for a table's heading: the CPU, the flags that choose kernels, threads."""
    machine = environment["machine"]
    return f"{machine['cpu']} ({', '.join(machine['cpu_flags'])}), {environment['threads']} threads"
