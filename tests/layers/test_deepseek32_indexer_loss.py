"""DeepSeek-V3.2's lightning-indexer training (layers/indexer.py, "Training the indexer"): the KL
loss against a float64 reference in both stages, the dense warm-up trains only the indexer and
brings its choice toward the attention's, the sparse stage keeps the indexer and the model on
their own losses, and the keys' bad combinations are one-line errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration.config import Config
from MaxText.errors import ConfigError
from MaxText.layers import attention_kernels, masks, sparse_attention
from MaxText.layers.indexer import head_mean_probs, index_scores, indexer_kl
from MaxText.platform import sharding
from MaxText.run_dir import checkpointing
from MaxText.training import params_io, run_start

H = pytest.importorskip("hf_families")
import train_utils  # noqa: E402
from test_family_training import _config  # noqa: E402 (needs hf_families' skip first)

L, N, HD, I, J, TOPK = 12, 3, 8, 2, 6, 4


def _inputs(seed: int = 0) -> dict[str, jax.Array]:
  k = jax.random.split(jax.random.key(seed), 6)
  return {"q": jax.random.normal(k[0], (1, L, N, HD)), "k": jax.random.normal(k[1], (1, L, N, HD)),
          "q_index": jax.random.normal(k[2], (1, L, I, J)), "w": jax.random.normal(k[3], (1, L, I)),
          "index_keys": jax.random.normal(k[4], (1, L, J)), "v": jax.random.normal(k[5], (1, L, N, HD))}


def _numpy_kl(x: dict[str, jax.Array], topk: int | None) -> float:
  """Σ over queries of KL(p ‖ q) in float64, written out per query: p the heads' mean attention
  probabilities over the key set, q the indexer's softmax over it; the set is every causal key,
  or (topk) the indexer's top-k of them."""
  q, k = np.asarray(x["q"], np.float64)[0], np.asarray(x["k"], np.float64)[0]
  qi, w, ki = (np.asarray(x[n], np.float64)[0] for n in ("q_index", "w", "index_keys"))
  total = 0.0
  for t in range(L):
    causal = np.arange(t + 1)
    scores = np.array([sum(w[t, i] * max(qi[t, i] @ ki[s], 0.0) for i in range(I)) for s in causal])
    keys = causal if topk is None else causal[np.argsort(-scores, kind="stable")[:topk]]
    chosen = scores[keys] if topk is None else scores[np.argsort(-scores, kind="stable")[:topk]]
    p = np.zeros(len(keys))
    for n in range(N):
      logits = np.array([q[t, n] @ k[s, n] for s in keys])
      e = np.exp(logits - logits.max())
      p += e / e.sum()
    p /= p.sum()
    log_q = chosen - chosen.max() - np.log(np.exp(chosen - chosen.max()).sum())
    total += float(np.sum(p * (np.log(p) - log_q)))
  return total


def test_dense_warmup_kl_equals_float64():
  x = _inputs()
  causal = masks.self_mask(jnp.ones((1, L), jnp.int32))
  target = head_mean_probs(x["q"], x["k"], causal)
  kl_sum, queries = indexer_kl(target, index_scores(x["q_index"], x["w"], x["index_keys"]), causal)
  assert float(queries) == L
  np.testing.assert_allclose(float(kl_sum), _numpy_kl(x, None), rtol=1e-5)


def test_sparse_kl_equals_float64_in_both_forms():
  """The masked form (per-head keys) and the gathered form (one key row shared by the heads, as MLA's
  absorbed keys are) give the KL over each query's top-k keys."""
  x = _inputs(1)
  segments = jnp.ones((1, L), jnp.int32)
  index = (x["q_index"], x["w"], x["index_keys"])
  _, kl_masked, queries = sparse_attention.masked_attention_kl(x["q"], x["k"], x["v"], masks.self_mask(segments),
                                                               *index, TOPK)
  np.testing.assert_allclose(float(kl_masked), _numpy_kl(x, TOPK), rtol=1e-5)
  assert float(queries) == L
  shared = {**x, "k": jnp.broadcast_to(x["k"][:, :, :1], x["k"].shape)}
  positions = jnp.arange(L)[None]
  _, kl_gathered, _ = sparse_attention.gathered_attention_kl(shared["q"], shared["k"][:, :, 0], shared["v"][:, :, 0],
                                                             positions, positions, segments, segments, *index, TOPK)
  np.testing.assert_allclose(float(kl_gathered), _numpy_kl(shared, TOPK), rtol=1e-5)


def _is_indexer(path: tuple[object, ...]) -> bool:
  return any(getattr(key, "key", None) == "indexer" for key in path)


