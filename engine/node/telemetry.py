"""Telemetry: what the node's accelerator (or host) reports — memory, utilization, power, temperature.

On an NVIDIA GPU everything comes from NVML (the nvidia-ml-py package). On a CPU-only node the host
offers process and host memory and CPU utilization (psutil); temperature comes from the platform's
sensors and power from Intel RAPL energy counters when they are readable. A value the platform does
not expose is None — never invented.
"""
from __future__ import annotations

import glob
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass

import psutil

log = logging.getLogger(__name__)

# Sensor chips that report the CPU package temperature, most specific first.
CPU_SENSOR_CHIPS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "soc_thermal", "acpitz")
RAPL_ENERGY_GLOB = "/sys/class/powercap/intel-rapl:[0-9]*/energy_uj"   # one file per CPU package


@dataclass
class TelemetrySample:
    device: str                      # "cuda:0 NVIDIA H100 ..." or "cpu"
    memory_used_bytes: int           # accelerator memory (GPU) or host memory in use (CPU)
    memory_total_bytes: int
    utilization: float | None        # 0..1: GPU compute busy, or host CPU busy
    power_w: float | None
    temperature_c: float | None
    process_rss_bytes: int           # this process's resident host memory

    def to_dict(self) -> dict:
        return asdict(self)


class Telemetry:
    """sample() reads the device at most every `min_interval_s` (cached in between); thread-safe."""

    def __init__(self, device_index: int | str | None = None, min_interval_s: float = 1.0, use_nvml: bool = True,
                 clock=time.monotonic):
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: TelemetrySample | None = None
        self._last_at = 0.0
        self._process = psutil.Process()
        self._nvml = None
        self._handle = None
        if use_nvml:
            self._open_nvml(device_index)
        self._rapl_files = [] if self._handle is not None else sorted(glob.glob(RAPL_ENERGY_GLOB))
        self._rapl_prev: tuple[float, int] | None = None
        psutil.cpu_percent(interval=None)   # the first call only starts the measurement window

    def _open_nvml(self, device: int | str | None) -> None:
        """device: an NVML index or a GPU UUID; None: the first of CUDA_VISIBLE_DEVICES (NVML itself
        ignores that variable; set but empty, no GPU is visible), else index 0."""
        if device is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None and not visible.strip():   # GPUs hidden from this process: a CPU node
                return
            device = (visible or "").split(",")[0].strip() or 0
        if isinstance(device, str) and device.isdigit():
            device = int(device)
        try:
            import pynvml
            pynvml.nvmlInit()
            if isinstance(device, int):
                if pynvml.nvmlDeviceGetCount() <= device:
                    pynvml.nvmlShutdown()
                    return
                handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(device)
            self._nvml, self._handle = pynvml, handle
            name = pynvml.nvmlDeviceGetName(handle)
            self.device = f"cuda:{device} {name.decode() if isinstance(name, bytes) else name}"
        except Exception as e:  # no driver, no library, no device: a CPU node
            log.info("NVML unavailable (%s); reporting host telemetry", e.__class__.__name__)
            self._nvml = self._handle = None

    @property
    def is_gpu(self) -> bool:
        return self._handle is not None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = self._handle = None

    def sample(self) -> TelemetrySample:
        with self._lock:
            now = self._clock()
            if self._last is None or now - self._last_at >= self.min_interval_s:
                self._last = self._read_gpu() if self.is_gpu else self._read_host()
                self._last_at = now
            return self._last

    # ---- NVML
    def _read_gpu(self) -> TelemetrySample:
        nv, h = self._nvml, self._handle

        def opt(fn, scale=1.0):
            try:
                return float(fn(h)) * scale
            except Exception:   # the board does not support this query
                return None

        mem = nv.nvmlDeviceGetMemoryInfo(h)
        util = opt(lambda x: nv.nvmlDeviceGetUtilizationRates(x).gpu, 0.01)
        power = opt(nv.nvmlDeviceGetPowerUsage, 1e-3)             # milliwatts
        temp = opt(lambda x: nv.nvmlDeviceGetTemperature(x, nv.NVML_TEMPERATURE_GPU))
        return TelemetrySample(self.device, int(mem.used), int(mem.total), util, power, temp,
                               int(self._process.memory_info().rss))

    # ---- host
    device = "cpu"

    def _read_host(self) -> TelemetrySample:
        vm = psutil.virtual_memory()
        return TelemetrySample(
            "cpu", int(vm.total - vm.available), int(vm.total), psutil.cpu_percent(interval=None) / 100.0,
            self._rapl_power_w(), cpu_temperature_c(), int(self._process.memory_info().rss))

    def _rapl_power_w(self) -> float | None:
        """Average package power since the previous sample, from RAPL energy counters (None if unreadable
        or on the first sample)."""
        if not self._rapl_files:
            return None
        try:
            energy = sum(int(open(f).read()) for f in self._rapl_files)
        except (OSError, ValueError):
            self._rapl_files = []
            return None
        now = self._clock()
        prev, self._rapl_prev = self._rapl_prev, (now, energy)
        if prev is None or now <= prev[0] or energy < prev[1]:   # first sample, or the counter wrapped
            return None
        return (energy - prev[1]) * 1e-6 / (now - prev[0])


def cpu_temperature_c() -> float | None:
    """The CPU package temperature if a sensor exposes one, else None."""
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    try:
        sensors = read() or {}
    except (OSError, RuntimeError):
        return None
    for chip in CPU_SENSOR_CHIPS:
        entries = [e.current for e in sensors.get(chip, []) if e.current is not None and e.current > 0]
        if entries:
            return float(max(entries))
    return None


def host_memory_available(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Memory that could be given to models now (bytes): the host's available memory, or less where the
    process's container is limited to less (a pod's memory limit: past it the kernel kills the process)."""
    available = int(psutil.virtual_memory().available)
    room = cgroup_memory_room(cgroup_root)
    return available if room is None else min(available, room)


def cgroup_memory_room(root: str) -> int | None:
    """The memory limit of the cgroup at `root` less what it uses (cgroup v2, else v1); None without one."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(root, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(root, usage_file)) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 60:   # "max", or v1's page-rounded "no limit"
            return None
        return max(0, int(limit) - used)
    return None
