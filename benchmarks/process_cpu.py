"""CPU seconds that processes used, read before and after a pass: how much of the machine's cores each side
of a benchmark took, its client included (on a small machine the client shares the cores it measures)."""
from __future__ import annotations

import psutil


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User and system CPU seconds of a process, with its live children unless told not to (a gunicorn master
    and its workers; the benchmark's own process alone, as the servers it started are its children)."""
    root = psutil.Process(pid)
    procs = [root] + (root.children(recursive=True) if children else [])
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:   # a child that ended between the listing and the reading
            pass
    return total


class CpuMeter:
    """Named groups of processes, each (pid, with its children); read() gives every group's CPU seconds so far."""

    def __init__(self, groups: dict[str, list[tuple[int, bool]]]):
        self.groups = groups

    def read(self) -> dict[str, float]:
        return {name: sum(cpu_seconds(pid, children) for pid, children in procs)
                for name, procs in self.groups.items()}

    def since(self, before: dict[str, float]) -> dict[str, float]:
        now = self.read()
        return {name: now[name] - before[name] for name in now}
