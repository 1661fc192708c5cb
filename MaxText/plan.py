"""The planner: the fastest configuration that fits a TPU topology, found on a CPU.

  python3 -m MaxText.plan configs/base.yml model_name=llama2-7b compile_topology=v5e-256 \
      [compile_topology_num_slices=N] [global_batch_tokens=T] [max_candidates=4] [budget_minutes=30] \
      [workers=N] [cache_dir=PATH] [write_recipe=PATH]

Every other key=value is a config key, held fixed as a constraint (model shape,
max_target_length, a degree or remat_policy the user wants kept). Two stages:
  1. plan_model.py ranks every candidate of the search space (mesh degrees within and across
     slices, remat policy, optimizer offload, batch, gradient accumulation) by its analytical
     step time among those it estimates to fit in HBM, in seconds;
  2. the best `max_candidates` are compiled ahead of time for the topology (train_compile's
     path) in worker processes, each reporting XLA's device heap, the step-time model's
     prediction from the scheduled HLO (aot/step_time: compute, exposed ICI and DCN, host
     transfers) and the compiler's own estimate. Results are cached on disk under a key of
     everything that affects a compile, so a second identical plan compiles nothing; Ctrl-C
     keeps what finished.
Candidates that fit are ranked by the step-time model's MFU (the compiler's estimate where the
model has no network figures for the generation). The best is printed as a command line and,
with write_recipe=PATH, written as a recipe like configs/v5e/*.sh (EXECUTABLE=train_compile,
DRY_RUN=1, ...) whose header states the prediction and its breakdown.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

if __package__ in (None, ""):  # `python3 MaxText/plan.py`: import the package, not sibling files.
  sys.path[0] = str(Path(__file__).resolve().parent.parent)

from MaxText import startup
from MaxText.aot import plan_model, plan_progress, plan_ranking, plan_recipe, plan_remat, plan_search
from MaxText.aot.plan_ranking import Planned, format_table, rank_compiled
from MaxText.aot.plan_recipe import compile_flags, write_recipe
from MaxText.aot.step_time import report as step_report
from MaxText.aot.step_time.saved import StepTarget
from MaxText.training import compiled_step, lora
from MaxText.training.objectives import distill
from MaxText.platform import accelerators, tpu_launch
from MaxText.configuration import config as config_lib, config_yaml, objective_registry, remat_policies
from MaxText.configuration import rl_config, tool_args
from MaxText.errors import ConfigError, UserError, run_cli
from MaxText.aot.memory_report import GIB
from MaxText.platform.mesh_axes import MeshAxis

REPO = Path(__file__).resolve().parent.parent
# The splash kernel's block sizes (base.yml sa_*): one size for all, tried on the best candidate.
SPLASH_BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
                     "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
# Config keys a candidate may set; one the user gives on the command line or in M_* is kept.
SEARCH_KEYS = (*(axis.ici_key for axis in plan_search.ICI_AXES), *(axis.dcn_key for axis in plan_search.DCN_AXES),
               "pipeline_schedule", "num_pipeline_repeats", "num_pipeline_microbatches",
               "remat_policy", *remat_policies.TENSORS, "optimizer_memory_host_offload", "per_device_batch_size",
               "gradient_accumulation_steps")
COMPILE_MEMORY_GIB = 6  # what one worker's compile may take, for the worker count
HOST_OVERFLOW = "does not fit: host memory"  # how train_compile's line for the host's memory starts


@dataclasses.dataclass(frozen=True)
class PlanArgs:
  """The planner's own key=value arguments (not config keys), with their defaults."""
  global_batch_tokens: int = 0  # 0: not given
  max_candidates: int = 4
  budget_minutes: float = 30.0
  workers: int = 0  # 0: automatic
  cache_dir: str = ""
  write_recipe: str = ""
  headroom: float = 0.1  # share of HBM the analytical estimate must leave free to be short-listed
  attention_blocks: str = "none"  # splash block sizes compiled for the best candidate ("" or "none": none)

  def block_sizes(self) -> list[int]:
    text = self.attention_blocks.strip().lower()
    if text in ("", "none"):
      return []
    try:
      sizes = [int(t) for t in config_yaml.split_items("attention_blocks", text)]
    except ValueError:
      sizes = []
    if not sizes or any(size <= 0 or size % 128 for size in sizes):
      raise ConfigError(f"attention_blocks={self.attention_blocks} must be comma-separated multiples of 128 "
                        "(splash block sizes), or none")
    return sizes

  @classmethod
  def parse(cls, argv: list[str]) -> tuple["PlanArgs", list[str]]:
    """(the planner's arguments, the argv left for the config)."""
    args, rest = tool_args.parse_tool_record(cls, argv[1:])
    args.block_sizes()
    if args.max_candidates < 1:
      raise ConfigError(f"max_candidates must be >= 1, got {args.max_candidates}")
    if not args.budget_minutes > 0:  # nan too: its deadline never comes
      raise ConfigError(f"budget_minutes must be > 0, got {args.budget_minutes:g}")
    if not 0 <= args.headroom < 1:
      raise ConfigError(f"headroom must be in [0, 1), got {args.headroom:g}")
    if args.global_batch_tokens < 0 or args.workers < 0:
      raise ConfigError("global_batch_tokens and workers must be >= 0 (0: not given / automatic)")
    for key in ("cache_dir", "write_recipe"):  # a workstation's files: the recipe runs from a local checkout
      if "://" in getattr(args, key):
        raise ConfigError(f"{key}={getattr(args, key)} must be a local path (the planner's cache and recipe live "
                          "on the machine that runs it)")
    return args, [argv[0], *rest]


