"""Known hardware, and which JAX backend to start.

Peak figures are dense bf16 matmul TFLOP/s per chip (per GPU) from the vendors'
published specifications; MFU is measured against them. A CPU has no published
figure that means anything for XLA, so its peak is measured with a matmul.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import os
import re
import shutil
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from MaxText.errors import ConfigError

# GPU device_kind prefix (lower case) -> published peak dense bf16 TFLOP/s per GPU. TPU
# figures live once, in TPU_GENERATIONS.
GPU_PEAK_TFLOPS: dict[str, float] = {
    "nvidia b200": 2250.0,
    "nvidia h200": 989.0,
    "nvidia gh200": 989.0,
    "nvidia h100": 989.0,  # SXM, and JAX's name for it ("NVIDIA H100 80GB HBM3")
    "nvidia h100 pcie": 756.0,
    "nvidia h100 nvl": 835.0,
    "nvidia a100": 312.0,
    "nvidia l40s": 362.0,
    "nvidia l40": 181.0,
    "nvidia l4": 121.0,
}

PLATFORMS_FOR_HARDWARE = {"tpu": "tpu,cpu", "gpu": "cuda,cpu", "cpu": "cpu"}

# The platform families code chooses by; JAX names a GPU backend by its vendor's runtime.
FAMILIES = ("tpu", "gpu", "cpu")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def platform_family(platform: str) -> str:
  """"tpu", "gpu" or "cpu" for a JAX platform name ("cuda" and "rocm" are GPUs); any other
  backend keeps its own (lower-case) name."""
  name = platform.strip().lower()
  return "gpu" if name in GPU_PLATFORMS else name


def device_family(device: object) -> str:
  """platform_family of a device (anything with a `platform`, e.g. a topology's device)."""
  return platform_family(str(getattr(device, "platform", "")))


@dataclasses.dataclass(frozen=True)
class DeviceTarget:
  """The devices a run (or an AOT compile) targets."""

  platform: str  # "cpu", "gpu" or "tpu"
  device_kind: str
  num_devices: int
  num_processes: int = 1
  num_slices: int = 1


def has_tpu() -> bool:
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
    hardware = "tpu" if has_tpu() else "gpu" if _has_nvidia_gpu() else "cpu"
  platforms = PLATFORMS_FOR_HARDWARE[hardware]
  jax.config.update("jax_platforms", platforms)
  return platforms


def requested_platform() -> str:
  """"cpu", "gpu" or "tpu": the first platform JAX will start (without starting it)."""
  platforms = os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms", None) or ""
  first = platform_family(platforms.split(",")[0])
  if first in FAMILIES:
    return first
  return "tpu" if has_tpu() else "gpu" if _has_nvidia_gpu() else "cpu"


def local_target() -> DeviceTarget:
  """Describes the devices of this (possibly multi-process) run. Starts the JAX backend."""
  devices = jax.devices()
  # TPU devices name their slice; elsewhere each process (a GPU node, a CPU host) counts as
  # one, so the dcn_* degrees span processes and the ici_* degrees stay inside one.
  if devices[0].platform == "tpu":  # multi-process CPU devices carry a slice_index too, always 0
    num_slices = len({d.slice_index for d in devices})
  else:
    num_slices = jax.process_count()
  return DeviceTarget(
      platform=device_family(devices[0]),
      device_kind=devices[0].device_kind,
      num_devices=len(devices),
      num_processes=jax.process_count(),
      num_slices=num_slices,
  )


def known_peak_tflops(device_kind: str) -> float | None:
  """Published peak bf16 TFLOP/s for a device kind, or None if unknown."""
  generation = tpu_generation_of(device_kind)
  if generation is not None:
    return generation.peak_tflops
  kind = device_kind.lower()
  for prefix in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # the longest name that matches
    # Whole words only: "nvidia l4" is no prefix of "NVIDIA L40S", a GPU three times as fast.
    if kind == prefix or kind.startswith((prefix + " ", prefix + "-")):
      return GPU_PEAK_TFLOPS[prefix]
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
    return float("nan"), f"no published peak for device kind {target.device_kind!r}: MFU not reported"
  return peak, f"published peak of {target.device_kind}"


# ---- TPU topologies for ahead-of-time compilation (train_compile.py)


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
  """Per-generation facts libtpu needs to describe a topology, and what MFU is measured against.

  The memory and FLOP/s figures are per JAX device: one chip, except on tpu7x, whose two
  TensorCores are two devices, each with half the chip's HBM and peak (getting_started/AOT.md,
  "v6e and tpu7x", cites every figure)."""

  name: str  # user-facing prefix: "v5e" in "v5e-256"
  topology_prefix: str  # libtpu's name: "v5" for v5p, "v5e", ...
  device_kind: str  # what jax.Device.device_kind reports on the real chip
  chip_config: str  # "megacore": one JAX device drives both TensorCores of a chip
  cores_per_chip: int  # v4/v5p/tpu7x names count TensorCores (v4-8 is 4 chips), v5e/v6e names count chips
  torus_dims: int
  hbm_gib: float  # per device
  peak_tflops: float  # dense bf16 per device
  # Derived as peak FLOP/s per device / its MXUs' FLOPs per cycle (4 MXUs of 128^2 MACs per TensorCore,
  # of 256^2 on v6e and tpu7x, x 2; AOT.md says why four on v6e); turns the compiler's cycles into seconds.
  clock_ghz: float
  sizes: tuple[int, ...]  # the published slice names' numbers
  # The host VM's memory per device in GiB (published RAM of a 4-chip VM / its devices; getting_started/Planner.md
  # cites them): what offloaded activations and optimizer state share. None: no published figure.
  host_gib: float | None = None
  devices_per_chip: int = 1  # JAX devices per chip: 2 on tpu7x
  peak_fp8_tflops: float | None = None  # dense fp8 per device, where published

  @property
  def device_unit(self) -> str:
    """What one JAX device is, for messages: a chip, or a TensorCore where a chip shows as several."""
    return "chip" if self.devices_per_chip == 1 else "TensorCore"


def _v5p_sizes() -> tuple[int, ...]:
  return (8, 16, 32, 64) + tuple(range(128, 12288 + 1, 128))


def _tpu7x_sizes() -> tuple[int, ...]:
  """One chip, the shapes below a 4x4x4 cube, then whole cubes up to the 9,216-chip pod."""
  return (2, 8, 16, 32, 64) + tuple(range(128, 2 * 9216 + 1, 128))


TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v4": TpuGeneration("v4", "v4", "TPU v4", "megacore", 2, 3, 32.0, 275.0, 1.05,
                        (8, 16, 32, 64, 128, 256, 384, 512, 1024, 1536, 2048, 4096)),
    "v5e": TpuGeneration("v5e", "v5e", "TPU v5 lite", "default", 1, 2, 16.0, 197.0, 1.5,
                         (1, 4, 8, 16, 32, 64, 128, 256), host_gib=192e9 / 4 / 2**30),  # 192 GB per 4-chip VM
    "v5p": TpuGeneration("v5p", "v5", "TPU v5", "megacore", 2, 3, 95.0, 459.0, 1.75, _v5p_sizes(),
                         host_gib=448e9 / 4 / 2**30, peak_fp8_tflops=459.0),  # 448 GB per 4-chip host
    "v6e": TpuGeneration("v6e", "v6e", "TPU v6 lite", "default", 1, 2, 32.0, 918.0, 1.75,
                         (1, 4, 8, 16, 32, 64, 128, 256), host_gib=720e9 / 4 / 2**30,  # 720 GB per 4-chip VM
                         peak_fp8_tflops=918.0),
    # Two TensorCores per chip, each its own JAX device: per-device figures are half the chip's.
    "tpu7x": TpuGeneration("tpu7x", "tpu7x", "TPU7x", "default", 2, 3, 192.0 / 2, 2307.0 / 2, 2.2, _tpu7x_sizes(),
                           host_gib=960e9 / 4 / 2 / 2**30, devices_per_chip=2,  # 960 GB per 4-chip VM
                           peak_fp8_tflops=4614.0 / 2),
}