def _leaves(tree: object) -> list[tuple[tuple[object, ...], np.ndarray]]:
  return [(p, np.asarray(v)) for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]]


def _indexer_config(**keys: object) -> Config:
  return _config("deepseek32", ici_fsdp_parallelism=1, ici_data_parallelism=-1, learning_rate=3e-3, warmup_steps_fraction=0.0,
                 indexer_loss_scaling_factor=1.0, **keys)


@pytest.mark.slow
def test_warmup_trains_only_the_indexer_and_its_loss_falls():
  run = train_utils.Run(_indexer_config(indexer_warmup=True))
  start = run.init()
  before = _leaves(start.params)
  end, history = run.train(start, 4)
  after = _leaves(end.params)
  changed = [p for (p, a), (_, b) in zip(before, after) if not np.array_equal(a, b)]
  assert changed and all(_is_indexer(p) for p in changed), changed
  # Every stack's indexer kernels move (a LayerNorm bias may see an exactly zero gradient: the
  # softmax over keys ignores a shift shared by every key).
  kernels = [p for p, _ in before if _is_indexer(p) and getattr(p[-1], "key", None) == "kernel"]
  assert kernels and set(kernels) <= set(changed), set(kernels) - set(changed)
  losses = [h["indexer_loss"] for h in history]
  assert losses[-1] < losses[0], losses


def test_warmup_brings_the_indexers_top_k_toward_the_attentions():
  """One layer's indexer trained by the KL alone against fixed dense attention: the overlap of its
  top-k with the attention's (heads' mean) top-k rises."""
  x = _inputs(2)
  causal = masks.self_mask(jnp.ones((1, L), jnp.int32))
  target = head_mean_probs(x["q"], x["k"], causal)
  index = {"q_index": x["q_index"], "w": x["w"], "index_keys": x["index_keys"]}

  def loss(index: dict[str, jax.Array]) -> jax.Array:
    return indexer_kl(target, index_scores(index["q_index"], index["w"], index["index_keys"]), causal)[0]

  def agreement(index: dict[str, jax.Array]) -> float:
    scores = index_scores(index["q_index"], index["w"], index["index_keys"])
    ours = masks.top_k_mask(scores, causal, TOPK)
    theirs = masks.top_k_mask(target, causal, TOPK)
    return float(jnp.sum(ours & theirs) / jnp.sum(theirs))

  start_loss, start_agreement = float(loss(index)), agreement(index)
  grad = jax.jit(jax.grad(loss))
  for _ in range(300):
    index = jax.tree.map(lambda p, g: p - 0.05 * g, index, grad(index))
  assert float(loss(index)) < 0.5 * start_loss
  assert agreement(index) > start_agreement + 0.1, (start_agreement, agreement(index))


@pytest.mark.parametrize("form", ["masked", pytest.param("gathered", marks=pytest.mark.slow)])
def test_sparse_stage_keeps_each_loss_on_its_own_parameters(form, monkeypatch):
  """The LM loss's gradient is zero on every indexer weight and the indexer loss's zero on every
  other weight (and not zero on the indexer's)."""
  monkeypatch.setattr(attention_kernels, "SPARSE_GATHER_ABOVE", 0 if form == "gathered" else 10**9)
  run = train_utils.Run(_indexer_config())
  params = run.init().params
  batch = next(run.data)
  model = run.assembly.objective.model  # type: ignore[attr-defined]

  def losses(params: dict, which: str) -> jax.Array:
    logits, aux = model.apply_with_aux(params, batch["inputs"], batch["inputs_position"],
                                       batch["inputs_segmentation"])
    if which == "indexer":
      return aux["indexer_kl_sum"] / aux["indexer_queries"]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1))

  for which in ("lm", "indexer"):
    grads = _leaves(jax.jit(jax.grad(sharding.unsharded()(losses)), static_argnums=1)(params, which))
    indexer = [np.abs(g).max() for p, g in grads if _is_indexer(p)]
    rest = [np.abs(g).max() for p, g in grads if not _is_indexer(p)]
    assert indexer and rest
    if which == "lm":
      assert max(indexer) == 0 and max(rest) > 0
    else:
      assert max(rest) == 0 and max(indexer) > 0


@pytest.mark.slow  # the default step itself is tests/test_golden_step.py's and the V3.2 tests'
def test_default_reports_no_indexer_loss():
  run = train_utils.Run(_config("deepseek32", ici_fsdp_parallelism=1, ici_data_parallelism=-1))
  _, history = run.train(run.init(), 1)
  assert "indexer_loss" not in history[0]