def _source_digest() -> str:
  """The code that builds and compiles the step: every module but the planner's own."""
  digest = hashlib.sha256()
  planner = {Path(f).resolve() for f in (__file__, plan_model.__file__, plan_progress.__file__, plan_search.__file__,
                                               plan_ranking.__file__, plan_recipe.__file__, plan_remat.__file__)}
  for path in sorted(p for p in (REPO / "MaxText").rglob("*.py") if p.resolve() not in planner):
    digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
  return digest.hexdigest()


def cache_key(config: config_lib.Config, topology: str, num_slices: int, libtpu_flags: str, xla_flags: str,
              versions: Mapping[str, Any], source_digest: str) -> str:
  """Everything a compile depends on: every resolved config value (the run name excepted), the
  topology, the compiler versions and flags, and the code that builds the step."""
  values = {k: v for k, v in config.values.items() if k != "run_name"}
  payload = {"values": values, "topology": topology, "num_slices": num_slices, "libtpu_flags": libtpu_flags,
             "xla_flags": xla_flags, "versions": dict(versions), "source": source_digest}
  return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def default_cache_dir() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maxtext" / "plan"


def compile_candidate(argv: list[str], libtpu_flags: str, log_path: str) -> dict[str, Any]:
  """Worker process: compiles one candidate for the topology and returns its figures. Its own
  output goes to `log_path` so the parent's progress line stays readable."""
  log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  os.dup2(log, 1)
  os.dup2(log, 2)
  os.environ["LIBTPU_INIT_ARGS"] = libtpu_flags
  return compile_figures(argv)


def compile_figures(argv: list[str]) -> dict[str, Any]:
  """Compiles the train step for the topology `argv` names (train_compile's path): XLA's device
  heap per chip, the step-time model's prediction, the compiler's step time and the compile
  time, or why it did not compile."""
  from MaxText import train_compile
  from MaxText.training import run_assembly  # noqa: PLC0415  (after the flags are set)
  from MaxText.aot.hlo_cycles import estimated_cycles  # noqa: PLC0415
  from MaxText.aot.memory_report import (MemoryReport, buffer_assignment_dump_options, memory_spaces,  # noqa: PLC0415
                                         offload_of, read_buffer_assignment)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="plan_") as report_dir:
    try:
      config, devices, topology = train_compile.load_target_config(argv)
      run = run_assembly.build_run(config, devices=devices, compiled_step=False)
      compiled = train_compile.compile_or_explain(run.train_step, run.abstract_inputs(), topology,
                                                  buffer_assignment_dump_options(report_dir),
                                                  offload_of(config))
    except UserError as e:
      message = str(e)
      status = "does not fit" if message.startswith("does not fit") else "invalid"
      needed = re.search(r"needs ([\d.]+) GiB", message)
      figure = float(needed.group(1)) * GIB if needed else 0.0
      if message.startswith(HOST_OVERFLOW):  # its figure is host memory, not the device heap
        return {"status": "NO (host memory)", "message": message, "compile_s": time.perf_counter() - start,
                "total": 0.0, "host_bytes": figure}
      return {"status": status, "message": message, "compile_s": time.perf_counter() - start, "total": figure}
    compile_s = time.perf_counter() - start
    memory = MemoryReport.from_compiled(compiled, read_buffer_assignment(report_dir))
    vmem = memory_spaces(report_dir).get("vmem", 0)
  hlo_text = compiled.as_text()
  cycles = estimated_cycles(hlo_text)
  figures = {"status": "compiled", "compile_s": compile_s, "total": memory.total, "arguments": memory.arguments,
             "source": memory.source, "host_bytes": memory.host,
             # What XLA's memory-space assignment holds in VMEM beside the heap (a small model's temporaries).
             "vmem": vmem,
             "step_s": cycles / (topology.generation.clock_ghz * 1e9) if cycles and topology else None}
  if topology is not None:
    figures.update(model_figures(hlo_text, train_compile.step_target(config, topology, run), topology))
  return figures


