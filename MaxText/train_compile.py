"""Compile the train step ahead of time for a TPU topology you do not have (or for this
machine's devices), report whether it fits, and optionally save the executable:

  python3 -m MaxText.train_compile configs/base.yml compile_topology=v5e-256 \
      compile_topology_num_slices=2 global_parameter_scale=16 per_device_batch_size=4 \
      [compiled_trainstep_file=step.aot]

The mesh, state shardings and step are the ones train.py builds (run_assembly.build_run);
only the devices differ: libtpu describes the topology and XLA
compiles for it without any TPU attached. `compile_topology=local` compiles for the local
devices instead. The saved file is executable code (see MaxText/training/compiled_step.py): load it only
from a trusted source, with `train.py ... compiled_trainstep_file=PATH`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

if __package__ in (None, ""):  # `python3 MaxText/train_compile.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

import jax
from jax.experimental.compilation_cache import compilation_cache

from MaxText import startup
from MaxText.training import compiled_step
from MaxText.training import lora, metrics, run_assembly
from MaxText.platform import accelerators
from MaxText.configuration import config as config_lib
from MaxText.aot.hlo_cycles import estimated_cycles, uncosted_kernel_calls
from MaxText.aot.step_time import report as step_report
from MaxText.aot.step_time import saved as saved_step
from MaxText.aot.memory_report import (GIB, MemoryReport, Offload, buffer_assignment_dump_options,
                                       does_not_fit_message, format_bytes, host_memory_message, off_heap_message,
                                       offload_of, parse_xla_oom, describe_state, read_buffer_assignment,
                                       state_bytes_per_chip)
from MaxText.errors import UserError, run_cli
from MaxText.layers import pipeline
from MaxText.layers.attention import select_kernel
from MaxText.rl import rollout_mesh
from MaxText.rl.rollouts import compile_rollout_step
from MaxText.inference.engine import Engine


TOOL = startup.Tool("train_compile", reads_run=True, compiles_for="slice or local")


def load_target_config(argv: list[str]) -> tuple[config_lib.Config, Sequence[Any], accelerators.TpuTopology | None]:
  """The config for the compile target, its devices, and the TPU topology (None for local).

  Flags are exported before libtpu or a backend starts, so the compiled step reflects them.
  """
  started = startup.start(TOOL, argv)
  return started.config, started.devices, started.topology


@contextlib.contextmanager
def _buffer_report_dir() -> Iterator[str | None]:
  """A temporary folder for XLA's buffer-assignment report of the train step (the exact
  device-memory layout, read by `report`); None when the user already dumps elsewhere."""
  if "--xla_dump_to" in os.environ.get("XLA_FLAGS", ""):
    yield None
    return
  with tempfile.TemporaryDirectory(prefix="train_compile_") as report_dir:
    yield report_dir


def compile_or_explain(step_fn: Any, inputs: run_assembly.StepInputs, topology: accelerators.TpuTopology | None,
                       compiler_options: dict[str, str] | None = None, offload: Offload | None = None) -> Any:
  """Lowers and compiles; XLA's out-of-memory error becomes a one-line 'does not fit' naming the
  memory that ran out (`offload`: the run's settings, for what to change when it is the host's)."""
  try:
    return step_fn.lower(*inputs.as_args()).compile(compiler_options=compiler_options)
  except jax.errors.JaxRuntimeError as e:
    message = str(e)
    if "RESOURCE_EXHAUSTED" not in message or topology is None:
      raise
    first_line = message.strip().splitlines()[0]
    oom = parse_xla_oom(first_line)
    off_heap = off_heap_message(message, oom, topology.generation, offload)
    if off_heap:
      raise UserError(off_heap) from None
    # XLA's figure is its whole device heap, arguments included, even where it says "HLO
    # temporaries" (getting_started/AOT.md shows the heaps it extrapolates from).
    # The state's parts are a device's too: a TensorCore's on tpu7x.
    unit = topology.generation.device_unit
    state = describe_state(state_bytes_per_chip(inputs.state), unit)
    raise UserError(does_not_fit_message(oom.needed, topology.generation.name, topology.generation.hbm_gib,
                                         "; ".join(filter(None, (f"XLA: {first_line}", state))), unit)) from None


def report(config: config_lib.Config, topology: accelerators.TpuTopology | None, compiled: Any,
           report_dir: str | None = None, objective: metrics.CountedObjective | None = None,
           target: saved_step.StepTarget | None = None) -> MemoryReport:
  """Prints memory per device, FLOPs (`objective`'s, see metrics.objective_tflops_per_step; None: language
  modelling), the compiler's step-time estimate and, given the step's `target`, the step-time model's prediction."""
  memory = MemoryReport.from_compiled(compiled, read_buffer_assignment(report_dir))
  print("memory per device (XLA memory analysis of the compiled step):")
  print("\n".join(memory.lines(topology.generation.device_unit if topology is not None else "chip")))
  if topology is not None:
    gen = topology.generation
    print(f"  HBM per {gen.name} {gen.device_unit} {gen.hbm_gib:g} GiB: {memory.total / (gen.hbm_gib * GIB):.1%} used")
  flops = metrics.objective_tflops_per_step(config, objective) if objective is not None else \
      metrics.training_tflops_per_step(config.model, config.data.global_batch_size, config.data.max_target_length,
                                       images_per_row=config.data.max_images_per_row)
  num_devices = config.mesh.num_devices  # the training mesh's (a rollout mesh's devices run no step)
  batch = metrics.batch_words(config.data.global_batch_size, config.data.max_target_length,
                              config.data.max_images_per_row)
  print(f"model FLOPs per step: {flops.total_tflops:,.4g} TFLOP ({flops.total_tflops / num_devices:,.4g} per device; "
        f"{batch})")
  hlo_text = compiled.as_text() if topology is not None else ""
  cycles = estimated_cycles(hlo_text) if topology is not None else None
  if cycles is None or topology is None:
    print("compiler estimate of step time: not available for this platform")
  elif cycles == 0:  # estimates present but none on the instructions one execution runs: no time to divide by
    print("compiler estimate of step time: not available (the compiled step's cycle estimates add up to 0)")
  else:
    gen = topology.generation
    seconds = cycles / (gen.clock_ghz * 1e9)
    mfu = flops.total_tflops / num_devices / seconds / gen.peak_tflops
    print(f"compiler estimate (not a measurement): step {seconds * 1e3:,.1f} ms = {cycles:,} cycles at {gen.clock_ghz:g} GHz, "
          f"assuming communication hidden behind compute -> implied MFU {mfu:.1%} of {gen.peak_tflops:g} TFLOP/s")
    kernels = uncosted_kernel_calls(hlo_text)
    if kernels:
      print(f"  not in it: {kernels:,} Pallas kernel calls per step, which the compiler gives no cycle estimate"
            + _kernel_floor(config, flops.attention_tflops / num_devices, seconds, flops.total_tflops / num_devices,
                            gen.peak_tflops))
    if target is not None:
      _print_step_model(hlo_text, target, gen.peak_tflops)
  return memory


