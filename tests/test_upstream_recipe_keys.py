"""Upstream MaxText's recipe keys that are not remat placements: use_iota_embed (the token lookup as
a one-hot matmul), sa_use_fused_bwd_kernel (splash's fused backward: tests/layers/test_attention_kernels.py),
reuse_example_batch (every step on the first batch), gcs_metrics and the profiler's step keys (upstream's
names of enable_jsonl_metrics, profile_start_step, profile_steps), enable_dropout, profile_cleanly,
enable_checkpoint_cloud_logger, use_qwix_quantization, allow_split_physical_axes, custom_mesh, fused_qkv and
fused_mlp (megablox and ici_context_parallelism: tests/test_spellings.py), and three of upstream's tuning blocks typed out as
they are written there, each key checked for its effect."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import startup, train
from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.input_pipeline import create_data_iterator
from MaxText.layers.embeddings import Embed
from MaxText.platform import sharding
from tests.conftest import REPO_ROOT
from train_utils import Run

# benchmarks/maxtext_trillium_model_configs.py (AI-Hypercomputer/maxtext, 2026-08-22), the tuning_params of
# llama2-7b-4096 (v6e), llama3_1-8b-8192 (v6e) and mixtral_8x7b_dropless (v6e), keys and values as written there.
V6E_LLAMA2_7B_4096 = {
    "per_device_batch_size": 12, "ici_fsdp_parallelism": -1, "remat_policy": "full", "max_target_length": 4096,
    "attention": "flash", "gcs_metrics": True, "use_iota_embed": True, "dataset_path": "gs://max-datasets-rogue",
    "dataset_type": "synthetic", "reuse_example_batch": 1, "enable_checkpointing": False, "profiler": "xplane",
    "sa_block_q": 1024, "sa_block_q_dkv": 2048, "sa_block_q_dq": 2048,
}
V6E_LLAMA3_1_8B_8192 = {
    "per_device_batch_size": 4, "ici_fsdp_parallelism": -1, "remat_policy": "custom", "decoder_layer_input": "offload",
    "out_proj": "offload", "query_proj": "offload", "key_proj": "offload", "value_proj": "offload",
    "max_target_length": 8192, "attention": "flash", "use_iota_embed": True, "dataset_path": "gs://max-datasets-rogue",
    "dataset_type": "synthetic", "enable_checkpointing": False, "sa_block_q": 2048, "sa_block_kv": 2048,
    "sa_block_kv_compute": 2048, "sa_block_q_dkv": 2048, "sa_block_kv_dkv": 2048, "sa_block_kv_dkv_compute": 2048,
    "sa_block_q_dq": 2048, "sa_block_kv_dq": 2048, "sa_use_fused_bwd_kernel": True, "profiler": "xplane",
    "skip_first_n_steps_for_profiler": 10, "profiler_steps": 5,
}
V6E_MIXTRAL_8X7B_DROPLESS = {  # mixtral_8x7b_dropless (v6e)
    "per_device_batch_size": 12, "ici_fsdp_parallelism": -1, "max_target_length": 4096, "remat_policy": "full",
    "attention": "flash", "gcs_metrics": True, "use_iota_embed": True, "dataset_path": "gs://max-datasets-rogue",
    "dataset_type": "synthetic", "reuse_example_batch": 1, "enable_checkpointing": False, "profiler": "xplane",
    "sa_block_q": 2048, "sa_block_q_dkv": 2048, "sa_block_q_dq": 2048, "megablox": True, "sparse_matmul": True,
}
_TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
             base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1, print_config=False)


# ---------------------------------------------------------------- use_iota_embed

def test_the_one_hot_lookup_gives_the_gathers_values_and_gradients():
  tokens = jnp.asarray([[0, 5, 5, 127], [3, 3, 3, 1]], jnp.int32)  # repeats: their gradients add up
  with nnx.use_eager_sharding(False):
    gather, one_hot = (Embed(128, 16, dtype=jnp.float32, weight_dtype=jnp.float32, rngs=nnx.Rngs(0), one_hot=flag)
                       for flag in (False, True))

  def value_and_grad(embed):
    graph, params = nnx.split(embed)
    grads = jax.grad(lambda p: jnp.sum(jnp.sin(nnx.merge(graph, p)(tokens)) * jnp.arange(16.0)[None, None, :]))(params)
    return embed(tokens), grads["embedding"][...]

  (out, grad), (ref, ref_grad) = value_and_grad(one_hot), value_and_grad(gather)
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-7)
  primitives = str(jax.make_jaxpr(one_hot)(tokens))
  assert "dot_general" in primitives and "gather" not in primitives  # a matmul, not a lookup


@pytest.mark.slow  # two compiles of a train step
def test_a_train_step_with_the_one_hot_lookup_equals_the_gathers():
  def step(use_iota_embed):
    run = Run(Config.for_testing(**_TINY, dtype="float32", use_iota_embed=use_iota_embed))
    state, history = run.train(run.init(), 1)
    return history[0], state.params["token_embedder"]["embedding"]

  (metrics, table), (ref_metrics, ref_table) = step(True), step(False)
  np.testing.assert_allclose([metrics["loss"], metrics["grad_norm"]], [ref_metrics["loss"], ref_metrics["grad_norm"]],
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(table), np.asarray(ref_table), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- fused_qkv and fused_mlp

def _values_grads_dots(layer: nnx.Module, *args: jax.Array) -> tuple[jax.Array, object, int]:
  """The layer's output, its gradients for the parameters and first input, and the dot_generals its
  gradient computation traces."""
  graph, params = nnx.split(layer, nnx.Param)
  loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graph, p)(x, *args[1:])))
  with sharding.unsharded():
    grads = jax.grad(loss, argnums=(0, 1))(params, args[0])
    dots = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, args[0])).count("dot_general")
    return layer(*args), grads, dots


@pytest.mark.parametrize("which", ["fused_qkv", "fused_mlp"])
def test_a_fused_projection_computes_the_three_or_two_in_one_matmul_with_the_same_values(which):
  """fused_qkv: q, k and v from one matmul, and one each for the input's and the kernels' gradients (6 fewer
  than three apart); fused_mlp: wi_0 and wi_1 likewise (3 fewer). The same parameters, values and gradients."""
  from MaxText.layers.attention import Attention
  from MaxText.layers.mlp import MlpBlock

  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 64)), jnp.float32)
  got = []
  for fused in (False, True):
    cfg = Config.for_testing(**{**_TINY, "base_num_kv_heads": 4}, dtype="float32", attention="dot_product",
                             **{which: fused}).model
    with nnx.use_eager_sharding(False):
      if which == "fused_qkv":
        layer = Attention(cfg, rngs=nnx.Rngs(0))
        args = (x, jnp.broadcast_to(jnp.arange(8), (2, 8)), jnp.ones((2, 8), jnp.int32))
      else:
        layer, args = MlpBlock(cfg, rngs=nnx.Rngs(0)), (x,)
    got.append(_values_grads_dots(layer, *args))
  (ref, ref_grads, ref_dots), (out, grads, dots) = got
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads, ref_grads)
  assert ref_dots - dots == (6 if which == "fused_qkv" else 3), (ref_dots, dots)


@pytest.mark.slow  # two compiles of a train step
def test_a_train_step_with_fused_projections_equals_the_unfused_one():
  def step(fused):
    run = Run(Config.for_testing(**{**_TINY, "base_num_kv_heads": 4}, dtype="float32", fused_qkv=fused,
                                 fused_mlp=fused))
    return run.train(run.init(), 2)[1]

  fused, ref = step(True), step(False)
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose([h[key] for h in fused], [h[key] for h in ref], rtol=1e-5, err_msg=key)


def test_fused_qkv_needs_multi_head_attention():
  with pytest.raises(ConfigError, match=r"^fused_qkv=True needs multi-head attention \(num_kv_heads == "
                     r"num_query_heads, not attention_type=mla\); got 4 query and 2 key/value heads"):
    Config.for_testing(**_TINY, fused_qkv=True)


# ---------------------------------------------------------------- sa_use_fused_bwd_kernel

@pytest.mark.slow  # two AOT compiles for a TPU slice
def test_the_fused_backward_leaves_the_dq_kernel_out_of_the_tpu_program(capsys, monkeypatch, tmp_path):
  """Compiled for v5e-4 (libtpu on CPU), one layer: four Pallas calls per step with splash's separate
  dQ kernel, three with the fused backward, which computes dQ inside the dK/dV kernel; the step-time
  model prices each call's matmuls per query-key pair: forward 2 (run twice, once under remat), dQ 3,
  dK/dV 4, fused 5."""
  from MaxText import train_compile
  from MaxText.aot.step_time import program, saved

  def pallas_calls(fused):
    tiles = {f"sa_block_{b}": 128 for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq",
                                            "kv_dq")}
    args = {**_TINY, "base_emb_dim": 256, "head_dim": 128, "base_num_decoder_layers": 1, "max_target_length": 256,
            "compile_topology": "v5e-4", "attention": "flash", "sa_use_fused_bwd_kernel": fused, **tiles}
    monkeypatch.setenv(saved.SAVE_ENV, str(tmp_path / f"fused_{fused}"))
    assert train_compile.main(["train_compile", str(REPO_ROOT / "configs" / "base.yml")]
                              + [f"{k}={v}" for k, v in args.items()]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "Pallas kernel calls per step" in line)
    hlo_text, target, _ = saved.load_step(str(tmp_path / f"fused_{fused}"))
    kernels = [op.work.base_s for op in program.build_program(hlo_text, target) if op.category == "kernel" and op.work]
    per_matmul = min(kernels) / 2  # a forward call: QK^T and PV
    return int(line.split("not in it: ")[1].split()[0]), sorted(round(s / per_matmul, 6) for s in kernels)

  assert pallas_calls(False) == (4, [2, 2, 3, 4])
  assert pallas_calls(True) == (3, [2, 2, 5])


# ---------------------------------------------------------------- reuse_example_batch

def test_the_reused_batch_is_read_once_and_saves_the_position_before_it():
  config = Config.for_testing(**_TINY, reuse_example_batch=1)
  assert config.data.reuse_example_batch is True
  data = create_data_iterator(config, sharding.create_mesh(config.mesh))
  data.set_state({"step": 5})  # a resumed run's position
  reused = train.ReusedBatch(data)
  first = next(reused)
  assert all(next(reused) is first for _ in range(3))
  assert data.get_state() == {"step": 6}  # one batch read from the source, at the position
  assert reused.get_state() == {"step": 5}  # a checkpoint resumes at the same batch
  fresh = create_data_iterator(config, sharding.create_mesh(config.mesh))
  fresh.set_state({"step": 5})
  np.testing.assert_array_equal(np.asarray(first["inputs"]), np.asarray(next(fresh)["inputs"]))


def test_reusing_a_batch_is_refused_where_each_batch_comes_from_the_state():
  with pytest.raises(ConfigError, match=r"^reuse_example_batch repeats the first batch read, but objective=grpo "
                                        r"samples each step's batch from the state being trained; drop reuse_example_batch$"):
    Config.for_testing(**_TINY, reuse_example_batch=True, objective="grpo")


@pytest.mark.slow  # three short training runs
def test_a_run_on_one_batch_resumes_on_the_same_batch(tmp_path):
  def run(name, steps):
    args = {**_TINY, "run_name": name, "base_output_directory": tmp_path, "steps": steps, "reuse_example_batch": 1,
            "checkpoint_period": 2, "async_checkpointing": False, "cpu_peak_tflops": 0.1,
            "learning_rate_schedule_steps": 4}  # one schedule for the 2- and 4-step runs
    assert train.main(["train", str(REPO_ROOT / "configs" / "base.yml")] + [f"{k}={v}" for k, v in args.items()]) == 0
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

  whole = run("whole", 4)
  assert whole[4]["loss"] < whole[1]["loss"] and whole[4]["input_wait_s"] < 0.05  # the same batch, learnt
  run("resumed", 2)
  resumed = run("resumed", 4)
  assert [resumed[s]["loss"] for s in (3, 4)] == [whole[s]["loss"] for s in (3, 4)]


# ---------------------------------------------------------------- enable_dropout, profile_cleanly, enable_checkpoint_cloud_logger

def test_enable_dropout_false_turns_dropout_off_whatever_the_rate():
  assert Config.for_testing(**_TINY, dropout_rate=0.25).model.dropout_rate == 0.25
  assert Config.for_testing(**_TINY, dropout_rate=0.25, enable_dropout=False).model.dropout_rate == 0.0


class _CountingStep:
  def __init__(self):
    self.calls = 0

  def __call__(self, state, batch, rng):
    self.calls += 1
    return state, {"loss": jnp.asarray(1.0), "grad_norm": jnp.asarray(1.0), "num_tokens": jnp.asarray(8.0)}


@pytest.mark.parametrize("clean", [True, False])
def test_profile_cleanly_waits_for_the_step_at_both_ends_of_the_trace(clean, tmp_path, monkeypatch):
  """Clean: the trace starts after step 2 and stops after step 4 with no later step dispatched. Not
  clean: each end comes while the next step is already dispatched, and the loop did not wait."""
  from MaxText.training import metrics
  from MaxText.training.trainer import ProfilerHook, Trainer

  config = Config.for_testing(**_TINY, steps=7, profile_cleanly=clean)
  assert config.run.profile_cleanly is clean
  step, ends = _CountingStep(), []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda directory: ends.append(("start", step.calls)))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: ends.append(("stop", step.calls)))
  trainer = Trainer(config, step, iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  hook = ProfilerHook(str(tmp_path), 2, 2, active=True, clean=config.run.profile_cleanly)
  trainer.add_hook(hook, every=0, needs_state=hook.clean)
  trainer.run(state=None)
  assert ends == ([("start", 2), ("stop", 4)] if clean else [("start", 3), ("stop", 5)])


def test_a_trace_past_the_runs_end_stops_at_its_last_step_and_one_that_never_starts_says_so(tmp_path, monkeypatch,
                                                                                          capsys):
  """profile_steps reaching past steps: the trace stops after the last step and its line names the steps
  traced (it named steps the run never took); a start at or past steps is one warning line, no trace."""
  from MaxText.training import metrics
  from MaxText.training.trainer import Trainer, profile_hook

  config = Config.for_testing(**_TINY, steps=4)
  step, ends = _CountingStep(), []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda directory: ends.append(("start", step.calls)))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: ends.append(("stop", step.calls)))
  trainer = Trainer(config, step, iter(range(100)), jax.random.key(0),
                    metrics.training_tflops_per_step(config.model, 8, 32), 1.0)
  hook = profile_hook(str(tmp_path), 2, 5, 4, active=True, clean=True)
  assert hook is not None
  trainer.add_hook(hook, every=0, needs_state=True)
  trainer.run(state=None)
  assert ends == [("start", 2), ("stop", 4)]
  assert f"profile: steps 3..4 traced into {tmp_path} " in capsys.readouterr().out
  assert profile_hook(str(tmp_path), 4, 5, 4, active=True, clean=True) is None
  assert capsys.readouterr().err == ("warning: profile_start_step=4 is not before steps=4: no step is traced; set "
                                     "profile_start_step below 4\n")


def test_checkpoint_events_go_to_the_run_folder_with_one_line_saying_so(tmp_path, capsys):
  from MaxText.run_dir.checkpointing import RunCheckpoints

  config = Config.for_testing(**_TINY, base_output_directory=str(tmp_path), run_name="events",
                              enable_checkpoint_cloud_logger=True)
  assert config.checkpoint.events_path == str(tmp_path / "events" / "checkpoint_events.jsonl")
  assert Config.for_testing(**_TINY).checkpoint.events_path == ""
  checkpoints = RunCheckpoints.for_run(config.checkpoint)
  for step in (1, 2):
    checkpoints.save(step, {"w": jnp.arange(4.0)}, {}, {})
  checkpoints.close()
  events = [json.loads(line) for line in (tmp_path / "events" / "checkpoint_events.jsonl").read_text().splitlines()]
  assert [(e["event_type"], e["step"]) for e in events] == [("save", 1), ("save", 2)]
  assert capsys.readouterr().out.count("checkpoint_events.jsonl") == 1


# ---------------------------------------------------------------- ici_context_parallelism

def test_upstreams_context_axis_is_the_sequence_axis_and_one_block_cannot_set_two_degrees():
  mesh = dict(Config.for_testing(**_TINY, ici_context_parallelism=2, context_parallel_strategy="ring").mesh.shape)
  assert (mesh["sequence"], mesh["fsdp"]) == (2, 4)
  with pytest.raises(ConfigError, match=r"^'ici_context_parallelism' \(deprecated\) and 'ici_sequence_parallelism' "
                                        r"name the same setting but Config.for_testing gives them different values "
                                        r"\(2 and 4\); keep only 'ici_sequence_parallelism'$"):
    Config.for_testing(**_TINY, ici_context_parallelism=2, ici_sequence_parallelism=4)


# ---------------------------------------------------------------- use_qwix_quantization

def test_use_qwix_quantization_is_accepted_and_warns_once_where_it_would_pick_qwixs_backward(monkeypatch, capsys):
  from MaxText.configuration import model_config

  monkeypatch.setattr(model_config, "_WARNED_QWIX", set())
  plain = Config.for_testing(**_TINY, quantization="int8").model
  for _ in range(2):
    assert Config.for_testing(**_TINY, use_qwix_quantization=True, quantization="int8").model.quantization == "int8"
  Config.for_testing(**_TINY, use_qwix_quantization=True)  # no quantization: nothing to choose, as upstream
  assert plain.use_qwix_quantization is False
  assert [line for line in capsys.readouterr().err.splitlines() if "qwix" in line.lower()] == [
      "warning: use_qwix_quantization=True: quantization=int8 runs this project's own implementation (backward: "
      "straight-through in dtype), not Qwix's, which quantizes the backward matmuls to the forward's type; see "
      "getting_started/Low_precision.md"]


# ---------------------------------------------------------------- allow_split_physical_axes, custom_mesh

def _v6e_256_mesh(slices=1, **degrees):
  from MaxText.platform import accelerators

  topology = accelerators.tpu_topology("v6e-256")
  config = Config.for_testing(target=topology.target(slices), run_name="mesh", num_slices=slices, **degrees)
  return sharding.create_mesh(config.mesh, startup.describe_topology(topology, slices))


@pytest.mark.parametrize("slices, degrees", [
    (1, dict(custom_mesh="hybrid_ring_64x4", ici_fsdp_parallelism=64, ici_tensor_parallelism=4)),
    (1, dict(custom_mesh="hybrid_ring_32x8", ici_fsdp_parallelism=8, ici_sequence_parallelism=32)),  # ring axis first
    (2, dict(custom_mesh="hybrid_ring_64x4", ici_fsdp_parallelism=64, ici_tensor_parallelism=4, dcn_data_parallelism=1,
             dcn_fsdp_parallelism=2, allow_split_physical_axes=False)),
], ids=["64x4", "32x8", "64x4 on two slices"])
def test_a_hybrid_ring_mesh_puts_rings_of_neighbouring_chips_on_one_axis(slices, degrees):
  """Compile-only v6e-256 devices (libtpu): each group along the ring's axis is a closed loop of
  chips one hop apart in one slice; the dcn axis spans the slices, as jax's hybrid meshes do."""
  mesh = _v6e_256_mesh(slices, **degrees)
  size = 4 if degrees["custom_mesh"].endswith("x4") else 8
  axis = next(i for i, name in enumerate(mesh.axis_names) if mesh.shape[name] == size)
  rings = np.moveaxis(mesh.devices, axis, -1).reshape(-1, size)
  assert len({d.id for d in mesh.devices.flat}) == 256 * slices
  hops = {sum(abs(a - b) for a, b in zip(ring[i].coords, ring[(i + 1) % size].coords)) for ring in rings for i in range(size)}
  assert hops == {1} and all(len({getattr(d, "slice_index", None) for d in ring}) == 1 for ring in rings)
  if slices == 2:
    fsdp = np.moveaxis(mesh.devices, mesh.axis_names.index("fsdp"), 0).reshape(128, -1)[:, 0]
    assert [d.slice_index for d in fsdp[[0, 63, 64, 127]]] == [0, 0, 1, 1]


