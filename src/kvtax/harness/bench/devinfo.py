"""Device clocks, temperature and power at phase boundaries (a rented GPU's clocks can
drop mid-run).

On NVIDIA GPUs the numbers come from NVML (`pynvml`, shipped as `nvidia-ml-py`); a cell
whose SM clock fell between phase start and end was throttled and can be flagged. On a
CPU, Linux exposes the current core frequency and sometimes a thermal zone. Where the
platform exposes nothing, `clocks()` returns None — never a made-up value.
"""

from __future__ import annotations

import glob
import os
import platform
import socket
from typing import Any

import torch

_nvml_state: dict[str, Any] = {}


def _nvml() -> Any | None:
    """The initialised pynvml module, or None (not installed, no driver)."""
    if "mod" not in _nvml_state:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml_state["mod"] = pynvml
        except Exception:  # ImportError, NVMLError: no NVML here
            _nvml_state["mod"] = None
    return _nvml_state["mod"]


def _gpu_clocks(index: int) -> dict[str, Any] | None:
    nv = _nvml()
    if nv is None:
        return None
    out: dict[str, Any] = {"source": "nvml"}
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None
    probes = {
        "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "mem_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
        "temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
        "throttle_reasons": lambda: int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
    }
    for key, probe in probes.items():
        try:
            out[key] = probe()
        except Exception:  # a field this GPU/driver does not report
            out[key] = None
    return out


def _cpu_clocks() -> dict[str, Any] | None:
    freqs = []
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"):
        try:
            freqs.append(int(open(path).read()) / 1000.0)
        except (OSError, ValueError):
            pass
    if not freqs:  # containers often hide cpufreq; /proc/cpuinfo still reports MHz
        try:
            with open("/proc/cpuinfo") as f:
                freqs = [float(l.split(":")[1]) for l in f if l.startswith("cpu MHz")]
        except (OSError, ValueError):
            freqs = []
    temps = []
    for path in glob.glob("/sys/class/thermal/thermal_zone*/temp"):
        try:
            temps.append(int(open(path).read()) / 1000.0)
        except (OSError, ValueError):
            pass
    if not freqs and not temps:
        return None
    return {
        "source": "linux",
        "cpu_mhz_mean": sum(freqs) / len(freqs) if freqs else None,
        "cpu_mhz_min": min(freqs) if freqs else None,
        "temperature_c": max(temps) if temps else None,
        "power_w": None,
    }


def clocks(device: torch.device | str) -> dict[str, Any] | None:
    """Clocks/temperature/power of `device` right now, or None where not exposed."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _gpu_clocks(index)
    if device.type == "cpu":
        return _cpu_clocks()
    return None


def throttled(start: dict[str, Any] | None, end: dict[str, Any] | None, drop: float = 0.1) -> bool:
    """True when the SM (or CPU) clock fell by more than `drop` within a cell."""
    if not start or not end:
        return False
    for key in ("sm_clock_mhz", "cpu_mhz_mean"):
        a, b = start.get(key), end.get(key)
        if a and b is not None and b < a * (1.0 - drop):
            return True
    return False


def device_name(device: torch.device | str) -> str:
    """Human-readable device name: the GPU's name, or the CPU model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_model()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_info() -> dict[str, Any]:
    """Hostname, OS, CPU model and count, total memory (for env.json)."""
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem_total_bytes(),
    }


def mem_total_bytes() -> int | None:
    """MemTotal of /proc/meminfo in bytes (Linux), else None: the verdict's CPU capacity."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_info(device: torch.device | str) -> dict[str, Any]:
    """Driver, CUDA, memory and compute capability of a CUDA device (empty dict on CPU)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(device)
    info: dict[str, Any] = {
        "gpu_name": props.name,
        "gpu_memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "cuda_runtime": torch.version.cuda,
        "driver": None,
    }
    nv = _nvml()
    if nv is not None:
        try:
            drv = nv.nvmlSystemGetDriverVersion()
            info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        except Exception:
            pass
    return info