def _print_step_model(hlo_text: str, target: saved_step.StepTarget, peak_tflops: float) -> None:
  """The step-time model's prediction (MaxText/aot/step_time): compute, exposed communication and
  host transfers from the scheduled HLO; a generation without network figures says so."""
  try:
    prediction = step_report.predict(hlo_text, target)
    scheduled = step_report.predict(hlo_text, target, overlap="scheduled")
  except UserError as e:
    print(f"step-time model: not available ({e})")
    return
  print("\n".join(step_report.lines(prediction, peak_tflops, scheduled)))


def _kernel_floor(config: config_lib.Config, attention_tflops: float, seconds: float, total_tflops: float,
                  peak_tflops: float) -> str:
  """With splash (attention=flash on TPU) the uncosted work is attention's: its FLOPs at the chip's
  peak are the least time it adds. `autoselected` as it resolves on TPU: where it runs dot_product the
  Pallas calls are another kernel's (sparse_matmul's grouped matmuls), not splash's."""
  if select_kernel(config.model.attn.attention, "tpu", config.model) != "flash":
    return ""
  floor = attention_tflops / peak_tflops
  return (f"; with splash attention that is attention's {attention_tflops:,.4g} TFLOP per device, at least "
          f"{floor * 1e3:,.1f} ms more at peak -> MFU at most {total_tflops / (seconds + floor) / peak_tflops:.1%}")


