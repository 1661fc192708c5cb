"""Known hardware, and which JAX backend to start.

Peak figures are dense bf16 matmul TFLOP/s per chip (per GPU) from the vendors'
published specifications; MFU is measured against them. A CPU has no published
figure that means anything for XLA, so its peak is measured with a matmul.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from MaxText.errors import ConfigError

# device_kind prefix (lower case) -> (peak bf16 TFLOP/s per device, HBM GiB per device).
# Longer prefixes are tried first, so "tpu v5 lite" wins over "tpu v5".
KNOWN_DEVICES: dict[str, tuple[float, float]] = {
    "tpu v4": (275.0, 32.0),
    "tpu v5 lite": (197.0, 16.0),  # v5e
    "tpu v5e": (197.0, 16.0),
    "tpu v5p": (459.0, 95.0),
    "tpu v5": (459.0, 95.0),  # v5p reports itself as "TPU v5"
    "tpu v6 lite": (918.0, 32.0),  # v6e (Trillium)
    "tpu v6e": (918.0, 32.0),
    "nvidia h200": (989.0, 141.0),
    "nvidia h100": (989.0, 80.0),  # SXM
    "nvidia a100": (312.0, 80.0),
    "nvidia l4": (121.0, 24.0),
}

PLATFORMS_FOR_HARDWARE = {"tpu": "tpu,cpu", "gpu": "cuda,cpu", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class DeviceTarget:
  """The devices a run (or an AOT compile) targets."""

  platform: str  # "cpu", "gpu" or "tpu"
  device_kind: str
  num_devices: int
  num_processes: int = 1
  num_slices: int = 1


def _has_tpu() -> bool:
  # TPU VMs expose /dev/accel* (v2-v4) or VFIO groups (v5e and later), or name a TPU type.
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_ACCELERATOR_TYPE"))


def _has_nvidia_gpu() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*") or shutil.which("nvidia-smi"))


def select_jax_platforms(hardware: str) -> str | None:
  """Chooses JAX_PLATFORMS before the backend starts, so an installed libtpu never
  makes a CPU/GPU machine try (and noisily fail) to start a TPU backend.

  Returns the value set, or None when the user's own JAX_PLATFORMS is kept.
  """
  if os.environ.get("JAX_PLATFORMS"):
    return None
  if hardware not in ("auto", *PLATFORMS_FOR_HARDWARE):
    raise ConfigError(f"hardware must be one of auto, tpu, gpu, cpu; got {hardware!r}")
  if hardware == "auto":
    hardware = "tpu" if _has_tpu() else "gpu" if _has_nvidia_gpu() else "cpu"
  platforms = PLATFORMS_FOR_HARDWARE[hardware]
  jax.config.update("jax_platforms", platforms)
  return platforms


def _platform_of(device: jax.Device) -> str:
  return "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform


def local_target() -> DeviceTarget:
  """Describes the devices of this (possibly multi-process) run. Starts the JAX backend."""
  devices = jax.devices()
  slice_ids = {getattr(d, "slice_index", 0) for d in devices}
  return DeviceTarget(
      platform=_platform_of(devices[0]),
      device_kind=devices[0].device_kind,
      num_devices=len(devices),
      num_processes=jax.process_count(),
      num_slices=len(slice_ids),
  )


def known_peak_tflops(device_kind: str) -> float | None:
  """Published peak bf16 TFLOP/s for a device kind, or None if unknown."""
  kind = device_kind.lower()
  for prefix in sorted(KNOWN_DEVICES, key=len, reverse=True):
    if kind.startswith(prefix):
      return KNOWN_DEVICES[prefix][0]
  return None


def measure_matmul_tflops(
    size: int = 2048, dtype: jnp.dtype = jnp.float32, repeats: int = 5, devices: Sequence[jax.Device] | None = None
) -> float:
  """Best achieved TFLOP/s of a square matmul on one device (the CPU's practical peak)."""
  device = (devices or jax.local_devices())[0]
  a = jax.device_put(jnp.ones((size, size), dtype), device)
  matmul = jax.jit(lambda x: x @ x)
  for _ in range(2):  # compile, then let the thread pool spin up
    matmul(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best / 1e12


def peak_tflops_per_device(target: DeviceTarget, cpu_peak_tflops: float) -> tuple[float, str]:
  """(peak TFLOP/s per device, where the figure comes from) for MFU."""
  if target.platform == "cpu":
    if cpu_peak_tflops > 0:
      return cpu_peak_tflops, "cpu_peak_tflops from the config"
    # Simulated devices share the host's cores, so one device's peak is the host's
    # matmul rate divided among them.
    host_rate = measure_matmul_tflops()
    per_device = host_rate / max(1, len(jax.local_devices()))
    return per_device, f"measured: best 2048^3 float32 matmul at {host_rate:.3f} TFLOP/s per host"
  peak = known_peak_tflops(target.device_kind)
  if peak is None:
    return float("nan"), f"unknown device kind {target.device_kind!r}: MFU not reported"
  return peak, f"published peak of {target.device_kind}"