def model_figures(hlo_text: str, target: StepTarget, topology: accelerators.TpuTopology) -> dict[str, Any]:
  """The step-time model's step, MFU and breakdown lines for one compiled candidate, or why it
  has none (a generation without network figures)."""
  try:
    prediction = step_report.predict(hlo_text, target)
  except UserError as e:
    return {"model_error": str(e)}
  return {"model_step_s": prediction.step_s, "model_mfu": prediction.mfu,
          "model_lines": step_report.lines(prediction, topology.generation.peak_tflops)}


def _workers(requested: int, todo: int) -> int:
  if requested:
    return max(1, min(requested, todo))
  try:
    free_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
  except (ValueError, OSError):
    free_gib = COMPILE_MEMORY_GIB
  return max(1, min(os.cpu_count() or 1, int(free_gib // COMPILE_MEMORY_GIB), todo))


def _compile_all(planned: list[Planned], config_argv: list[str], flags: str, cache_dir: Path, args: PlanArgs) -> bool:
  """Compiles every uncached candidate; each result is cached as it arrives. False when the
  budget ran out first (the rest are left uncompiled)."""
  todo = [p for p in planned if p.result is None]
  if not todo:
    return True
  workers = _workers(args.workers, len(todo))
  print(f"compiling {len(todo)} candidates in {workers} worker process{'es' if workers > 1 else ''} "
        f"(budget {args.budget_minutes:g} min); cache: {cache_dir}", flush=True)
  progress = plan_progress.Progress(len(todo), workers)
  deadline = time.monotonic() + args.budget_minutes * 60
  context = multiprocessing.get_context("spawn")
  executor = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1)
  logs = {p.key: cache_dir / f"{p.key}.log" for p in todo}
  for log in logs.values():  # a worker creates its log as it starts: that is how a start is seen
    log.unlink(missing_ok=True)
  futures = {executor.submit(compile_candidate, config_argv + p.argv_values(), flags, str(logs[p.key])): p
             for p in todo}
  announced: set[str] = set()

  def announce(p: Planned) -> None:
    if p.key not in announced:
      announced.add(p.key)
      progress.started(todo.index(p) + 1, plan_search.describe(p.settings) or "(as given)", logs[p.key])

  finished = True
  try:
    pending = set(futures)
    while pending:
      timeout = max(0.0, min(plan_progress.POLL_SECONDS, deadline - time.monotonic()))
      done, pending = concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
      for future in pending:
        if logs[futures[future].key].exists():
          announce(futures[future])
      for future in done:
        p = futures[future]
        announce(p)
        try:
          p.result = future.result()
        except Exception as e:  # a crashed compile is reported, not cached
          p.result = {"status": "failed", "message": f"{type(e).__name__}: {e}".splitlines()[0], "compile_s": 0.0}
        else:
          _write_cache(cache_dir / f"{p.key}.json", p.result)
        progress.update(plan_search.describe(p.settings), float(p.result.get("compile_s", 0.0)))
      if pending and time.monotonic() >= deadline:
        finished = False
        break
  except KeyboardInterrupt:  # what finished is cached already; the workers got the same signal
    finished = False
    raise
  finally:
    progress.finish()
    # The pool's worker processes, taken before shutdown forgets them: stopped when the plan stops early.
    workers_running = list((getattr(executor, "_processes", None) or {}).values())
    if not finished:
      for process in workers_running:
        process.terminate()
    executor.shutdown(wait=finished, cancel_futures=True)
  return finished


def _write_cache(path: Path, result: Mapping[str, Any]) -> None:
  temporary = path.with_suffix(".tmp")
  temporary.write_text(json.dumps(result))
  os.replace(temporary, path)


def _read_cache(path: Path) -> dict[str, Any] | None:
  """A cached result, or None (compiled again) for one absent, unreadable or not as _compile_all writes it."""
  try:
    result = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  if not (isinstance(result, dict) and isinstance(result.get("status"), str)
          and isinstance(result.get("compile_s"), (int, float))
          and (result["status"] != "compiled" or isinstance(result.get("total"), (int, float)))):
    return None
  return result


def _unwritable(directory: Path) -> str:
  """Why `directory` (made with its parents) cannot take a new file, or ""."""
  try:
    if directory.exists() and not directory.is_dir():
      return "it is a file"
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()
  except OSError as e:
    return f"{e.strerror or e}: {e.filename}" if e.filename else str(e.strerror or e)
  return ""


def usable_paths(args: PlanArgs) -> Path:
  """The cache directory, made; checked with write_recipe's directory before anything is ranked or compiled, so
  a path the planner cannot write is one line now rather than a traceback at the end."""
  cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
  problem = _unwritable(cache_dir)
  if problem:
    raise ConfigError(f"cache_dir={cache_dir} cannot hold the compile cache ({problem}); name a directory the "
                      "planner can write")
  recipe = Path(args.write_recipe)
  problem = args.write_recipe and ("it is a directory" if recipe.is_dir() else _unwritable(recipe.resolve().parent))
  if problem:
    raise ConfigError(f"write_recipe={args.write_recipe} cannot be written ({problem}); name a file path the planner "
                      "can write")
  return cache_dir


def model_shape(config: config_lib.Config) -> plan_model.ModelShape:
  """The trained model's shape, with the teacher its objective runs beside it (none, or a distillation
  teacher configured as the objective reads it), the image views a row's vision tower encodes, and the
  objective's passes per row and frozen copy as its record declares them (as the run's FLOPs count them)."""
  teachers = tuple(plan_model.Teacher(plan_model.ModelShape.of(run.cfg, None), run.held_bytes_per_token,
                                      run.per_micro_batch) for run in distill.teacher_runs(config))
  cost = objective_registry.record(config.data.objective).cost(config, lora.partition_for(config.model))
  return plan_model.ModelShape.of(config.model, config.optim, teachers, config.data.max_images_per_row, cost)


def shortlist(args: PlanArgs, overrides: config_lib.Overrides, config: config_lib.Config,
              topology: accelerators.TpuTopology, num_slices: int) -> tuple[list[Planned], int, plan_model.ModelShape]:
  """The best `max_candidates` candidates by analytical step time among those estimated to fit
  (each a valid config), and how many candidates were ranked."""
  from MaxText.layers.attention import select_kernel  # noqa: PLC0415  (flax)
  seq_len = config.data.max_target_length
  explicit = overrides.explicit_keys() | set(overrides.file_values)
  fixed = {k: overrides.peek(k) for k in SEARCH_KEYS if k in explicit}
  global_batch = None
  if args.global_batch_tokens:
    if "per_device_batch_size" in fixed:
      raise ConfigError("give global_batch_tokens or per_device_batch_size, not both")
    if args.global_batch_tokens % seq_len:
      raise ConfigError(f"global_batch_tokens={args.global_batch_tokens} is not a whole number of "
                        f"{seq_len}-token sequences (max_target_length)")
    global_batch = args.global_batch_tokens // seq_len
  rollout = rl_config.own_rollout_devices(config.data.objective, config.rl)
  if rollout:  # its candidates would span every device, which no config with a rollout mesh accepts
    raise ConfigError(f"rl_rollout_devices={rollout}: the planner lays the training mesh over the whole slice and "
                      "does not model a rollout mesh of its own; plan with rl_rollout_devices=0")
  model = model_shape(config)
  rules = config.mesh.logical_axis_rules
  kernel = select_kernel(config.model.attn.attention, "tpu", config.model)
  hbm = topology.generation.hbm_gib * GIB
  limit = hbm * (1 - args.headroom)  # the analytical model's error on large models is a few percent
  # A lower bound over the whole space answers "fits nowhere" before the long ranking and any compile.
  bound = plan_search.Bound(model, seq_len, rules, kernel, fixed, global_batch, config.mesh.data_sharding)
  nowhere = plan_search.fits_nowhere(bound, topology, num_slices, args.headroom)
  if nowhere:
    raise UserError(f"{config['model_name']} does not fit {num_slices} x {topology.name} at any setting the planner "
                    f"searches: {nowhere}")
  print(f"ranking the search space for {num_slices} x {topology.name} (analytical model) ...", flush=True)
  # (-tokens/s, accumulation steps, bytes per chip, the candidate's keys, its estimate)
  ranked: list[tuple[float, int, float, dict[str, Any], plan_model.Estimate]] = []
  host_reason = ""  # why a candidate that fits HBM overflows the host's memory (offloaded state)
  fill = plan_search.PlacementFill(model, seq_len)
  searched = 0  # candidates whose batch splits into whole rows
  for base in plan_search.candidates(model, topology, num_slices, fixed, global_batch, seq_len,
                                      config.mesh.data_sharding, rules=rules):
    searched += 1
    estimate = plan_model.estimate(model, base, topology, num_slices, seq_len, rules, kernel)
    if estimate.total > limit or estimate.unsharded > config.mesh.sharding_tolerance:
      continue
    # A full-remat candidate that fits also stands for the placements that fill its free memory.
    for settings in (base, *fill.variants(base, estimate, topology, limit, fixed)):
      if settings is not base:
        estimate = plan_model.estimate(model, settings, topology, num_slices, seq_len, rules, kernel)
        if estimate.total > limit:
          continue
      overflow = plan_model.host_overflow(estimate, topology.generation)
      if overflow:
        host_reason = host_reason or f"{plan_search.describe(settings)}: {overflow}"
        continue
      ranked.append((-estimate.tokens_per_s, int(settings.get("gradient_accumulation_steps", 1)), estimate.total,
                     settings, estimate))
  counted = len(ranked)
  if not ranked and host_reason:
    raise UserError(f"{config['model_name']} does not fit {num_slices} x {topology.name}: every setting that fits "
                    f"HBM overflows the host's memory with what it offloads, e.g. {host_reason}; offload less "
                    "(another remat_policy, optimizer_memory_host_offload=false), or fewer sequences per chip")
  if not searched and global_batch is not None:  # the batch, not the memory: a larger slice makes it worse
    fixed_too = f", or drop the fixed keys {', '.join(sorted(fixed))}" if fixed else ""
    raise UserError(f"global_batch_tokens={args.global_batch_tokens} is {global_batch} sequence(s) of {seq_len} "
                    f"tokens, which split into whole rows over no layout of {num_slices} x {topology.name} the planner "
                    f"searches (configuration/batch_split.py); raise global_batch_tokens, or plan for a smaller "
                    f"slice{fixed_too}")
  if not ranked:  # the bound fits, but only with a batch or a layout the planner cannot run
    leanest = bound.leanest(topology, num_slices)
    figure = f"{leanest[0].total / GIB:.1f} GiB per {topology.generation.device_unit}, " if leanest else ""
    change = f"drop or change the fixed keys {', '.join(sorted(fixed))}" if fixed else \
        "use a larger slice or a shorter max_target_length"
    raise UserError(f"{config['model_name']} does not fit {num_slices} x {topology.name} at any setting the planner "
                    f"searches: only a batch that does not split into whole rows over the devices that split rows "
                    f"(configuration/batch_split.py), or more unsharded parameters than "
                    f"sharding_tolerance, would ({figure}of {topology.generation.hbm_gib:g} GiB); {change}")
  ranked.sort(key=lambda r: r[:3])  # fastest, then fewer microbatches, then less memory
  planned: list[Planned] = []
  flags = compile_flags(topology.generation.name)
  versions, digest = compiled_step.runtime_versions(), _source_digest()
  # The short list takes the best of each kind first (remat policy, offload, tensor and sequence
  # degrees), then the next best: the compiles then test the analytical model where it is weakest.
  def kind(settings: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(settings.get(k) for k in ("remat_policy", *remat_policies.TENSORS, "optimizer_memory_host_offload",
                                           MeshAxis.TENSOR.ici_key, MeshAxis.SEQUENCE.ici_key, "pipeline_schedule"))
  unproduced = {**remat_policies.not_produced(config.values), **plan_remat.layer_unproduced(config.model.decoder_block)}
  seen: set[tuple[Any, ...]] = set()
  firsts: list[tuple[float, int, float, dict[str, Any], plan_model.Estimate]] = []
  rest: list[tuple[float, int, float, dict[str, Any], plan_model.Estimate]] = []
  for r in ranked:
    (rest if kind(r[3]) in seen else firsts).append(r)
    seen.add(kind(r[3]))
  ordered = firsts + rest
  for _, _, _, settings, estimate in ordered:
    if len(planned) == args.max_candidates:
      break
    # Only what differs from the config as given: the command line stays short, the config the same. A searched
    # placement's names this model does not produce place nothing: left out, not warned about.
    chosen = {k: v for k, v in settings.items() if k not in explicit and v != config[k] and k not in unproduced}
    try:
      candidate_config = config_lib.build_config(overrides.below_argv(chosen, "the planner"), config.target,
                                                 default_run_name="plan")
    except ConfigError:
      continue  # e.g. a degree that does not divide the heads: the next candidate instead
    key = cache_key(candidate_config, topology.name, num_slices, flags, os.environ.get("XLA_FLAGS", ""), versions, digest)
    if any(p.key == key for p in planned):
      continue
    planned.append(Planned(chosen, candidate_config, estimate, key))
  if planned and kernel == "flash":
    planned += _block_variants(planned[0], args, overrides, config, explicit, topology.name, num_slices, flags,
                               versions, digest)
  return planned, counted, model


def _block_variants(best: Planned, args: PlanArgs, overrides: config_lib.Overrides, config: config_lib.Config,
                    explicit: set[str], topology: str, num_slices: int, flags: str, versions: Mapping[str, Any],
                    digest: str) -> list[Planned]:
  """The analytically best candidate again with each other splash block size that tiles the
  sequence: the analytical model cannot tell them apart, the compiler's estimate can."""
  if explicit & set(SPLASH_BLOCK_KEYS):
    return []
  seq_len = config.data.max_target_length
  variants = []
  for size in args.block_sizes():
    if size > seq_len or seq_len % size or size == config["sa_block_q"]:
      continue
    settings = {**best.settings, **{k: size for k in SPLASH_BLOCK_KEYS}}
    try:
      variant_config = config_lib.build_config(overrides.below_argv(settings, "the planner"), config.target,
                                               default_run_name="plan")
    except ConfigError:
      continue
    key = cache_key(variant_config, topology, num_slices, flags, os.environ.get("XLA_FLAGS", ""), versions, digest)
    variants.append(Planned(settings, variant_config, best.estimate, key))
  return variants


TOOL = startup.Tool("plan", compiles_for="slice figures")


def main(argv: list[str]) -> int:
  args, config_argv = PlanArgs.parse(argv)
  cache_dir = usable_paths(args)
  start_up = startup.start(TOOL, config_argv)
  overrides, config, topology, num_slices = start_up.overrides, start_up.config, start_up.topology, start_up.num_slices
  assert topology is not None  # a slice-figures tool always names one
  started = time.perf_counter()
  planned, counted, model = shortlist(args, overrides, config, topology, num_slices)
  variants = sum(1 for p in planned if "sa_block_q" in p.settings)
  gen = topology.generation
  teacher = "".join(f", a teacher of {t.shape.num_params / 1e9:.2f} B" for t in model.teachers)
  teacher += ", a frozen copy of them" if model.cost.reference_copy else ""
  print(f"plan for {config['model_name']} ({model.num_params / 1e9:.2f} B parameters{teacher}) on {num_slices} x {topology.name}: "
        f"{counted:,} candidates estimated to fit in {gen.hbm_gib:g} GiB with {args.headroom:.0%} headroom, ranked in "
        f"{time.perf_counter() - started:.1f} s; short list: the best {len(planned) - variants}"
        + (f", and the first with splash blocks of {', '.join(str(p.settings['sa_block_q']) for p in planned[-variants:])}"
           if variants else ""), flush=True)
  for p in planned:
    p.result = _read_cache(cache_dir / f"{p.key}.json")
    p.cached = p.result is not None
  interrupted = False
  try:
    finished = _compile_all(planned, config_argv, compile_flags(gen.name), cache_dir, args)
  except KeyboardInterrupt:
    interrupted, finished = True, False
  devices, seq_len, hbm = topology.devices * num_slices, config.data.max_target_length, gen.hbm_gib * GIB
  host = gen.host_gib * GIB if gen.host_gib is not None else math.inf
  rows, best = rank_compiled(planned, hbm, devices, seq_len, gen.peak_tflops, host)
  # Every figure is a JAX device's: a TensorCore's on tpu7x (the table said per chip there, at half a chip's).
  unit = gen.device_unit
  print(format_table(rows, unit))
  print(f"HBM: XLA's device heap per {unit}; model ms / model MFU: the step-time model's prediction from the scheduled "
        f"HLO (compute, exposed ICI and DCN, host transfers), which ranks the candidates; tokens/s/{unit} at that step; "
        f"compiler ms / MFU: XLA's own estimate (communication assumed hidden); MFU of {gen.peak_tflops:g} TFLOP/s; "
        "mem err / step err: the analytical model against the compile and the ranking figure. Caveats mark what "
        "the ranking figure cannot price.")
  if interrupted:
    print(f"interrupted: {sum(1 for p in planned if p.result)} results kept in {cache_dir}", file=sys.stderr)
    return 130
  if not finished:
    print(f"budget of {args.budget_minutes:g} min spent: the candidates without a result were not compiled")
  if best is None and not finished:
    raise UserError(f"the budget of {args.budget_minutes:g} min ran out before a candidate that fits compiled; "
                    f"raise budget_minutes (finished compiles are cached in {cache_dir})")
  if best is None:
    # per device: a tpu7x TensorCore's half of its chip (TpuGeneration.device_unit)
    raise UserError(f"none of the {len(planned)} compiled candidates fits {gen.hbm_gib:g} GiB per {gen.name} "
                    f"{gen.device_unit}" + (f" and its host's {gen.host_gib:.1f} GiB per {gen.device_unit}"
                                            if gen.host_gib else "") + "; "
                    "raise max_candidates, or fix a smaller per_device_batch_size or a remat_policy")
  chosen, standing = best
  user_args = config_argv[2:] if len(config_argv) > 1 and "=" not in config_argv[1] else config_argv[1:]
  yaml_arg = config_argv[1] if len(config_argv) > 1 and "=" not in config_argv[1] else "configs/base.yml"
  train_args = [a for a in user_args if not a.startswith(("compile_topology=", "compile_topology_num_slices="))]
  train_args += chosen.argv_values()
  caveat = f" (caveats: {', '.join(standing.caveats)}: no candidate without them fits)" if standing.caveats else ""
  figure = f"{'predicted' if standing.by_model else 'compiler-estimated'} MFU {standing.mfu:.1%}"
  model_lines = list((chosen.result or {}).get("model_lines") or [])
  print(f"best: {plan_search.describe(chosen.settings)}: {figure}{caveat}")
  if not standing.by_model:
    print(f"  (no step-time model: {(chosen.result or {}).get('model_error', 'not computed')})")
  for line in model_lines[1:]:
    print(line)
  print(f"  LIBTPU_INIT_ARGS={shlex.quote(compile_flags(gen.name))} python3 -m MaxText.train {yaml_arg} "
        f"{' '.join(shlex.quote(a) for a in train_args)}")
  if args.write_recipe:
    summary = f"{config['model_name']} on {num_slices} x {topology.name}, {plan_search.describe(chosen.settings)}, {figure}"
    dry = write_recipe(args.write_recipe, topology, train_args, summary, model_lines, num_slices)
    print(f"wrote {args.write_recipe}; its dry run:\n  {dry}")
    left_out = sorted(set(Path(args.write_recipe).parts) & tpu_launch.EXCLUDED_NAMES)
    if left_out:
      print(f"note: multihost_runner and multihost_job do not copy {left_out[0]}/ to the TPU workers: to launch "
            f"this recipe there, write it elsewhere in the checkout (e.g. write_recipe=configs/planned/"
            f"{Path(args.write_recipe).name})")
  return 0


if __name__ == "__main__":
  run_cli(main)