@contextlib.contextmanager
def _without_persistent_cache(active: bool) -> Iterator[None]:
  """A step written to compiled_trainstep_file is compiled afresh: an executable JAX's persistent
  compilation cache handed back serialises without all its code (loading it fails at the first
  step). The cache decides once per process whether it is used, hence the resets."""
  if not active:
    yield
    return
  previous = bool(getattr(jax.config, "jax_enable_compilation_cache"))
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", previous)
    compilation_cache.reset_cache()


def main(argv: list[str]) -> int:
  with _buffer_report_dir() as report_dir:
    return _compile_and_report(argv, report_dir)


def _compile_and_report(argv: list[str], report_dir: str | None) -> int:
  config, devices, topology = load_target_config(argv)
  # A rollout mesh of its own (rl_rollout_devices): the train step on the first devices, the rollout
  # step on the last, as rollout_mesh.split_devices lays out a run.
  train_devices, rollout_devices = rollout_mesh.split_devices(config, devices)
  where = f"{config.mesh.num_slices} x {topology.name} ({topology.topology_name}, {topology.hosts} hosts of " \
          f"{topology.chips_per_host} chips per slice" + (f", {topology.generation.devices_per_chip} devices per chip"
          if topology.generation.devices_per_chip > 1 else "") + ")" if topology else \
          f"the local {config.target.platform} devices"
  print(f"compiling for {where}: {len(devices)} devices, {config.target.device_kind}" +
        (f"; {len(train_devices)} train, the last {len(rollout_devices)} roll out" if rollout_devices else ""))
  for name in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"):
    if os.environ.get(name):
      print(f"  {name}={os.environ[name]}")
  run = run_assembly.build_run(config, devices=train_devices, compiled_step=False)
  print(f"mesh: {run.mesh_description()}")
  if config.model.pipeline.num_pipeline_stages > 1:
    print(pipeline.describe(config.model.pipeline))
  print(f"parameters: {run.num_params / 1e9:.3f} B ({run.num_params:,})")
  if run.lora_description():
    print(run.lora_description())
  inputs = run.abstract_inputs()
  start = time.perf_counter()
  # The report options go to this compile only (XLA reads XLA_FLAGS once per process).
  options = buffer_assignment_dump_options(report_dir) if report_dir and topology else None
  with _without_persistent_cache(bool(config.startup.compiled_trainstep_file)):
    compiled = compile_or_explain(run.train_step, inputs, topology, options, offload_of(config))
  print(f"compiled in {time.perf_counter() - start:.1f} s")
  target = step_target(config, topology, run) if topology is not None else None
  memory = report(config, topology, compiled, report_dir, run.objective, target)
  parts = state_bytes_per_chip(inputs.state)
  state_parts = describe_state(parts, topology.generation.device_unit if topology is not None else "chip")
  if any(name not in ("parameters", "optimizer state") for name, _ in parts):  # the objective's own (a teacher)
    print(f"  {state_parts}")
  stem = saved_step.save_requested()
  if stem and target is not None:
    saved_step.save_step(stem, compiled.as_text(), target, {"memory_total": memory.total})
    print(f"saved the compiled HLO to {stem}.hlo.gz")
  if topology is not None:
    gen = topology.generation
    if memory.total > gen.hbm_gib * GIB:
      raise UserError(does_not_fit_message(memory.total, gen.name, gen.hbm_gib, f"{memory.source}; {state_parts}",
                                           gen.device_unit))
    host = memory.host
    if gen.host_gib is not None and host > gen.host_gib * GIB:  # XLA accepts it; the host VM has less
      raise UserError(host_memory_message(host, gen, offload_of(config), "XLA buffer assignment, host memory space"))
    print(f"fits: {format_bytes(memory.total)} of {gen.hbm_gib:g} GiB per {gen.name} {gen.device_unit}" +
          (f"; {format_bytes(host)} of host memory per {gen.device_unit} ({gen.host_gib:.1f} GiB)"
           if host and gen.host_gib else ""))
  if run.objective.uses_rollouts and rollout_devices:
    _compile_rollout_mesh(config, rollout_devices, inputs.state.params, topology)
  elif run.objective.uses_rollouts:
    _compile_rollout(config, run, inputs)
  path = config.startup.compiled_trainstep_file
  if path:
    size = compiled_step.save_compiled_step(path, compiled, compiled_step.step_header(config, inputs, topology.name if topology else "local"))
    print(f"saved the compiled train step to {path} ({size / 2**20:.1f} MiB); it is executable code: "
          "share and load it only where you trust its origin")
  return 0