def test_a_hybrid_ring_on_a_slice_of_256_chips_that_is_no_16_by_16_grid_names_custom_mesh():
  """v5p-512's 256 chips are 4 x 8 x 8: the line names custom_mesh (it was jax's layout error advising
  allow_split_physical_axes=True, which cannot help: the rings need the 16 x 16 grid)."""
  from MaxText.platform import accelerators

  topology = accelerators.tpu_topology("v5p-512")
  config = Config.for_testing(**_TINY, target=topology.target(1), run_name="mesh", custom_mesh="hybrid_ring_64x4",
                              ici_fsdp_parallelism=64, ici_tensor_parallelism=4)
  with pytest.raises(ConfigError, match=r"^custom_mesh=hybrid_ring_64x4 lays out a slice of 16 x 16 chips \(v6e-256\); "
                                        r"this slice's chips are 4 x 8 x 8; drop custom_mesh$"):
    sharding.create_mesh(config.mesh, startup.describe_topology(topology, 1))


def test_an_axis_wider_than_a_physical_one_needs_split_physical_axes():
  assert dict(_v6e_256_mesh(ici_fsdp_parallelism=8, ici_tensor_parallelism=32).shape)["tensor"] == 32
  with pytest.raises(ConfigError, match=r"^cannot lay out mesh ici=\[1, 1, 8, 1, 1, 32, 1, 1\] .* on 256 devices without "
                                        r"splitting a physical axis \(allow_split_physical_axes=False; True allows it\): "):
    _v6e_256_mesh(ici_fsdp_parallelism=8, ici_tensor_parallelism=32, allow_split_physical_axes=False)