def tpu_generation_of(device_kind: str) -> TpuGeneration | None:
  """The TPU generation of a device as JAX names its kind ("TPU v5 lite": v5e, "TPU v5": v5p) or by its
  slice name ("TPU v5e", "TPU v5p"); None for another. The whole name: "TPU v4 lite" (v4i) is no v4, and
  "TPU7" no tpu7x."""
  kind = " ".join(device_kind.lower().split())
  return next((g for g in TPU_GENERATIONS.values() if kind in (g.device_kind.lower(), f"tpu {g.name}")), None)


# 2D (v5e/v6e) slice shapes; a side of 16 is a full ring and wraps around.
_TORUS_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_SMALL_3D = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}  # below one 4x4x4 cube


def _cube_shape(chips: int) -> tuple[int, int, int]:
  """3D slices of >= 64 chips are built from 4x4x4 cubes: among the ways to stack chips/64
  cubes as a x b x c (a <= b <= c), the most compact (smallest a + b + c, then smallest c)."""
  cubes = chips // 64
  best = None
  for a in range(1, cubes + 1):
    for b in range(a, cubes // a + 1):
      c, rest = divmod(cubes, a * b)
      if rest or c < b:
        continue
      key = (a + b + c, c)
      if best is None or key < best[0]:
        best = (key, (a, b, c))
  assert best is not None
  return tuple(4 * d for d in best[1])  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class TpuTopology:
  """One slice of a named TPU type, e.g. v5e-256 (256 chips on 64 hosts, a 16x16 torus)."""

  name: str
  generation: TpuGeneration
  chips: int
  chips_per_host: int
  shape: tuple[int, ...]

  @property
  def hosts(self) -> int:
    return self.chips // self.chips_per_host

  @property
  def topology_name(self) -> str:
    """libtpu's name for the slice: "v5e:16x16", "v5:4x4x8"."""
    return f"{self.generation.topology_prefix}:{'x'.join(map(str, self.shape))}"

  @property
  def host_bounds(self) -> tuple[int, int, int]:
    return (1, 1, 1) if self.chips_per_host == 1 else (2, 2, 1)

  @property
  def wrap(self) -> tuple[bool, bool, bool]:
    """Torus wrap-around links: 3D slices of whole cubes wrap; a 2D side wraps at full length 16."""
    if self.generation.torus_dims == 3:
      return (self.chips >= 64,) * 3
    return (self.shape[0] == 16, self.shape[1] == 16, False)

  @property
  def devices(self) -> int:
    """JAX devices per slice: one per chip, two per tpu7x chip."""
    return self.chips * self.generation.devices_per_chip

  def target(self, num_slices: int = 1) -> DeviceTarget:
    """The DeviceTarget a Config is built for: every device of every slice."""
    return DeviceTarget(platform="tpu", device_kind=self.generation.device_kind,
                        num_devices=self.devices * num_slices, num_processes=self.hosts * num_slices,
                        num_slices=num_slices)


def known_topology_names() -> list[str]:
  return [f"{g.name}-{n}" for g in TPU_GENERATIONS.values() for n in g.sizes]


def _abbreviated_names() -> str:
  """The valid names per generation; the long runs (v5p and tpu7x: every multiple of 128) as first...last, the
  sizes below them each named (a reader of `v5p-8 ... v5p-12288` could not tell that v5p-16 is one)."""
  parts = []
  for g in TPU_GENERATIONS.values():
    if len(g.sizes) <= 12:
      parts.append(", ".join(f"{g.name}-{n}" for n in g.sizes))
    else:
      small = ", ".join(f"{g.name}-{n}" for n in g.sizes if n < 128)
      parts.append(f"{small}, then every multiple of 128 from {g.name}-128 to {g.name}-{g.sizes[-1]}")
  return "; ".join(parts)


# What users type for a generation that Cloud TPU names otherwise (Ray's and GKE's labels, gcloud's v5e
# accelerator type, the chips' own names): suggested in the error, not accepted, so one name means one slice.
_OTHER_SPELLINGS = {"v7x": "tpu7x", "v7": "tpu7x", "tpu7": "tpu7x", "ironwood": "tpu7x", "v6": "v6e",
                    "trillium": "v6e", "v5litepod": "v5e", "v5lite": "v5e"}


def _slice_shape(generation: TpuGeneration, chips: int) -> tuple[int, ...]:
  if generation.torus_dims == 2:
    return _TORUS_2D[chips]
  return _SMALL_3D[chips] if chips < 64 else _cube_shape(chips)


def _near_name(gen_name: str, size_text: str) -> str:
  """The valid name a wrong one most likely meant, as ` (did you mean ...?)`, or "": another spelling of a
  generation (`v7x-8`), or a slice given by its shape as GKE and libtpu write it (`tpu7x-2x2x1`, `v6e:2x4`)."""
  named = _OTHER_SPELLINGS.get(gen_name, gen_name)
  generation = TPU_GENERATIONS.get(named) or next(
      (g for g in TPU_GENERATIONS.values() if g.topology_prefix == gen_name), None)  # libtpu's "v5" is v5p
  if generation is None:
    return ""
  if _digits(size_text) and int(size_text) in generation.sizes:
    return f" (did you mean '{generation.name}-{int(size_text)}'? Cloud TPU names this generation {generation.name})"
  dims = size_text.split("x")
  if len(dims) in (2, 3) and all(_digits(d) for d in dims):
    wanted = sorted(int(d) for d in dims if int(d) != 1)  # 2x2x1 and 2x2 are the same chips
    for size in generation.sizes:
      if sorted(d for d in _slice_shape(generation, size // generation.cores_per_chip) if d != 1) == wanted:
        return (f" (did you mean '{generation.name}-{size}'? a slice type is named by its count of "
                f"{'TensorCores' if generation.cores_per_chip > 1 else 'chips'}, not its {size_text} shape)")
  return ""


def _digits(text: str) -> bool:
  """A size int() reads: ASCII digits only (str.isdigit() also passes "²", which int() refuses) and no longer than a
  slice count is (past 4300 digits int() refuses too): either was a traceback, not a line."""
  return text.isascii() and text.isdigit() and len(text) <= 12


def _other_separator(text: str) -> str:
  """` (did you mean ...?)` for a valid name typed with another separator, none, or a `tpu` before it (`v6e_8`,
  `v6e8`, `tpu-v6e-8`), or "". Two separators in a row (`v6e--8`) may be a sign, so no guess is made."""
  if re.search(r"[-_ :]{2}", text):
    return ""
  squashed = re.sub(r"[-_ :]", "", text)
  if squashed.startswith("tpuv"):
    squashed = squashed[3:]
  names = sorted([*TPU_GENERATIONS, *_OTHER_SPELLINGS], key=len, reverse=True)
  for gen_name in names:
    size_text = squashed[len(gen_name):]
    if squashed.startswith(gen_name) and _digits(size_text):
      generation = TPU_GENERATIONS[_OTHER_SPELLINGS.get(gen_name, gen_name)]
      if int(size_text) not in generation.sizes:
        return ""
      why = (f"Cloud TPU names this generation {generation.name}" if gen_name in _OTHER_SPELLINGS else
             "a slice type is written <generation>-<size>")
      return f" (did you mean '{generation.name}-{int(size_text)}'? {why})"
  return ""


def _past_largest(generation: TpuGeneration | None, size_text: str) -> str:
  """A size past the generation's largest slice that whole slices of it make: the multislice spelling."""
  if generation is None or not _digits(size_text):
    return ""
  size, largest = int(size_text), generation.sizes[-1]
  if size <= largest or size % largest:
    return ""
  unit = "TensorCores" if generation.cores_per_chip > 1 else "chips"
  return (f" ({generation.name}'s largest slice is {generation.name}-{largest}: for {size} {unit} give "
          f"compile_topology={generation.name}-{largest} compile_topology_num_slices={size // largest})")


def tpu_topology(name: str) -> TpuTopology:
  """`v5e-256` -> its TpuTopology; an unknown name is a ConfigError listing the valid ones."""
  gen_name, _, size_text = name.strip().lower().replace(":", "-").partition("-")
  generation = TPU_GENERATIONS.get(gen_name)
  if generation is None or not _digits(size_text) or int(size_text) not in generation.sizes:
    hint = (_near_name(gen_name, size_text) or _other_separator(name.strip().lower())
            or _past_largest(generation, size_text))
    raise ConfigError(f"unknown compile_topology {name.strip()!r}{hint}; valid names: {_abbreviated_names()}")
  size = int(size_text)  # "v6e-08" is v6e-8: the name the report and a saved step's header carry
  chips = size // generation.cores_per_chip
  return TpuTopology(name=f"{generation.name}-{size}", generation=generation, chips=chips,
                     chips_per_host=1 if chips == 1 else 4, shape=_slice_shape(generation, chips))


def libtpu_version() -> str:
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return "none installed"


def cannot_describe_message(topology: TpuTopology, libtpu_error: str) -> str:
  """One line for a topology the installed libtpu does not know (libtpu's own first line kept)."""
  lines = libtpu_error.strip().splitlines()
  return (f"the installed libtpu ({libtpu_version()}) cannot describe compile_topology={topology.name} "
          f"({topology.topology_name}): {lines[0] if lines else 'no reason given'}; install a libtpu that knows "
          f"{topology.generation.name} (pip install -U libtpu) or compile for another topology")