def step_target(config: config_lib.Config, topology: accelerators.TpuTopology,
                run: run_assembly.Run) -> saved_step.StepTarget:
  """Where the step runs, for the step-time model: every device's torus coordinates, the mesh, the model FLOPs."""
  flops = metrics.objective_tflops_per_step(config, run.objective)
  num_devices = config.mesh.num_devices  # the training mesh's (a rollout mesh's devices run no step)
  return saved_step.StepTarget.from_devices(topology, config.mesh.num_slices, list(run.mesh.devices.flat),
                                            dict(run.mesh.shape), flops.total_tflops / num_devices,
                                            flops.attention_tflops / num_devices)


def _compile_rollout(config: config_lib.Config, run: run_assembly.Run, inputs: run_assembly.StepInputs) -> None:
  """An RL run also samples: its decode step (the engine's, on the same mesh and parameter
  layout) is compiled and its memory reported beside the train step's."""
  start = time.perf_counter()
  compiled = compile_rollout_step(config, run.mesh, inputs.state.params)
  _print_rollout(config, "rollout step", compiled, start)


def _compile_rollout_mesh(config: config_lib.Config, devices: Sequence[Any], train_params: Any,
                          topology: accelerators.TpuTopology | None) -> None:
  """The rollout side of a split run: the decode step on the rollout devices, laid out (data,
  tensor) with the parameters in the engine's layout there, the weight copy's size and whether it fits."""
  mesh = rollout_mesh.rollout_mesh(config, devices)
  print(f"rollout mesh: {len(devices)} devices, " +
        " x ".join(f"{axis} {size}" for axis, size in mesh.shape.items() if size > 1 or axis in ("data", "tensor")))
  start = time.perf_counter()
  engine = Engine(config, num_slots=config.data.global_batch_size, mesh=mesh)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), train_params,
                        engine.param_shardings)
  compiled = engine.compile_step(params)
  total = _print_rollout(config, "rollout step on the rollout mesh", compiled, start)
  adapters = f", then {format_bytes(rollout_mesh.tree_bytes(lora.split(train_params)[0]))} per sync: the LoRA " \
      "adapters alone (the base stays on the rollout mesh)" if config.model.lora.lora_rank else ""
  print(f"weight copy to the rollout mesh: {format_bytes(rollout_mesh.tree_bytes(train_params))} per sync "
        f"(every rl_weight_sync_interval={config.rl.rl_weight_sync_interval} steps){adapters}")
  if len({d.process_index for d in devices}) > 1:  # rollout_mesh.copy_across_processes: resharded on the trainers
    staged = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(engine.param_shardings)))
    print(f"  across {len({d.process_index for d in devices})} hosts: each sync first reshards on the training chips "
          f"to the rollout layout, {format_bytes(staged)} more per training chip while it runs")
  if topology is not None:
    gen = topology.generation
    if total > gen.hbm_gib * GIB:
      raise UserError(does_not_fit_message(total, gen.name, gen.hbm_gib, "XLA memory analysis of the rollout step",
                                           gen.device_unit))
    print(f"rollout side fits: {format_bytes(total)} of {gen.hbm_gib:g} GiB per {gen.name} {gen.device_unit}")


def _print_rollout(config: config_lib.Config, what: str, compiled: Any, start: float) -> float:
  """Prints the decode step's memory per device; returns its total (arguments, outputs, temporaries)."""
  analysis = compiled.memory_analysis()
  sizes = {name: getattr(analysis, f"{name}_size_in_bytes", 0) for name in ("argument", "output", "temp", "alias")}
  print(f"{what} ({config.data.global_batch_size} completions, one token each, KV cache of "
        f"{config.model.max_target_length} positions): compiled in {time.perf_counter() - start:.1f} s; per device "
        f"arguments {format_bytes(sizes['argument'])} (parameters + cache), temporaries {format_bytes(sizes['temp'])}")
  return float(sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"])


if __name__ == "__main__":
  run_cli(main)