@pytest.mark.parametrize("overrides, message", [
    (dict(custom_mesh="hybrid_ring_16x16"), r"^custom_mesh='hybrid_ring_16x16' is not a device order here; known: "
                                            r"hybrid_ring_64x4, hybrid_ring_32x8 \('' for jax's own\)$"),
    (dict(custom_mesh="hybrid_ring_64x4"), r"^custom_mesh=hybrid_ring_64x4 lays out the 256 chips of a v6e-256 slice; "
                                           r"this target has 8 devices per slice; drop custom_mesh$"),
])
def test_a_custom_mesh_this_target_cannot_take_is_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message):
    Config.for_testing(**_TINY, **overrides)


def test_a_hybrid_ring_needs_its_two_degrees_and_on_one_slice_split_axes():
  from MaxText.platform import accelerators

  target = accelerators.tpu_topology("v6e-256").target()
  with pytest.raises(ConfigError, match=r"^custom_mesh=hybrid_ring_32x8 needs two ici axes of degrees 32 and 8 \(the "
                                        r"rest 1\), got ici_fsdp_parallelism=256$"):
    Config.for_testing(target=target, run_name="r", custom_mesh="hybrid_ring_32x8")
  with pytest.raises(ConfigError, match=r"^custom_mesh=hybrid_ring_64x4 on one slice needs allow_split_physical_axes=True"):
    Config.for_testing(target=target, run_name="r", custom_mesh="hybrid_ring_64x4", ici_fsdp_parallelism=64,
                       ici_tensor_parallelism=4, allow_split_physical_axes=False)


