"""The planner (MaxText/plan.py, plan_model.py): the analytical model against the compiler on
small v5e compiles, the compile cache key, a whole plan on a tiny model (a second plan compiles
nothing, the recipe it writes dry-runs), and the one-line answers to impossible or bad input."""

import dataclasses
import json
import math
import re
import subprocess
from typing import Any

import pytest

from MaxText import plan, startup
from MaxText.aot import plan_model, plan_ranking, plan_recipe, plan_remat, plan_search
from MaxText.platform import accelerators
from MaxText.configuration import config as config_lib
from MaxText.configuration.config import BASE_CONFIG_PATH
from MaxText.errors import ConfigError, UserError
from MaxText.layers.attention import select_kernel

# Large enough that activations, not fixed overheads, decide the heap; small enough to compile in seconds.
SMALL = dict(base_emb_dim=512, base_num_query_heads=4, base_num_kv_heads=4, head_dim=128, base_mlp_dim=2048,
             base_num_decoder_layers=4, vocab_size=2048, max_target_length=256, print_config=False)
TINY = dict(base_emb_dim=256, base_num_query_heads=2, base_num_kv_heads=2, head_dim=64, base_mlp_dim=512,
            base_num_decoder_layers=1, vocab_size=256, max_target_length=64, print_config=False)
# The analytical total per chip against XLA's device heap (plus code) on the configurations below
# (getting_started/Planner.md, *Accuracy of the analytical model*, lists the errors): at least 0.9x the heap,
# and at most the heap plus what XLA's memory-space assignment holds in VMEM, which the heap does not count.
# On this small model VMEM holds most temporaries (the scanned stack's float32 gradients, its bf16 weights,
# the saved activations), so the estimate reads about twice the heap though it counts no buffer the compile lacks.
MEMORY_LOW = 0.9


def assert_in_heap_or_vmem(estimate_total: float, compiled: dict[str, Any]) -> None:
  heap, vmem = compiled["total"], compiled["vmem"]
  assert MEMORY_LOW * heap <= estimate_total <= heap + vmem, (estimate_total, heap, vmem)


def argv(**overrides) -> list[str]:
  return ["plan", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in overrides.items()]


def analytic(topology_name: str, **overrides) -> plan_model.Estimate:
  """The analytical estimate of exactly the config `overrides` give (its degrees resolved)."""
  topology = accelerators.tpu_topology(topology_name)
  config = config_lib.build_config(startup.read_overrides(argv(compile_topology=topology_name, **overrides)),
                                   topology.target(), default_run_name="plan")
  settings = {k: config[k] for k in plan.SEARCH_KEYS}
  for group in ("ici", "dcn"):
    for axis, degree in config.mesh.degrees(group):
      settings[f"{group}_{'pipeline' if axis == 'stage' else axis}_parallelism"] = degree
  model = plan_model.ModelShape.of(config.model, config.optim)
  return plan_model.estimate(model, settings, topology, 1, config.data.max_target_length,
                             config.mesh.logical_axis_rules, select_kernel(config.model.attn.attention, "tpu", config.model))