@pytest.mark.parametrize("keys, match", [
    ({"indexer_loss_scaling_factor": 0.5}, "indexer_loss_scaling_factor and indexer_warmup"),
    ({"indexer_warmup": True}, "indexer_loss_scaling_factor and indexer_warmup"),
])
def test_indexer_keys_need_an_indexer(keys, match):
  with pytest.raises(ConfigError, match=match):
    Config.for_testing(**keys)


def test_bad_indexer_key_values_are_one_line_errors():
  with pytest.raises(ConfigError, match="indexer_warmup=True trains only the indexer, by its KL loss"):
    _config("deepseek32", indexer_warmup=True)
  with pytest.raises(ConfigError, match="indexer_loss_scaling_factor must be a finite float32 number >= 0"):
    _config("deepseek32", indexer_loss_scaling_factor=-1.0)
  with pytest.raises(ConfigError, match="indexer_loss_scaling_factor must be a finite float32 number >= 0"):
    _config("deepseek32", indexer_loss_scaling_factor=float("inf"))
  # Only the language-model loss adds the KL: DPO, GRPO or distillation would compute its target and drop it
  # (checked on the model keys: those objectives' data keys are refused first on a synthetic-data config).
  from MaxText.configuration import model_checks

  values = dict(_config("deepseek32").values)
  for objective in ("dpo", "grpo", "distill", "distill_sft"):
    with pytest.raises(ConfigError, match=f"indexer_loss_scaling_factor=1 trains the lightning indexer by a KL term "
                                          f"that only objective=lm and sft add to their loss, not objective={objective}"):
      model_checks.check_mla({**values, "objective": objective, "indexer_loss_scaling_factor": 1.0})
  model_checks.check_mla({**values, "objective": "sft", "indexer_loss_scaling_factor": 1.0})
  with pytest.raises(ConfigError, match="indexer_loss_scaling_factor > 0 is not built for pipeline_schedule=1f1b"):
    _config("deepseek32", ici_fsdp_parallelism=1, ici_pipeline_parallelism=2, ici_data_parallelism=-1,
            pipeline_schedule="1f1b", indexer_loss_scaling_factor=1.0, first_dense_layers=0)


@pytest.mark.slow  # a save, a load and a step: the default suite is at its time budget
def test_warmup_starts_from_a_dense_checkpoint_without_indexers(tmp_path):
  """DeepSeek's conversion: a dense model's parameters (no indexer tensors) load into the warm-up,
  every weight from the checkpoint and the indexers freshly initialised."""
  dense = train_utils.Run(_config("deepseek32", ici_fsdp_parallelism=1, ici_data_parallelism=-1, index_topk=0))
  dense_params = jax.device_get(dense.init().params)
  params_io.save_params(str(tmp_path / "v3"), dense_params)
  warm = train_utils.Run(_indexer_config(indexer_warmup=True, load_parameters_path=str(tmp_path / "v3")))
  start = run_start.initial_state(warm.config, warm.setup, None, warm.assembly.init_state)
  assert "loaded parameters" in start.description
  loaded = _leaves(start.state.params)
  assert any(_is_indexer(p) for p, _ in loaded)
  expected = dict(_leaves(dense_params))
  others = [(p, v) for p, v in loaded if not _is_indexer(p)]
  assert len(others) == len(expected)
  for path, value in others:
    np.testing.assert_array_equal(value, expected[path], err_msg=str(path))


@pytest.mark.slow  # the save and restore are the generic checkpoint tests'; this is the warm-up's state tree
def test_warmup_state_saves_and_resumes(tmp_path):
  """The warm-up's state (its optimizer state holds the indexers' moments only) round-trips
  through a checkpoint bitwise, and the resumed state trains on."""
  config = _indexer_config(indexer_warmup=True, base_output_directory=str(tmp_path), run_name="warm",
                           enable_checkpointing=True, async_checkpointing=False)
  run = train_utils.Run(config)
  checkpoints = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  state, _ = run.train(run.init(), 1)
  checkpoints.save(1, state, run.data.get_state(), {"step": 1})
  checkpoints.wait()
  saved = jax.device_get((state.params, state.opt_state))
  checkpoints.close()
  again = train_utils.Run(config)
  reopened = checkpointing.RunCheckpoints.for_run(config.checkpoint)
  restored = reopened.restore_latest(again.setup.abstract_state, again.setup.state_shardings)
  reopened.close()
  assert restored is not None and int(restored.state.step) == 1
  got = jax.device_get((restored.state.params, restored.state.opt_state))
  assert jax.tree.structure(got) == jax.tree.structure(saved)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, history = again.train(restored.state, 1)
  assert np.isfinite(history[0]["indexer_loss"])