# ---------------------------------------------------------------- upstream's tuning blocks

def test_a_synthetic_run_does_not_probe_the_dataset_path_only_tfds_reads(monkeypatch):
  probed = []
  monkeypatch.setattr(startup.storage, "check_buckets", lambda paths, timeout: probed.append(dict(paths)))
  startup.read_overrides(["prog", "dataset_path=gs://max-datasets-rogue"])
  startup.read_overrides(["prog", "dataset_path=gs://max-datasets-rogue", "dataset_type=tfds"])
  assert "dataset_path" not in probed[0] and probed[1]["dataset_path"] == "gs://max-datasets-rogue"


@pytest.mark.parametrize("model_name, block", [("llama2-7b", V6E_LLAMA2_7B_4096), ("llama3.1-8b", V6E_LLAMA3_1_8B_8192),
                                               ("mixtral-8x7b", V6E_MIXTRAL_8X7B_DROPLESS)],
                         ids=["v6e llama2-7b-4096", "v6e llama3_1-8b-8192", "v6e mixtral_8x7b_dropless"])
def test_an_upstream_tuning_block_loads_as_written_and_each_key_takes_effect(model_name, block):
  config = Config.for_testing(model_name=model_name, **block)
  model, data, run = config.model, config.data, config.run
  assert (data.per_device_batch_size, data.max_target_length, data.dataset_type) == (
      block["per_device_batch_size"], block["max_target_length"], "synthetic")
  assert dict(config.mesh.shape)["fsdp"] == config.target.num_devices  # -1: every device
  assert model.remat_policy == block["remat_policy"] and model.attn.attention == "flash"
  blocks = model.attn.attention_blocks
  assert {k: getattr(blocks, k) for k in block if k.startswith("sa_")} == {k: v for k, v in block.items()
                                                                          if k.startswith("sa_")}
  assert model.use_iota_embed and data.reuse_example_batch == bool(block.get("reuse_example_batch"))
  assert run.enable_jsonl_metrics and run.profiler == "xplane" and not config.checkpoint.enable_checkpointing
  assert (run.profile_start_step, run.profile_steps) == (block.get("skip_first_n_steps_for_profiler", 3),
                                                         block.get("profiler_steps", 5))
  if model.remat_policy == "custom":
    assert set(model.remat.offload) == {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"}
  if "megablox" in block:  # the Pallas grouped matmul for the dropless experts
    assert model.moe.sparse_matmul and model.moe.moe_grouped_matmul == "megablox"


# maxtext_v5e_model_configs.py (same snapshot), default-128b-v5e-256: the fused projections, upstream's remat preset
V5E_DEFAULT_128B = {
    "ici_fsdp_parallelism": -1, "ici_tensor_parallelism": 16, "per_device_batch_size": 1,
    "remat_policy": "qkv_proj_offloaded", "global_parameter_scale": 128, "max_target_length": 2048,
    "attention": "flash", "use_iota_embed": True, "fused_qkv": True, "fused_mlp": True,
    "dataset_path": "gs://max-datasets-rogue", "dataset_type": "synthetic", "reuse_example_batch": 1,
    "enable_checkpointing": False, "profiler": "xplane", "use_qwix_quantization": True,
}


def test_upstreams_v5e_128b_block_loads_with_its_fused_projections():
  from MaxText.platform.accelerators import DeviceTarget

  v5e_256 = DeviceTarget(platform="tpu", device_kind="TPU v5 lite", num_devices=256)
  config = Config.for_testing(target=v5e_256, model_name="default", print_config=False, **V5E_DEFAULT_128B)
  model = config.model
  assert model.fused_qkv and model.fused_mlp and model.num_query_heads == model.num_kv_heads
  assert dict(config.mesh.shape)["tensor"] == 16 and dict(config.mesh.shape)["fsdp"] == 16
  assert set(model.remat.offload) == {"query_proj", "key_proj", "value_proj"}


@pytest.mark.slow  # a training run
def test_an_upstream_tuning_block_trains_on_cpu_as_written(tmp_path):
  """The v6e Llama 2 7B block, only the model's shape and batch made small: one batch read, the
  one-hot lookup, metrics.jsonl (gcs_metrics), and its dataset_path bucket never opened (synthetic)."""
  small = {**V6E_LLAMA2_7B_4096, **_TINY, "run_name": "recipe", "base_output_directory": tmp_path, "steps": 2,
           "cpu_peak_tflops": 0.1}
  assert train.main(["train", str(REPO_ROOT / "configs" / "base.yml")] + [f"{k}={v}" for k, v in small.items()]) == 0
  records = [json.loads(line) for line in (tmp_path / "recipe" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2]
  assert not (tmp_path / "recipe" / "checkpoints").exists()