@pytest.mark.parametrize("settings", [
    dict(per_device_batch_size=4, remat_policy="full"),
    pytest.param(dict(per_device_batch_size=8, remat_policy="save_qkv_proj"), marks=pytest.mark.slow),
    pytest.param(dict(per_device_batch_size=4, remat_policy="full", ici_tensor_parallelism=2), marks=pytest.mark.slow),
    pytest.param(dict(per_device_batch_size=2, remat_policy="full", ici_data_parallelism=2), marks=pytest.mark.slow),
    # 2 sequences on 4 chips: one per fsdp shard, repeated over tensor (the planner prices a chip's share alike).
    pytest.param(dict(per_device_batch_size=0.5, remat_policy="full", ici_tensor_parallelism=2), marks=pytest.mark.slow),
], ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_analytical_memory_against_the_compiled_heap(settings):
  overrides = dict(SMALL, **settings)
  estimate = analytic("v5e-4", **overrides)
  compiled = plan.compile_figures(argv(compile_topology="v5e-4", **overrides))
  assert compiled["status"] == "compiled" and compiled["source"] == "XLA buffer assignment"
  # Parameters and AdamW state per chip are exact: XLA's argument size less the batch and rng.
  # 4 int32 arrays per row; a chip holds whole rows (here, with fewer rows than chips, one).
  batch_bytes = max(1, settings["per_device_batch_size"]) * SMALL["max_target_length"] * 4 * 4
  assert estimate.params + estimate.optimizer == pytest.approx(compiled["arguments"] - batch_bytes, rel=0.01)
  assert_in_heap_or_vmem(estimate.total, compiled)
  assert compiled["step_s"] > 0 and estimate.step_s > 0


@pytest.mark.slow  # one AOT compile for v5e-4: about 2 minutes on the loaded 2-core machine
def test_one_row_per_chip_xla_holds_the_saved_activations_in_vmem(tmp_path):
  """2 sequences on v5e-4 at fsdp=2 tensor=2 (one row per chip): the analytical total is well above XLA's
  HBM heap (getting_started/Planner.md, Fewer sequences than chips) because XLA's memory-space assignment
  keeps the scan's stacks of saved activations ([layers, row, length, width]) in VMEM, which the heap does not
  count; heap and VMEM together hold more than the estimate."""
  from MaxText import train_compile
  from MaxText.aot import memory_report
  from MaxText.training import run_assembly
  overrides = dict(SMALL, max_target_length=2048, remat_policy="minimal", ici_fsdp_parallelism=2,
                   ici_tensor_parallelism=2, per_device_batch_size=0.5)
  estimate = analytic("v5e-4", **overrides)
  config, devices, topology = train_compile.load_target_config(argv(compile_topology="v5e-4", **overrides))
  run = run_assembly.build_run(config, devices=devices, compiled_step=False)
  compiled = train_compile.compile_or_explain(run.train_step, run.abstract_inputs(), topology,
                                              memory_report.buffer_assignment_dump_options(str(tmp_path)))
  heap = memory_report.MemoryReport.from_compiled(compiled, memory_report.read_buffer_assignment(str(tmp_path)))
  vmem = memory_report.memory_spaces(str(tmp_path))["vmem"]
  assert 1.3 * heap.total < estimate.total < heap.total + vmem
  # Which allocation (and its colour: 1 is VMEM) holds the mlpwi_0 / mlpwi_1 stacks, bf16[4 layers, 1 row, 2048, 2048 / tensor].
  assignment = next(tmp_path.glob("*jit_train_step*after_optimizations-buffer-assignment.txt")).read_text()
  colours = set()
  for block in re.split(r"\n(?=allocation \d+:)", assignment):
    if "): bf16[4,1,2048,1024]" in block:  # the array itself, not a tuple of pointers naming it
      colour = re.search(r"color (\d+)", block.splitlines()[0])  # the heap's allocations name no colour
      colours.add(colour.group(1) if colour else "0")
  assert colours == {"1"}


def test_cache_key_changes_with_everything_that_affects_a_compile():
  topology = accelerators.tpu_topology("v5e-4")

  def key(topology_name="v5e-4", num_slices=1, flags="--a=1", xla="", versions=None, digest="d", **overrides):
    config = config_lib.Config.for_testing(target=topology.target(), **{**TINY, **overrides})
    return plan.cache_key(config, topology_name, num_slices, flags, xla, versions or {"jax": "1", "libtpu": "2"}, digest)

  base = key()
  assert key() == base and key(run_name="another") == base  # the run's name does not change the program
  changed = [key(remat_policy="minimal"), key(per_device_batch_size=2), key(ici_tensor_parallelism=2),
             key(base_emb_dim=512), key(optimizer_memory_host_offload=True), key(gradient_accumulation_steps=2),
             key(topology_name="v5e-8"), key(num_slices=2), key(flags="--a=2"), key(xla="--xla_b=1"),
             key(versions={"jax": "1", "libtpu": "3"}), key(versions={"jax": "9", "libtpu": "2"}), key(digest="e")]
  assert len(set(changed)) == len(changed) and base not in changed


def test_candidates_respect_fixed_keys_and_fill_the_slice():
  config = config_lib.Config.for_testing(target=accelerators.tpu_topology("v5e-8").target(), run_name="t", **TINY)
  model = plan_model.ModelShape.of(config.model, config.optim)
  topology = accelerators.tpu_topology("v5e-8")
  fixed = {"remat_policy": "full", "ici_tensor_parallelism": 2}
  found = list(plan_search.candidates(model, topology, 1, fixed, global_batch=16, seq_len=64,
                                     rules=config.mesh.logical_axis_rules))
  assert found
  for c in found:
    assert c["remat_policy"] == "full" and c["ici_tensor_parallelism"] == 2
    assert c["per_device_batch_size"] == 2  # 16 sequences on 8 chips
    mesh = plan_model.mesh_of(c)
    assert mesh["data"] * mesh["fsdp"] * mesh["fsdp_transpose"] * mesh["sequence"] * mesh["tensor"] * mesh["expert"] == 8


@pytest.mark.slow
def test_pipeline_candidates_are_valid_configs_and_their_schedules_trade_bubble_for_memory():
  topology = accelerators.tpu_topology("v5e-8")
  shape = dict(TINY, base_num_decoder_layers=4)
  config = config_lib.Config.for_testing(target=topology.target(2), run_name="t", **shape)
  model = plan_model.ModelShape.of(config.model, config.optim)
  found = list(plan_search.candidates(model, topology, 2, {"remat_policy": "full"}, global_batch=64, seq_len=64,
                                     data_sharding=config.mesh.data_sharding, rules=config.mesh.logical_axis_rules))
  piped = [c for c in found if plan_model.mesh_of(c)["stage"] > 1]
  assert {c["pipeline_schedule"] for c in piped} == {"gpipe", "circular", "1f1b"}
  assert any(c.get("dcn_pipeline_parallelism", 1) == 2 for c in piped)
  assert any(c["ici_pipeline_parallelism"] > 1 for c in piped)
  for c in piped[::max(1, len(piped) // 6)]:  # config validation accepts what the planner proposes
    overrides = startup.read_overrides(argv(compile_topology="v5e-8", compile_topology_num_slices=2, **shape,
                                            **{k: v for k, v in c.items()}))
    built = config_lib.build_config(overrides, topology.target(2), default_run_name="plan")
    assert dict(built.mesh.shape)["stage"] == plan_model.mesh_of(c)["stage"]
  fixed = list(plan_search.candidates(model, topology, 2, {"pipeline_schedule": "1f1b"}, global_batch=64, seq_len=64,
                                     data_sharding=config.mesh.data_sharding, rules=config.mesh.logical_axis_rules))
  assert all(c["pipeline_schedule"] == "1f1b" for c in fixed if plan_model.mesh_of(c)["stage"] > 1)
  # More microbatches and circular repeats shrink the bubble; 1F1B holds fewer microbatches' activations.
  base = {"ici_pipeline_parallelism": 4, "pipeline_schedule": "gpipe", "num_pipeline_repeats": 1}
  bubble = {m: plan_model.pipeline_shape(dict(base, num_pipeline_microbatches=m), 4).bubble for m in (4, 16)}
  assert bubble[4] == pytest.approx(3 / 7) and bubble[16] == pytest.approx(3 / 19)
  circular = plan_model.pipeline_shape(dict(base, pipeline_schedule="circular", num_pipeline_repeats=2,
                                            num_pipeline_microbatches=4), 4)
  assert circular.bubble == pytest.approx(3 / 11)
  one_f_one_b = plan_model.pipeline_shape(dict(base, pipeline_schedule="1f1b", num_pipeline_microbatches=16), 4)
  assert one_f_one_b.live_share == pytest.approx(0.5) and one_f_one_b.extra_compute > 0


def test_sequence_parallel_candidates_on_the_chunked_kernel_are_flagged():
  """Sequence-parallel attention runs splash per chunk pair where its tiles divide the chunk;
  elsewhere the chunked kernel, whose loop's trip count is known only at run time (the compiler's
  cycles miss it)."""
  blocks = {f"sa_block_{b}": 128 for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq",
                                           "kv_dq")}
  base = dict(SMALL, per_device_batch_size=4, remat_policy="full", attention="flash", **blocks)
  split = dict(base, ici_sequence_parallelism=2, ici_fsdp_parallelism=2)
  flag = "attention loop uncounted"
  assert flag not in analytic("v5e-4", **base).caveats
  assert flag not in analytic("v5e-4", **split).caveats  # chunks of 128 tokens: splash
  assert flag in analytic("v5e-4", **dict(split, context_parallel_load_balance=True)).caveats  # chunks of 64
  assert flag not in analytic("v5e-4", **dict(split, context_parallel_strategy="all_to_all",
                                               context_parallel_load_balance=True)).caveats  # the whole 256


# With expert parallelism the estimate is 1.31x the heap dropless and 1.24x bounded, over the heap plus VMEM
# (47 MiB here) too: its exchange buffers and expert gradients add up to more than the compile holds at once
# (Planner.md, *Accuracy of the analytical model*).
MOE_MEMORY_TOLERANCE = (0.9, 1.4)
MOE = dict(SMALL, num_experts=16, num_experts_per_tok=4, sparse_matmul=True, capacity_factor=-1.0, base_mlp_dim=512,
           per_device_batch_size=8, remat_policy="full", ici_expert_parallelism=4)


def test_expert_exchange_rows_are_the_worst_case_or_the_bounded_share():
  """Per device and layer: a dropless receive buffer holds every peer's tokens, each at most once per local expert;
  moe_ragged_buffer_factor holds that many even shares; one device (no expert axis) exchanges nothing."""
  config = config_lib.Config.for_testing(**{k: v for k, v in MOE.items() if k != "ici_expert_parallelism"})
  assert plan_remat.moe_exchange_rows(config.model, 4, 2048) == (4 * 2048 * 4, 2048 * 4)  # min(k=4, 16/4 experts)
  assert plan_remat.moe_exchange_rows(config.model, 8, 2048) == (8 * 2048 * 2, 2048 * 4)  # 2 local experts
  assert plan_remat.moe_exchange_rows(config.model, 1, 2048) == (0.0, 0.0)
  bounded = config_lib.Config.for_testing(**{**{k: v for k, v in MOE.items() if k != "ici_expert_parallelism"},
                                             "moe_ragged_buffer_factor": 2.0})
  assert plan_remat.moe_exchange_rows(bounded.model, 8, 2048) == (2 * 2048 * 4, 2048 * 4)


@pytest.mark.slow
@pytest.mark.parametrize("buffer_factor", [-1.0, 2.0])
def test_analytical_memory_counts_the_expert_exchange_buffers(buffer_factor, monkeypatch):
  """Dropless expert parallelism sizes each device's receive buffer for every peer's rows (or, with
  moe_ragged_buffer_factor, that many even shares): the estimate holds the compiled heap with those buffers, and
  falls short of it without them."""
  overrides = dict(MOE, moe_ragged_buffer_factor=buffer_factor)
  compiled = plan.compile_figures(argv(compile_topology="v5p-8", **overrides))
  assert compiled["status"] == "compiled"
  low, high = MOE_MEMORY_TOLERANCE
  assert low * compiled["total"] <= analytic("v5p-8", **overrides).total <= high * compiled["total"]
  monkeypatch.setattr(plan_model, "MOE_EXCHANGE_COPIES", 0)
  assert analytic("v5p-8", **overrides).total < low * compiled["total"]


def test_moe_experts_may_span_slices(monkeypatch):
  topology = accelerators.tpu_topology("v5e-8")
  config = config_lib.Config.for_testing(target=topology.target(2), run_name="t", num_experts=4,
                                         num_experts_per_tok=2, **TINY)
  model = plan_model.ModelShape.of(config.model, config.optim)
  found = list(plan_search.candidates(model, topology, 2, {"remat_policy": "full"}, global_batch=32, seq_len=64,
                                     data_sharding=config.mesh.data_sharding, rules=config.mesh.logical_axis_rules))
  across = [c for c in found if c.get("dcn_expert_parallelism") == 2]
  assert across and all(plan_model.mesh_of(c)["expert"] >= 2 for c in across)
  rules = config.mesh.logical_axis_rules
  kernel = select_kernel(config.model.attn.attention, "tpu", config.model)

  def step(dcn_bandwidth: float) -> float:
    monkeypatch.setitem(plan_model.LINKS, "v5e", dataclasses.replace(plan_model.LINKS["v5e"], dcn=dcn_bandwidth))
    return plan_model.estimate(model, across[0], topology, 2, 64, rules, kernel).step_s

  # The tokens' all-to-all to experts in the other slice is on the critical path: DCN speed shows in the step.
  assert step(1e9) > step(1e18)


def test_tiny_plan_compiles_caches_and_writes_a_recipe(tmp_path, capsys):
  cache, recipe = tmp_path / "cache", tmp_path / "recipes" / "tiny.sh"
  args = argv(compile_topology="v5e-4", max_candidates=1, workers=1, cache_dir=cache, write_recipe=recipe,
              remat_policy="full", global_batch_tokens=512, **TINY)
  assert plan.main(args) == 0
  out, err = capsys.readouterr()
  assert "compiling 1 candidates in 1 worker process" in out
  # Progress: the candidate as it starts compiling (with its worker's log), then the bar.
  assert re.search(r"^compiling candidate 1/1: \S.* \(log: .*\.log\)$", err, re.M), err
  assert "1/1 compiled, ETA 0 s" in err
  assert "HBM GiB/chip" in out and "yes (" in out and "python3 -m MaxText.train" in out
  assert re.search(r"^best: .*: predicted MFU [\d.]+%$", out, re.M), out  # ranked by the step-time model
  assert "exposed ICI" in out
  assert len(list(cache.glob("*.json"))) == 1
  # The recipe runs like the shipped ones: its dry run holds the planned keys and the fixed ones.
  dry = subprocess.run(["bash", str(recipe), "DRY_RUN=1", "RUN_NAME=r"], capture_output=True, text=True, check=True)
  assert "python3 -m MaxText.train configs/base.yml run_name=r" in dry.stdout
  assert re.search(r"^# step-time model \(not a measurement\): step .* -> MFU", recipe.read_text(), re.M)
  assert "remat_policy=full" in dry.stdout and "per_device_batch_size=2" in dry.stdout
  assert "--xla_tpu_enable_async_collective_fusion=true" in dry.stdout
  compile_run = subprocess.run(["bash", str(recipe), "EXECUTABLE=train_compile", "DRY_RUN=1"], capture_output=True,
                               text=True, check=True)
  assert "compile_topology=v5e-4" in compile_run.stdout

  assert "do not copy" not in out

  # The same plan again: every result from the cache, nothing compiled. Its recipe goes under
  # outputs/, which the TPU launchers leave behind: the planner says so.
  args = argv(compile_topology="v5e-4", max_candidates=1, workers=1, cache_dir=cache,
              write_recipe=tmp_path / "outputs" / "tiny.sh", remat_policy="full", global_batch_tokens=512, **TINY)
  assert plan.main(args) == 0
  again = capsys.readouterr().out
  assert "compiling 1 candidates" not in again and "cached (" in again
  assert "note: multihost_runner and multihost_job do not copy outputs/ to the TPU workers" in again


def test_a_spent_budget_stops_the_compiles_and_says_so(tmp_path, capsys):
  with pytest.raises(UserError, match=r"the budget of 0.001 min ran out before a candidate that fits compiled"):
    plan.main(argv(compile_topology="v5e-4", max_candidates=1, workers=1, cache_dir=tmp_path, budget_minutes=0.001,
                   **TINY))
  assert "budget of 0.001 min spent" in capsys.readouterr().out
  assert not list(tmp_path.glob("*.json"))  # nothing finished, nothing cached


def no_compile(monkeypatch):
  """Any compile fails the test: these answers must come from the analytical model alone."""
  def compile_attempted(*args, **kwargs):
    raise AssertionError("the planner compiled a candidate")
  monkeypatch.setattr(plan, "_compile_all", compile_attempted)
  monkeypatch.setattr(plan, "compile_figures", compile_attempted)


def test_a_model_too_large_for_any_setting_names_the_smallest_topology(tmp_path, monkeypatch, capsys):
  no_compile(monkeypatch)
  with pytest.raises(UserError, match=r"^llama2-7b does not fit 1 x v5e-4 at any setting the planner searches: its "
                                      r"leanest setting \([^)]*(?:full|minimal_offloaded) opt_offload[^)]*\) "
                                      r"needs [\d.]+ GiB per chip \(parameters [\d.]+ \+ optimizer [\d.]+ "
                                      r"\+ gradients [\d.]+ \+ activations "
                                      r"[\d.]+ \+ the weights' [\d.]+ in the compute dtype\), a v5e chip holds 16 GiB "
                                      r"\(14.4 with headroom=0.1\); it "
                                      r"would fit \(analytical model\) on v5e-8, or .*v5p-8"):
    plan.main(argv(model_name="llama2-7b", compile_topology="v5e-4", max_target_length=2048, cache_dir=tmp_path))
  assert not list(tmp_path.glob("*"))  # answered by the analytical model: nothing compiled
  assert "ranking" not in capsys.readouterr().out  # nor ranked: the bound alone answers


@pytest.mark.slow
def test_a_model_no_slice_holds_is_answered_at_once_with_more_slices(tmp_path, monkeypatch, capsys):
  """The case that took minutes: every candidate of a 256-chip slice ranked before the answer.
  The lower bound's leanest setting may use tensor parallelism (it spreads the gathered layer)."""
  no_compile(monkeypatch)
  with pytest.raises(UserError) as raised:
    plan.main(argv(model_name="llama3.1-405b", compile_topology="v5e-256", cache_dir=tmp_path))
  message = str(raised.value)
  assert message.startswith("llama3.1-405b does not fit 1 x v5e-256 at any setting the planner searches: its leanest "
                            "setting ("), message
  needed = float(re.search(r"needs ([\d.]+) GiB per chip", message).group(1))
  assert 14.4 < needed < 64 and "2 x v5e-256 (compile_topology_num_slices=2)" in message, message
  assert "or v5p-256," in message, message  # the bound needs 93.7 GiB per chip on v5p-128, 47.6 on v5p-256
  assert "ranking" not in capsys.readouterr().out


def test_the_smallest_slice_is_found_past_slices_whose_degrees_factor_worse(monkeypatch: pytest.MonkeyPatch) -> None:
  """llama3.1-405b's bound fits v5p-256 (128 chips) but not v5p-384 (192: fsdp=3 beside sequence=8), nor
  v5p-640 or v5p-896; a binary search over every slice took those for the boundary and named v5p-3584."""
  def fits(self: plan_search.Bound, topology: accelerators.TpuTopology, num_slices: int, limit_share: float,
           fixed: object = None) -> bool:
    chips = topology.chips
    return chips >= 1024 or (chips >= 128 and chips & (chips - 1) == 0)
  monkeypatch.setattr(plan_search.Bound, "fits", fits)
  bound = plan_search.Bound.__new__(plan_search.Bound)
  v5p = accelerators.TPU_GENERATIONS["v5p"]
  assert bound.smallest_slice(v5p, 1, 0, 0.9, {}) == "v5p-256"
  assert bound.smallest_slice(v5p, 1, 128, 0.9, {}) == "v5p-512"


def test_fixed_keys_that_keep_a_model_out_are_named(tmp_path, monkeypatch):
  no_compile(monkeypatch)
  with pytest.raises(UserError, match=r"drop or change the fixed keys ici_data_parallelism$"):
    plan.main(argv(model_name="llama2-7b", compile_topology="v5e-16", max_target_length=2048,
                   ici_data_parallelism=16, cache_dir=tmp_path))


# A model whose offloaded activations outgrow a v5e host VM (44.7 GiB per chip) while HBM holds the rest.
HOST_HEAVY = dict(TINY, base_num_decoder_layers=64, max_target_length=8192, per_device_batch_size=32)


def test_the_host_memory_an_offloading_candidate_needs_is_counted():
  gib, v5e = plan_model.GIB, accelerators.TPU_GENERATIONS["v5e"]
  offloaded = analytic("v5e-4", remat_policy="minimal_offloaded", **HOST_HEAVY)
  # Per token and layer: q, k, v (384), the attention output (256), both MLP inputs (1024); not the MLP output,
  # which only the residual add reads (plan_remat.mlp_output_read).
  assert offloaded.host_activations == 32 * 8192 * 2 * 64 * (384 + 256 + 1024)
  assert offloaded.total < 14.4 * gib < offloaded.host_activations  # HBM would hold it; the host would not
  assert plan_model.host_overflow(offloaded, v5e) == (
      "it needs 52.0 GiB of host memory per chip (offloaded activations 52.0 + optimizer 0.0), a v5e host has 44.7 "
      "GiB per chip")
  assert plan_model.host_overflow(analytic("v5e-4", remat_policy="full", **HOST_HEAVY), v5e) is None
  with_optimizer = analytic("v5e-4", remat_policy="full", optimizer_memory_host_offload=True, **HOST_HEAVY)
  assert with_optimizer.host_optimizer == pytest.approx(with_optimizer.params * 2, rel=0.01)  # AdamW: mu and nu
  # Past XLA's own limit on offloaded buffers (128 GiB per chip), whatever the host has.
  v6e = accelerators.TPU_GENERATIONS["v6e"]
  assert plan_model.host_overflow(dataclasses.replace(offloaded, host_activations=130 * gib), v6e) == (
      "its offloaded activations need 130.0 GiB of host memory per chip, over the 128 GiB XLA allows")
  assert plan_model.host_overflow(offloaded, v6e) is None
  # tpu7x's figures are a TensorCore's (a JAX device's), and its host's memory is halved to match.
  tpu7x = accelerators.TPU_GENERATIONS["tpu7x"]
  assert plan_model.host_overflow(dataclasses.replace(offloaded, host_activations=120 * gib), tpu7x) == (
      "it needs 120.0 GiB of host memory per TensorCore (offloaded activations 120.0 + optimizer 0.0), a tpu7x host "
      f"has {tpu7x.host_gib:.1f} GiB per TensorCore")


def test_an_offloading_preset_that_overflows_the_host_is_not_proposed(tmp_path, monkeypatch):
  no_compile(monkeypatch)
  with pytest.raises(UserError, match=r"^default does not fit 1 x v5e-4: every setting that fits HBM overflows the "
                                      r"host's memory with what it offloads, e.g. .*minimal_offloaded.*: it needs "
                                      r"52.0 GiB of host memory per chip .* a v5e host has 44.7 GiB per chip; "
                                      r"offload less"):
    plan.main(argv(compile_topology="v5e-4", remat_policy="minimal_offloaded", gradient_accumulation_steps=1,
                   ici_pipeline_parallelism=1, cache_dir=tmp_path, **HOST_HEAVY))
  topology = accelerators.tpu_topology("v5e-4")

  def shortlisted(**fixed) -> list:
    args, rest = plan.PlanArgs.parse(argv(compile_topology="v5e-4", max_candidates=8, **HOST_HEAVY, **fixed))
    overrides = startup.read_overrides(rest)
    config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
    planned = plan.shortlist(args, overrides, config, topology, 1)[0]
    assert planned and all(plan_model.host_overflow(p.estimate, topology.generation) is None for p in planned)
    return planned

  # With the policy fixed, only microbatches small enough for the host (more of them, or a 1F1B pipeline's
  # share live at once); left free, no offloading preset at one microbatch.
  assert all(p.config["gradient_accumulation_steps"] >= 2 or p.config["pipeline_schedule"] == "1f1b"
             for p in shortlisted(remat_policy="minimal_offloaded"))
  assert not any(str(p.config["remat_policy"]).endswith("_offloaded") and p.config["gradient_accumulation_steps"] == 1
                 for p in shortlisted())


def test_tpu7x_candidates_fill_its_tensorcores_and_are_valid_configs():
  """tpu7x-8 is 4 chips of 2 TensorCores, 8 JAX devices. The degrees were searched over the 4 chips: config
  validation refused every candidate ("ici_fsdp_parallelism = 4 uses only 4 of 8 devices per slice"), the
  short list was empty and the plan ended "none of the 0 compiled candidates fits ... raise max_candidates"."""
  topology = accelerators.tpu_topology("tpu7x-8")
  args, rest = plan.PlanArgs.parse(argv(compile_topology="tpu7x-8", max_candidates=2, global_batch_tokens=16 * 64,
                                        **TINY))
  overrides = startup.read_overrides(rest)
  config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
  planned = plan.shortlist(args, overrides, config, topology, 1)[0]
  assert planned
  for p in planned:
    assert math.prod(degree for _, degree in p.config.mesh.ici) == 8, p.config.mesh.ici
    assert p.config["per_device_batch_size"] * 8 == 16  # 16 sequences over the 8 devices


def test_a_model_no_tpu7x_setting_holds_is_named_per_tensorcore(tmp_path, monkeypatch):
  """The bound and the 96 GiB are a TensorCore's: the line read "needs 514.0 GiB per chip (...), a tpu7x chip holds 96
  GiB", and a tpu7x chip holds 192."""
  no_compile(monkeypatch)
  with pytest.raises(UserError, match=r"^llama3.1-70b does not fit 1 x tpu7x-2 at any setting the planner searches: "
                                      r"its leanest setting \([^)]*\) needs [\d.]+ GiB per TensorCore \(parameters .*\), "
                                      r"a tpu7x TensorCore holds 96 GiB \(86.4 with headroom=0.1\); it would fit"):
    plan.main(argv(model_name="llama3.1-70b", compile_topology="tpu7x-2", max_target_length=2048, cache_dir=tmp_path))


def test_the_tpu7x_table_reads_per_tensorcore(tmp_path, monkeypatch, capsys):
  """The table's memory and tokens are a JAX device's (XLA's heap against 96 GiB, the batch over the devices): on
  tpu7x a TensorCore's, which its header and legend called per chip."""
  monkeypatch.setattr(plan, "_compile_all", lambda *args: True)  # nothing compiled: the table's rows say so
  with pytest.raises(UserError, match=r"^none of the 1 compiled candidates fits 96 GiB per tpu7x TensorCore"):
    plan.main(argv(compile_topology="tpu7x-8", max_candidates=1, cache_dir=tmp_path, global_batch_tokens=16 * 64, **TINY))
  out = capsys.readouterr().out
  header = next(line for line in out.splitlines() if line.startswith("#  candidate"))
  assert "HBM GiB/TensorCore" in header and "tokens/s/TensorCore" in header, header
  assert "HBM: XLA's device heap per TensorCore;" in out and "tokens/s/TensorCore at that step" in out
  assert "chip" not in header and "per chip" not in out
  assert "HBM GiB/chip" in plan_ranking.format_table([])  # a chip's elsewhere


def test_a_multi_slice_plans_recipe_compiles_for_its_slices(tmp_path):
  """A plan for 2 x tpu7x-8 writes dcn degrees over 2 slices; its recipe's `EXECUTABLE=train_compile`, as its header
  gives it, compiled for 1 slice and stopped: "dcn_fsdp_parallelism = 2 does not divide 1 slices"."""
  topology = accelerators.tpu_topology("tpu7x-8")
  recipe = tmp_path / "two.sh"
  plan_recipe.write_recipe(str(recipe), topology, ["dcn_fsdp_parallelism=2"], "s", [], num_slices=2)
  assert "EXECUTABLE=train_compile [NUM_SLICES=N]   # compile for 2 x tpu7x-8 on any machine" in recipe.read_text()

  def dry(*extra: str) -> str:
    return subprocess.run(["bash", str(recipe), "EXECUTABLE=train_compile", "DRY_RUN=1", *extra], capture_output=True,
                          text=True, check=True).stdout
  assert "compile_topology=tpu7x-8 compile_topology_num_slices=2" in dry()
  assert "compile_topology_num_slices=4" in dry("NUM_SLICES=4")  # the user's count wins
  one = tmp_path / "one.sh"
  plan_recipe.write_recipe(str(one), topology, [], "s", [])
  assert "RECIPE_NUM_SLICES" not in one.read_text()
  assert "compile_topology_num_slices=1" in subprocess.run(["bash", str(one), "EXECUTABLE=train_compile", "DRY_RUN=1"],
                                                           capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_a_two_slice_tpu7x_plans_recipe_compiles_as_written(tmp_path):
  """What the planner writes compiles: its recipe, run as its header says (`EXECUTABLE=train_compile`), for the slices
  it was planned for (about a minute: one candidate and the recipe's compile)."""
  recipe = tmp_path / "planned.sh"
  assert plan.main(argv(compile_topology="tpu7x-8", compile_topology_num_slices=2, max_candidates=1, workers=1,
                        cache_dir=tmp_path / "cache", write_recipe=recipe, global_batch_tokens=32 * 64, **TINY)) == 0
  compiled = subprocess.run(["bash", str(recipe), "EXECUTABLE=train_compile"], capture_output=True, text=True,
                            timeout=600)
  assert compiled.returncode == 0, compiled.stderr[-2000:]
  assert "compiling for 2 x tpu7x-8" in compiled.stdout and "fits:" in compiled.stdout


def test_tpu7x_tensorcores_share_their_chips_host_link():
  """The analytical model counts tpu7x's TensorCores as its devices, each with half its chip's links: the
  offloaded optimizer's transfers per device take twice what a whole chip's host link would give them."""
  from MaxText.aot.step_time.network import NETWORKS
  e = analytic("tpu7x-8", remat_policy="full", optimizer_memory_host_offload=True, **TINY)
  assert e.host_optimizer > 0
  assert e.host_s == pytest.approx(2 * e.host_optimizer / (NETWORKS["tpu7x"].host_link / 2))


def test_a_compiled_candidate_over_the_host_memory_does_not_fit():
  topology = accelerators.tpu_topology("v5e-4")
  args, rest = plan.PlanArgs.parse(argv(compile_topology="v5e-4", max_candidates=1, **TINY))
  overrides = startup.read_overrides(rest)
  config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
  (only,) = plan.shortlist(args, overrides, config, topology, 1)[0][:1]
  only.result = {"status": "compiled", "compile_s": 1.0, "total": 2**30, "step_s": 1e-3, "host_bytes": 50 * 2**30,
                 "model_step_s": 2e-3, "model_mfu": 0.3, "model_lines": ["step-time model"]}
  rows, best = plan_ranking.rank_compiled([only], 16 * 2**30, 4, 64, 197.0, host=44.7 * 2**30)
  assert best is None and rows[0][plan_ranking.HEADER.index("fits")] == "NO (host memory)"
  assert plan_ranking.rank_compiled([only], 16 * 2**30, 4, 64, 197.0)[1] is not None  # without a host figure it fits


@pytest.mark.slow
def test_the_bound_is_below_every_ranked_candidate():
  """fits_nowhere may answer before ranking only because no candidate can need less than the bound."""
  topology = accelerators.tpu_topology("v5e-8")
  config = config_lib.Config.for_testing(target=topology.target(), run_name="t", **dict(TINY, base_num_decoder_layers=4))
  model = plan_model.ModelShape.of(config.model, config.optim)
  rules, kernel = config.mesh.logical_axis_rules, select_kernel(config.model.attn.attention, "tpu", config.model)
  bound = plan_search.Bound(model, 64, rules, kernel, {}, None, config.mesh.data_sharding)
  least = bound.leanest(topology, 1)[0].total
  totals = [plan_model.estimate(model, c, topology, 1, 64, rules, kernel).total
            for c in plan_search.candidates(model, topology, 1, {}, None, 64, config.mesh.data_sharding, rules=rules)]
  assert totals and least <= min(totals)


def test_bad_planner_arguments_are_one_line_errors():
  with pytest.raises(ConfigError, match="plan needs compile_topology=NAME"):
    plan.main(argv(**TINY))
  with pytest.raises(ConfigError, match="max_candidates must be >= 1"):
    plan.main(argv(compile_topology="v5e-4", max_candidates=0, **TINY))
  with pytest.raises(ConfigError, match="budget_minutes must be > 0, got nan"):
    plan.main(argv(compile_topology="v5e-4", budget_minutes="nan", **TINY))
  with pytest.raises(ConfigError, match="budget_minutes must be a float"):
    plan.main(argv(compile_topology="v5e-4", budget_minutes="soon", **TINY))
  with pytest.raises(ConfigError, match=r"headroom must be in \[0, 1\), got 1.5"):
    plan.main(argv(compile_topology="v5e-4", headroom=1.5, **TINY))
  with pytest.raises(ConfigError, match="not a whole number of 64-token sequences"):
    plan.main(argv(compile_topology="v5e-4", global_batch_tokens=100, **TINY))
  with pytest.raises(ConfigError, match="unknown config key 'max_candidate'"):
    plan.main(argv(compile_topology="v5e-4", max_candidate=2, **TINY))
  with pytest.raises(ConfigError, match="write_recipe=gs://b/r.sh must be a local path"):
    plan.main(argv(compile_topology="v5e-4", write_recipe="gs://b/r.sh", **TINY))
  with pytest.raises(ConfigError, match="attention_blocks=1000 must be comma-separated multiples of 128"):
    plan.main(argv(compile_topology="v5e-4", attention_blocks=1000, **TINY))



def test_paths_the_planner_cannot_write_are_one_line_before_any_ranking(tmp_path, monkeypatch, capsys):
  no_compile(monkeypatch)
  a_file, a_dir = tmp_path / "a_file", tmp_path / "a_dir"
  a_file.write_text("")
  a_dir.mkdir()
  for paths, message in [
      (dict(cache_dir=a_file), r"^cache_dir=\S+a_file cannot hold the compile cache \(it is a file\); name a directory"),
      (dict(cache_dir=a_file / "sub"), r"^cache_dir=\S+sub cannot hold the compile cache \(Not a directory: "),
      (dict(cache_dir=a_dir, write_recipe=a_dir), r"^write_recipe=\S+a_dir cannot be written \(it is a directory\)"),
      (dict(cache_dir=a_dir, write_recipe=a_file / "r.sh"), r"^write_recipe=\S+r.sh cannot be written \(it is a file\)"),
  ]:
    with pytest.raises(ConfigError, match=message):
      plan.main(argv(compile_topology="v5e-4", **paths, **TINY))
  assert "ranking" not in capsys.readouterr().out


def test_a_cache_file_not_as_the_planner_writes_it_is_compiled_again(tmp_path):
  good = {"status": "compiled", "compile_s": 1.5, "total": 2.0}
  for text, expected in [(json.dumps(good), good), ('{"status": "comp', None), ("[1, 2]", None), ("null", None),
                         ('{"status": "compiled", "compile_s": 1.0}', None), ('{"compile_s": 1.0}', None),
                         (json.dumps({"status": "invalid", "compile_s": 0.5}), {"status": "invalid", "compile_s": 0.5})]:
    (tmp_path / "k.json").write_text(text)
    assert plan._read_cache(tmp_path / "k.json") == expected, text
  assert plan._read_cache(tmp_path / "absent.json") is None


def test_a_searched_placement_leaves_out_the_names_the_model_does_not_produce(monkeypatch, capsys):
  """attn_hbm_mlp_host names the experts', the fused and the ungated MLP's tensors too: on a dense gated unfused
  model those keys place nothing, so the short list's configs, command lines and recipes leave them out (they
  were passed, and each warned as placing nothing)."""
  from MaxText.configuration import model_config, remat_policies
  monkeypatch.setattr(plan_search, "SEARCHED_REMAT", ("custom:attn_hbm_mlp_host",))
  model_config._WARNED_UNPRODUCED.clear()
  topology = accelerators.tpu_topology("v5e-4")
  args, rest = plan.PlanArgs.parse(argv(compile_topology="v5e-4", max_candidates=2, **TINY))
  overrides = startup.read_overrides(rest)
  config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
  planned = plan.shortlist(args, overrides, config, topology, 1)[0]
  assert planned
  for p in planned:
    placed = {k: v for k, v in p.settings.items() if k in remat_policies.TENSORS}
    assert placed == dict(query_proj="device", key_proj="device", value_proj="device", out_proj="device",
                          mlpwi_0="offload", mlpwi_1="offload", mlpwo="offload")
    assert "custom:attn_hbm_mlp_host" in plan_search.describe(p.settings)
  assert "warning:" not in capsys.readouterr().err


def test_a_global_batch_too_small_to_split_names_global_batch_tokens(tmp_path, monkeypatch):
  """One sequence for 256 chips splits over no layout (a row repeats over tensor and sequence only): the answer
  names global_batch_tokens; it said the model does not fit and to use a larger slice."""
  no_compile(monkeypatch)
  with pytest.raises(UserError, match=r"^global_batch_tokens=64 is 1 sequence\(s\) of 64 tokens, which split into "
                                      r"whole rows over no layout of 1 x v5e-256 the planner searches .*; raise "
                                      r"global_batch_tokens, or plan for a smaller slice$"):
    plan.main(argv(compile_topology="v5e-256", global_batch_tokens=64, cache_dir=tmp_path, **TINY))

@pytest.mark.slow
def test_the_best_candidate_is_also_compiled_with_other_splash_blocks():
  topology = accelerators.tpu_topology("v5e-4")
  shape = dict(TINY, max_target_length=1024)

  def short(**extra) -> list[plan_ranking.Planned]:
    args, rest = plan.PlanArgs.parse(argv(compile_topology="v5e-4", max_candidates=2,
                                          **{"attention_blocks": "1024,2048", **shape, **extra}))
    overrides = startup.read_overrides(rest)
    config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
    return plan.shortlist(args, overrides, config, topology, 1)[0]

  assert plan.PlanArgs.parse(argv(**TINY))[0].block_sizes() == []  # off by default
  planned = short()
  # 1024 tiles the 1024-token sequence, 2048 does not: one variant of the first candidate.
  assert [p.settings.get("sa_block_kv_dq") for p in planned] == [None, None, 1024]
  assert {k: v for k, v in planned[2].settings.items() if not k.startswith("sa_")} == planned[0].settings
  assert planned[2].key not in {planned[0].key, planned[1].key}  # its own compile and cache entry
  assert "blocks=1024" in plan_search.describe(planned[2].settings)
  assert len(short(attention_blocks="none")) == 2 and len(short(sa_block_q=256, sa_block_q_dkv=256)) == 2


def test_plan_args_defaults():
  args, rest = plan.PlanArgs.parse(["plan", "configs/base.yml", "max_candidates=3", "steps=5"])
  assert dataclasses.asdict(args)["max_candidates"] == 3 and rest == ["plan", "configs/base.yml", "steps=5"]


def test_compiled_candidates_are_ranked_by_the_step_time_model():
  """The step-time model's MFU ranks, not the compiler's; host offload and DCN, which the model
  prices, are no caveat then; without the model the compiler's figure ranks, caveats and all."""
  topology = accelerators.tpu_topology("v5e-4")
  args, rest = plan.PlanArgs.parse(argv(compile_topology="v5e-4", max_candidates=2, **TINY))
  overrides = startup.read_overrides(rest)
  config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
  first, second = plan.shortlist(args, overrides, config, topology, 1)[0][:2]
  hbm, chips, seq_len, peak = 16 * 2**30, 4, config.data.max_target_length, 197.0

  def compiled(step_s: float, model_mfu: float | None) -> dict:
    result = {"status": "compiled", "compile_s": 1.0, "total": 2**30, "step_s": step_s}
    if model_mfu is None:
      return dict(result, model_error="no network figures")
    return dict(result, model_step_s=step_s * 2, model_mfu=model_mfu, model_lines=["step-time model", "  compute"])

  first.result, second.result = compiled(1e-3, 0.30), compiled(2e-3, 0.50)  # the compiler prefers the first
  rows, best = plan_ranking.rank_compiled([first, second], hbm, chips, seq_len, peak)
  assert best is not None and best[0] is second and best[1].by_model and best[1].mfu == 0.50
  assert rows[1][plan_ranking.HEADER.index("model MFU")] == "50.0%"

  first.estimate = dataclasses.replace(first.estimate, caveats=("host offload",))
  first.result = compiled(1e-3, 0.60)
  assert plan_ranking.rank_compiled([first, second], hbm, chips, seq_len, peak)[1][0] is first  # priced by the model

  first.result, second.result = compiled(1e-3, None), compiled(2e-3, None)
  _, best = plan_ranking.rank_compiled([first, second], hbm, chips, seq_len, peak)
  assert best is not None and best[0] is second and not best[1].by_model  # the offload caveat holds again
  first.estimate = dataclasses.replace(first.estimate, caveats=())
  _, best = plan_ranking.rank_compiled([first, second], hbm, chips, seq_len, peak)
  assert best is not None and best[0] is first and best[1].caveats == ()


def test_the_kernels_own_reruns_are_priced_the_fused_splash_backward_two_matmuls_fewer():
  """Splash's separate backward kernels re-run QK^T twice and dO·V^T once beyond the model's FLOPs, the fused one
  (sa_use_fused_bwd_kernel) QK^T once; use_iota_embed's one-hot lookup is a matmul with the table, forward and
  for its gradient. Neither is a model FLOP, here as upstream: MFU's numerator stays."""
  length, chips, peak = 2048, 4, accelerators.TPU_GENERATIONS["v5e"].peak_tflops * 1e12
  base = dict(TINY, attention="flash", max_target_length=length, per_device_batch_size=2, remat_policy="full")
  separate, fused, one_hot = (analytic("v5e-4", **base, **extra) for extra in (
      {}, {"sa_use_fused_bwd_kernel": True}, {"use_iota_embed": True}))
  sequences_per_chip = 2
  matmul = 2 * TINY["base_num_query_heads"] * TINY["head_dim"] * length * length / 2 * sequences_per_chip / peak
  assert separate.compute_s - fused.compute_s == pytest.approx(2 * matmul)
  lookup = 4 * length * TINY["vocab_size"] * TINY["base_emb_dim"] * sequences_per_chip / peak
  assert one_hot.compute_s - separate.compute_s == pytest.approx(lookup)
  assert separate.flops == fused.flops == one_hot.flops



def _fractional_search(whole_batches: bool = True):
  """The candidates for 4 sequences on a v5e-8 (fewer sequences than chips), full remat."""
  topology = accelerators.tpu_topology("v5e-8")
  config = config_lib.Config.for_testing(target=topology.target(), run_name="t", **TINY)
  model = plan_model.ModelShape.of(config.model, config.optim)
  return list(plan_search.candidates(model, topology, 1, {"remat_policy": "full"}, global_batch=4, seq_len=64,
                                     data_sharding=config.mesh.data_sharding, whole_batches=whole_batches,
                                     rules=config.mesh.logical_axis_rules))


def _accepted(candidate: dict) -> bool:
  overrides = startup.read_overrides(argv(compile_topology="v5e-8", **TINY, **candidate))
  try:
    config_lib.build_config(overrides, accelerators.tpu_topology("v5e-8").target(), default_run_name="plan")
  except ConfigError:
    return False
  return True


def test_fewer_sequences_than_chips_are_searched_as_config_validation_splits_them():
  """4 sequences on 8 chips: the rows split over the axes the layers split rows over and repeat over
  tensor or sequence (config validation's rule, configuration/batch_split.py); the planner kept none before."""
  found = _fractional_search()
  assert found and all(c["per_device_batch_size"] == 0.5 for c in found)
  assert all(plan_model.mesh_of(c)["tensor"] * plan_model.mesh_of(c)["sequence"] >= 2 for c in found)
  assert {c["ici_tensor_parallelism"] for c in found} > {1} and {c["ici_sequence_parallelism"] for c in found} > {1}
  for c in found[::max(1, len(found) // 3)][:3]:  # what the search keeps, config validation accepts
    assert _accepted(c), plan_search.describe(c)
  kept = {tuple(sorted(c.items())) for c in found}
  dropped = [c for c in _fractional_search(whole_batches=False) if tuple(sorted(c.items())) not in kept]
  for c in dropped[::max(1, len(dropped) // 3)][:3]:  # and what it drops, config validation refuses
    assert not _accepted(c), plan_search.describe(c)


@pytest.mark.slow
def test_the_planner_proposes_fewer_sequences_than_chips_and_the_proposal_trains_on_cpu():
  """4 sequences on a v5e-8: the planner's best layout repeats rows over tensor or sequence (before,
  it answered that no setting fits); the same keys validate, compile and train a step on CPU's 8 devices."""
  import jax
  import numpy as np

  from MaxText.training.run_assembly import build_run

  topology = accelerators.tpu_topology("v5e-8")
  args, rest = plan.PlanArgs.parse(argv(compile_topology="v5e-8", max_candidates=1, remat_policy="full",
                                        global_batch_tokens=4 * 64, **TINY))
  overrides = startup.read_overrides(rest)
  config = config_lib.build_config(overrides, topology.target(), default_run_name="plan")
  best = plan.shortlist(args, overrides, config, topology, 1)[0][0]
  assert best.config.data.global_batch_size == 4
  assert best.config.data.batch_axes != best.config.mesh.data_sharding, plan_search.describe(best.settings)
  on_cpu = config_lib.Config.for_testing(**TINY, remat_policy="full", **best.settings)
  run = build_run(on_cpu)
  state, metrics = run.train_step(run.init_state(), next(run.data_iterator()), jax.random.key(0))
  assert np.isfinite(float(jax.device_get(metrics["loss"])))


def test_without_a_global_batch_the_search_tries_the_fractions_upstream_recipes_run():
  """0.25 and 0.125 sequences per chip (upstream's v6e llama3_1-70b-129024 runs 0.125) are searched where the
  chips hold a whole global batch; the smallest searched before was 0.5."""
  def batches(name: str) -> dict[float, dict]:
    topology = accelerators.tpu_topology(name)
    config = config_lib.Config.for_testing(target=topology.target(), run_name="t", **TINY)
    model = plan_model.ModelShape.of(config.model, config.optim)
    found = plan_search.candidates(model, topology, 1, {"remat_policy": "full", "optimizer_memory_host_offload": False},
                                   global_batch=None, seq_len=64, data_sharding=config.mesh.data_sharding,
                                   rules=config.mesh.logical_axis_rules)
    return {c["per_device_batch_size"]: c for c in found}

  eight, four = batches("v5e-8"), batches("v5e-4")
  assert {0.125, 0.25, 0.5} <= eight.keys() and min(eight) == 0.125
  assert min(four) == 0.25  # 0.125 x 4 chips is half a sequence
  assert _accepted(eight[0.125]), plan_search.describe(eight[0.125])


def test_a_degree_fixed_to_minus_one_fills_what_the_others_leave():
  """ici_data_parallelism=-1 beside ici_fsdp_parallelism=2 (and dcn_data_parallelism=-1 on two slices): data takes
  what the others leave, as config resolution has it. The -1 was taken as a degree: no candidate, and plan said
  that no mesh layout respects the fixed degrees."""
  topology = accelerators.tpu_topology("v5e-8")
  config = config_lib.Config.for_testing(target=topology.target(), run_name="t", **TINY)
  model = plan_model.ModelShape.of(config.model, config.optim)
  for slices, fixed in ((1, {"ici_data_parallelism": -1, "ici_fsdp_parallelism": 2}),
                        (2, {"ici_data_parallelism": -1, "dcn_data_parallelism": -1})):
    found = list(plan_search.candidates(model, topology, slices, {"remat_policy": "full", **fixed},
                                        global_batch=16 * slices, seq_len=64, rules=config.mesh.logical_axis_rules))
    assert found, fixed
    for c in found:
      mesh = plan_model.mesh_of(c)
      assert c["ici_fsdp_parallelism"] == 2 or slices == 2
      assert c["ici_data_parallelism"] >= 1 and c.get("dcn_data_parallelism", 1) >= 1
      assert math.prod(mesh.values()) == 8 * slices, c
    assert any(c["ici_data_parallelism"] == 4 for c in found)
