"""HF → ours → logit checker, ours → HF round trips, and the converters' user errors, on the
tiny random models of tests/hf_families.py (one conversion per family, shared by the tests)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import hf_families as H
from MaxText import families, logit_checker
from MaxText import models
from MaxText.training import params_io
from MaxText.configuration import config as config_lib
from MaxText.convert import hf_io, hf_to_maxtext, maxtext_to_hf, streaming
from MaxText.errors import ConfigError, UserError
from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")


def _save_hf(model, directory: Path, **kwargs) -> Path:
  model.save_pretrained(str(directory), **kwargs)
  return directory


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """family -> (HF dir, our checkpoint), converted once per module with inferred model keys."""
  cache: dict[str, tuple[Path, Path]] = {}

  def get(family: str) -> tuple[Path, Path]:
    if family not in cache:
      root = tmp_path_factory.mktemp(family)
      hf_dir = _save_hf(H.build_hf_model(family), root / "hf")
      hf_to_maxtext.convert(str(hf_dir), str(root / "ckpt"), [])
      cache[family] = (hf_dir, root / "ckpt")
    return cache[family]
  return get


def _check(hf_dir: Path, ckpt: Path, *args: str) -> int:
  return logit_checker.main(["logit_checker", BASE, f"load_parameters_path={ckpt}", f"hf_model_path={hf_dir}",
                             *args])


def _load(path: Path, scan_layers: bool):
  config = config_lib.Config.for_testing(load_parameters_path=str(path), scan_layers=scan_layers, print_config=False)
  spec = models.build_model_spec(config.model)
  one_device = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)),
                                          jax.sharding.PartitionSpec())
  return params_io.load_params(str(path), spec.abstract_params,
                                   jax.tree.map(lambda _: one_device, spec.abstract_params))


# Checked on one device where 8 simulated devices hang: the corrupted-weight test below; their logits are
# test_families_vs_hf's, which runs on one device.
# Qwen3.5's checker cases (Qwen3-Next's layers, ~20 s each) and its MoE round trip (~14 s) run under -m slow:
# qwen3_next keeps the hybrid stack's checks in the default run, tests/test_qwen3_5.py Qwen3.5's tensor layout,
# and the dense qwen3_5 round trip (~9 s) stays in it.
SLOW_FAMILIES = {"qwen3_5", "qwen3_5_moe"}


def _family_case(family: str, slow: set[str] = SLOW_FAMILIES):
  if family in H.MESH_HANGS:
    return pytest.param(family, marks=pytest.mark.skip(reason=H.MESH_HANGS[family]))
  return pytest.param(family, marks=pytest.mark.slow) if family in slow else family


CHECKER_CASES = [_family_case(f) for f in H.FAMILIES]


@pytest.mark.parametrize("family", CHECKER_CASES)
def test_converted_checkpoint_passes_the_logit_checker_float32(family, converted, capsys):
  hf_dir, ckpt = converted(family)
  # The parity tests' tolerance (hf_families.CHECKER_FP32_ATOL); KL ~ |Δlogit|^2 / 2.
  assert _check(hf_dir, ckpt, "dtype=float32", H.checker_atol(family), "max_kl=1e-9") == 0
  out = capsys.readouterr().out
  assert "no model_name given; using the model keys saved with the checkpoint" in out
  assert "logit_checker: PASS" in out


# Every family's bf16 numerics are checked against HF in test_families_vs_hf; through the
# converted checkpoint and the checker CLI two families suffice by default.
# MoE families are left to test_families_vs_hf's flip-aware bf16 check: in a tiny random MoE,
# bf16 rounding flips near-tied expert choices (on HF's side too), an O(1) move of that token's
# logits that no fixed bound here can tell from a bug.
# Gemma 4 too: its queries are not scaled down (the QK-norm sets their size), so on random weights
# bf16 moves its tiny model's logits by ~0.3 on HF's side as on ours (test_families_vs_hf compares the two).
_DENSE = [f for f in H.FAMILIES if "experts" not in str(H.REFERENCE_CONFIGS[f]) and f != "gemma4"]


@pytest.mark.parametrize("family", [f if f in ("llama3.1", "gemma2") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in _DENSE])
def test_converted_checkpoint_passes_the_logit_checker_bfloat16(family, converted, capsys):
  """Against HF float32: bf16 rounding of weights and activations (2^-9 relative) moves logits of
  size <= 8 by up to ~0.1 and the distributions by KL ~ 1e-4 (HF's own bf16 run does the same,
  see test_families_vs_hf); 0.25 / 1e-3 stay well under what a real bug does (>= 0.3)."""
  hf_dir, ckpt = converted(family)
  assert _check(hf_dir, ckpt, "dtype=bfloat16", "atol=0.25", "max_kl=1e-3") == 0
  assert "logit_checker: PASS" in capsys.readouterr().out


@pytest.mark.slow  # a conversion and a checker run; the default run's test_shape_grids point holds the same tie rule
def test_the_checker_breaks_hfs_index_score_ties_as_we_do(tmp_path, capsys):
  """Two index heads: a quarter of DeepSeek-V3.2's index scores are exactly 0 (both ReLUs at 0) and
  tie at the top-k boundary, where torch.topk's order is unspecified; the checker has HF's indexer
  take them lowest position first, as ours does (masks.top_k_keys), so a correct conversion passes."""
  hf_dir = _save_hf(H.build_hf_model("deepseek32", index_n_heads=2, index_head_dim=16, index_topk=4), tmp_path / "hf")
  hf_to_maxtext.convert(str(hf_dir), str(tmp_path / "ckpt"), [])
  assert _check(hf_dir, tmp_path / "ckpt", "dtype=float32", H.checker_atol("deepseek32"), "max_kl=1e-9") == 0
  assert "logit_checker: PASS" in capsys.readouterr().out


def _corrupt_llama(params):
  params["layers"]["mlp"]["wo"]["kernel"][1, 3, 5] += 0.5  # one number in layer 1's MLP


def _corrupt_indexer(params):
  weights = params["layers"]["self_attention"]["indexer"]["weights_proj"]["kernel"]
  weights *= -1  # the indexer's head weights: its top-k becomes each query's lowest-scoring keys


def _corrupt_output_gate(params):
  """Qwen3.5: one number of a DeltaNet layer's output gate (HF in_proj_z, its own tensor there)."""
  gate = params["dense_layers"]["self_attention"]["output_gate"]["kernel"]
  gate[(0,) * (gate.ndim - 1) + (1,)] += 0.5


def _corrupt_decay(params):
  """Qwen3-Next: a DeltaNet layer's decay parameter (HF A_log), wherever its stack keeps it."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  a_log = next(leaf for p, leaf in leaves if "a_log" in jax.tree_util.keystr(p))
  a_log[(0,) * (a_log.ndim - 1) + (1,)] += 0.5


@pytest.mark.parametrize("family,corrupt_weights", [
    ("llama3.1", _corrupt_llama), pytest.param("deepseek32", _corrupt_indexer, marks=pytest.mark.slow),
    pytest.param("qwen3_next", _corrupt_decay, marks=pytest.mark.slow),
    pytest.param("qwen3_5", _corrupt_output_gate, marks=pytest.mark.slow),
    pytest.param("qwen3_5_moe", _corrupt_decay, marks=pytest.mark.slow)])
def test_corrupting_one_weight_makes_the_checker_fail(family, corrupt_weights, converted, tmp_path):
  hf_dir, ckpt = converted(family)
  params = jax.tree.map(np.array, _load(ckpt, scan_layers=True))
  corrupt_weights(params)
  corrupt = tmp_path / "corrupt"
  params_io.save_params(str(corrupt), params)
  shutil.copy(ckpt / config_lib.MODEL_CONFIG_FILE, corrupt / config_lib.MODEL_CONFIG_FILE)
  env = dict(os.environ)
  if family in H.MESH_HANGS:
    env["XLA_FLAGS"] = cpu_xla_flags(1)
  proc = subprocess.run(
      [sys.executable, "-m", "MaxText.logit_checker", BASE, f"load_parameters_path={corrupt}",
       f"hf_model_path={hf_dir}", "dtype=float32", "atol=2e-5", "max_kl=1e-9", "hardware=cpu"],
      cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 1, proc.stderr[-2000:]
  summary = [line for line in proc.stdout.splitlines() if line.startswith("logit_checker: FAIL")]
  assert summary and float(summary[0].split("max |Δlogit| ")[1].split()[0]) > 0.01, proc.stdout[-500:]


@pytest.mark.parametrize("family", [_family_case(f, {"qwen3_5_moe"}) for f in H.FAMILIES])
def test_round_trip_to_hf_reproduces_the_weights_exactly(family, converted, tmp_path):
  hf_dir, ckpt = converted(family)
  maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), [])
  original, exported = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  reloaded, info = H.transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "hf"), attn_implementation="eager", output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  token_ids = H.tokens()
  reference = H.transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager")
  np.testing.assert_array_equal(H.hf_logits(reloaded.eval(), token_ids), H.hf_logits(reference.eval(), token_ids))


def test_unrolled_checkpoint_exports_streaming_to_several_shards(converted, tmp_path):
  hf_dir, _ = converted("gemma2")  # unrolled: every layer's tensors are separate stored parameters
  hf_to_maxtext.convert(str(hf_dir), str(tmp_path / "unrolled"), ["scan_layers=False"])
  files = maxtext_to_hf.export(str(tmp_path / "unrolled"), str(tmp_path / "hf"), [], max_shard_mb=0.05)
  assert len(files) > 2 and (tmp_path / "hf" / hf_io.INDEX_FILE).exists()
  assert not list((tmp_path / "hf").glob("*.tmp"))
  exported = {k: v for f in files for k, v in load_file(str(tmp_path / "hf" / f)).items()}
  original = load_file(str(hf_dir / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  reloaded, info = H.transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "hf"), attn_implementation="eager", output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]


def test_maxtext_to_hf_names_parameters_that_do_not_match_the_config(converted, tmp_path):
  _, ckpt = converted("llama3.1")
  wrong_model = ["model_name=llama3.1-8b", "base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=96"]
  # The checkpoint says which model it holds: a contradicting model_name is refused before any read.
  with pytest.raises(ConfigError, match=r"model_name=llama3.1-8b contradicts the model saved in .*model_config.yml: "
                                        r"base_emb_dim=4096 \(saved: 64\)"):
    maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), wrong_model)
  # Without its model_config.yml the stored shapes are the check.
  bare = tmp_path / "bare"
  shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("model_config.yml"))
  with pytest.raises(UserError, match=r"does not match the model config in 6 parameter\(s\), e\.g\. "
                     r"layers/self_attention/key/kernel \(2, 64, 2, 16\) vs \(2, 64, 8, 128\)"):
    maxtext_to_hf.export(str(bare), str(tmp_path / "hf"), wrong_model)


def _damaged_copy(ckpt: Path, directory: Path, damage: str) -> Path:
  shutil.copytree(ckpt, directory)
  if damage == "data cut short":
    for f in (directory / "ocdbt.process_0" / "d").iterdir():
      f.write_bytes(f.read_bytes()[:100])
  else:  # the OCDBT manifest gone: Orbax reads the tree's metadata as None
    (directory / "manifest.ocdbt").unlink()
  return directory


@pytest.mark.parametrize("damage, message", [
    ("data cut short", r"cannot read token_embedder/embedding from .*; its files are damaged or incomplete"),
    ("manifest missing", r"holds no readable 'params' tree .*damaged or incomplete"),
])
def test_a_damaged_checkpoint_exports_nothing_and_is_one_line(damage, message, converted, tmp_path):
  """Not a traceback (TensorStore's ValueError, Orbax's None metadata) and no empty output directory left behind."""
  _, ckpt = converted("llama3.1")
  damaged = _damaged_copy(ckpt, tmp_path / "damaged", damage)
  with pytest.raises(UserError, match=message):
    maxtext_to_hf.export(str(damaged), str(tmp_path / "hf"), [])
  assert not (tmp_path / "hf").exists()


def test_loading_a_damaged_checkpoint_onto_devices_is_one_line(converted, tmp_path):
  """Read into jax arrays (training, generate_param_only_checkpoint), Orbax raises TensorStore's error as the
  cause of a bare Exception, which was a traceback."""
  _, ckpt = converted("llama3.1")
  damaged = _damaged_copy(ckpt, tmp_path / "damaged", "data cut short")
  with pytest.raises(UserError, match=r"cannot load parameters from .*Error reading .*; its files are damaged or "
                                      r"incomplete: copy the checkpoint again$"):
    _load(damaged, scan_layers=True)


def test_an_export_failing_midway_removes_what_it_wrote(converted, tmp_path, monkeypatch):
  """Shards written before a read error (a data file damaged deep in the checkpoint) are removed; an empty
  output directory the user made stays, empty, so the rerun's empty check passes."""
  _, ckpt = converted("llama3.1")
  read, calls = streaming.ParamReader.read, []

  def failing_read(self, path):
    calls.append(path)
    if len(calls) > 3:
      raise ValueError('FAILED_PRECONDITION: Error reading "params.x" in OCDBT database')
    return read(self, path)

  monkeypatch.setattr(streaming.ParamReader, "read", failing_read)
  (tmp_path / "hf").mkdir()
  with pytest.raises(UserError, match=r"cannot read .*its files are damaged or incomplete"):
    maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), [], max_shard_mb=0.0001)
  assert len(calls) == 4 and (tmp_path / "hf").is_dir() and not list((tmp_path / "hf").iterdir())


def test_sharded_and_bin_checkpoints_convert_to_the_same_parameters(converted, tmp_path):
  hf_dir, ckpt = converted("llama3.1")
  model = H.transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
  sharded = _save_hf(model, tmp_path / "sharded", max_shard_size="20KB")
  assert len(list(sharded.glob("*.safetensors"))) > 1
  # torch pickles (older checkpoints), in two shards, in bfloat16 (numpy has no bf16: the reader reinterprets bits)
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  shutil.copy(hf_dir / "config.json", bin_dir / "config.json")
  state = model.state_dict()
  names = sorted(state)
  for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
    H.torch.save({n: state[n].to(H.torch.bfloat16) for n in part}, bin_dir / f"pytorch_model-0000{i + 1}-of-00002.bin")
  hf_to_maxtext.convert(str(sharded), str(tmp_path / "unrolled"), ["scan_layers=False"])
  hf_to_maxtext.convert(str(bin_dir), str(tmp_path / "from_bin"), [])
  unrolled = _load(tmp_path / "unrolled", scan_layers=False)
  assert "layers_1" in unrolled
  reference = _load(ckpt, scan_layers=False)  # scanned on disk, relaid out by load_params
  jax.tree.map(np.testing.assert_array_equal, unrolled, reference)
  from_bin, scanned = _load(tmp_path / "from_bin", True), _load(ckpt, True)
  to_bf16 = lambda x: np.asarray(x).astype(H.ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), to_bf16(b)), from_bin, scanned)


def test_named_model_must_match_config_json(converted, tmp_path):
  hf_dir, _ = converted("llama3.1")
  with pytest.raises(ConfigError) as info:
    hf_to_maxtext.convert(str(hf_dir), str(tmp_path / "out"), ["model_name=llama2-7b"])
  message = str(info.value)
  assert message.startswith("model_name=llama2-7b does not match")
  assert "base_emb_dim: 4096.0 vs 64.0" in message and "rope_type: 'default' vs 'llama3'" in message
  assert "\n" not in message and not (tmp_path / "out").exists()


def test_named_model_gpt3_52k_converts_and_checks(tmp_path, capsys):
  torch = H.torch
  torch.manual_seed(0)
  config = H.transformers.GPT2Config(vocab_size=1024, n_embd=16, n_layer=1, n_head=2, n_inner=64, n_positions=2048)
  hf_dir = _save_hf(H.transformers.GPT2LMHeadModel(config).eval(), tmp_path / "hf")
  hf_to_maxtext.convert(str(hf_dir), str(tmp_path / "ckpt"), ["model_name=gpt3-52k"])
  assert _check(hf_dir, tmp_path / "ckpt", "model_name=gpt3-52k", "dtype=float32", "atol=2e-5") == 0
  assert "inferred from" not in capsys.readouterr().out


def test_training_config_reads_the_saved_model_keys(converted, capsys):
  _, ckpt = converted("gemma2")
  config = config_lib.load_config(["train", BASE, f"load_parameters_path={ckpt}"], environ={})
  assert (config.model.decoder_block, config.model.emb_dim, config.model.attn.attention_layer_pattern) == (
      "gemma2", 64, ("local", "global"))
  assert f"using the model keys saved with the checkpoint in {ckpt}" in capsys.readouterr().out
  named = config_lib.load_config(["train", BASE, f"load_parameters_path={ckpt}", "model_name=gemma2-2b"], environ={})
  assert named.model.emb_dim == 2304  # an explicit model_name wins over the saved keys


@pytest.mark.parametrize("make_args, message", [
    (lambda d, c, o: [f"hf_model_path={d}"], "missing output_path=..."),
    (lambda d, c, o: [f"hf_model_path={d}", f"output_path={c}"], "already exists"),
    (lambda d, c, o: [f"hf_model_path={o}", f"output_path={o / 'x'}"], "config.json is missing"),
    (lambda d, c, o: [f"hf_model_path={d}", f"output_path={o / 'x'}", "base_num_decoder_layers=3"],
     "base_num_decoder_layers: 3.0 vs 2.0"),
])
def test_hf_to_maxtext_user_errors(make_args, message, converted, tmp_path):
  hf_dir, ckpt = converted("mistral")
  with pytest.raises(UserError, match=message.replace("[", r"\[").replace(".", r"\.")):
    hf_to_maxtext.main(["hf_to_maxtext", *make_args(hf_dir, ckpt, tmp_path)])


def test_llama4_moe_layers_off_the_interleave_are_refused():
  """Maverick's MoE layers are every interleave_moe_layer_step-th; any other list is one line."""
  irregular = {**H.REFERENCE_CONFIGS["llama4-maverick"], "moe_layers": [0, 3]}
  with pytest.raises(ConfigError, match=r"moe_layers=\[0, 3\] with interleave_moe_layer_step=2 over 4 layers is not "
                                        r"supported: the MoE layers must be every 2-th"):
    families.family_for_hf_config(irregular).model_keys(irregular)
  keys = families.family_for_hf_config(H.REFERENCE_CONFIGS["llama4-maverick"]).model_keys(
      H.REFERENCE_CONFIGS["llama4-maverick"])
  assert keys["moe_layer_interval"] == 2 and keys["dense_mlp_dim"] == 96


def test_maxtext_to_hf_refuses_what_hf_cannot_express(converted, tmp_path):
  _, ckpt = converted("llama3.1")
  with pytest.raises(ConfigError, match=r"attention_layer_pattern=\['local'\] \(saved: \['global'\]\): contradicts"):
    maxtext_to_hf.export(str(ckpt), str(tmp_path / "hf"), ["attention_layer_pattern=[local]"])
  # A checkpoint whose saved model (same shapes) uses a pattern HF's Llama has no field for.
  local = tmp_path / "local-pattern"
  shutil.copytree(ckpt, local)
  saved = (local / "model_config.yml").read_text()
  (local / "model_config.yml").write_text(re.sub(r"attention_layer_pattern:.*\n(- .*\n)*",
                                                 "attention_layer_pattern: [local]\n", saved))
  with pytest.raises(ConfigError, match="HF llama cannot express this model.*attention_layer_pattern"):
    maxtext_to_hf.export(str(local), str(tmp_path / "hf"), [])
  with pytest.raises(UserError, match="has no model_config.yml and is not in a run directory"):
    maxtext_to_hf.export(str(tmp_path), str(tmp_path / "hf"), [])


@pytest.mark.slow
def test_train_fine_tunes_from_a_converted_checkpoint(converted, tmp_path):
  _, ckpt = converted("gemma2")
  proc = subprocess.run(
      [sys.executable, "-m", "MaxText.train", BASE, f"load_parameters_path={ckpt}", "run_name=ft", "steps=2",
       f"base_output_directory={tmp_path}", "enable_checkpointing=False", "print_config=False", "hardware=cpu",
       "max_target_length=32", "per_device_batch_size=1"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "using the model keys saved with the checkpoint" in proc.stdout
  assert f"loaded parameters from {ckpt}" in proc.stdout and "done: steps 1..2" in proc.stdout


def test_one_by_one_orbax_write_holds_about_one_parameter(tmp_path):
  # A fresh process, so only the write itself is measured; the model is 12 parameters of 16 MiB.
  probe = subprocess.run([sys.executable, str(REPO / "tests" / "convert_memory_probe.py"), str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
  assert probe.returncode == 0, probe.stderr[-2000:]
  peaks = json.loads(probe.stdout.strip().splitlines()[-1])
  assert peaks["write_mib"] < 4 * 16, peaks  # the 192 MiB model is never buffered
  assert peaks["read_mib"] < 3 * 16, peaks  # one parameter read holds about that parameter (two copies)
  params = {f"p{i}": np.memmap(tmp_path / f"p{i}.bin", dtype=np.float32, mode="r", shape=(1024, 4096))
            for i in range(12)}
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}
  restored = params_io.load_params(str(tmp_path / "ckpt"), abstract, jax.tree.map(lambda _: None, abstract))
  np.testing.assert_array_equal(np.asarray(restored["p7"]), params["p7"])


def _convert_config_json(config: dict, tmp_path: Path, message: str) -> subprocess.CompletedProcess:
  """The converter's CLI on a checkpoint of only `config`: asserts it exits 2 with one error line holding
  `message`; returns the process."""
  hf_dir, output = tmp_path / "hf", tmp_path / "out"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps(config))
  proc = subprocess.run([sys.executable, "-m", "MaxText.convert.hf_to_maxtext", f"hf_model_path={hf_dir}",
                         f"output_path={output}"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
  assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
  assert not output.exists()
  return proc


@pytest.mark.parametrize("hf_config, message", [
    (lambda: {"model_type": "llava", "text_config": {"model_type": "llama"}},
     "HF model_type 'llava' is a multimodal checkpoint (it has a text_config); only text-only models and Gemma 3's, "
     "Gemma 4's, Llama 4's and Qwen3.5's"),
    # transformers' default Llama4Config: its adapter's output (projector_output_dim) is not its projector's input.
    (lambda: H.transformers.Llama4Config().to_dict(), "do not form a runnable tower"),
    (lambda: {"model_type": "mamba", "hidden_size": 64}, "HF model_type 'mamba' has no converter; supported:"),
])
def test_an_unsupported_hf_checkpoint_is_refused_in_one_line_and_writes_nothing(hf_config, message, tmp_path):
  _convert_config_json(hf_config(), tmp_path, message)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def _legacy_gemma3_text(config: dict) -> dict:
  """config.json as the published Gemma 3 checkpoints give it: sliding_window_pattern in place of layer_types,
  rope_theta / rope_local_base_freq / rope_scaling in place of rope_parameters, and the text_config of the
  image-text ones leaves out the fields that have transformers' defaults (soft caps, query scalar, head_dim)."""
  rope = config.pop("rope_parameters")
  config.pop("layer_types")
  for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "head_dim",
              "num_key_value_heads", "use_bidirectional_attention"):
    config.pop(key, None)
  full = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
  return {**config, "sliding_window_pattern": 3, "rope_theta": rope["full_attention"]["rope_theta"],
          "rope_local_base_freq": rope["sliding_attention"]["rope_theta"], "rope_scaling": full}


def test_a_gemma3_config_in_the_published_form_reads_as_transformers_reads_it():
  """Every 3rd layer global (not Gemma 2's alternation), head_dim 256, 4 KV heads, query scalar 256, no caps:
  the model transformers builds from the same config.json."""
  fields = {**H.REFERENCE_CONFIGS["gemma3"], "head_dim": 256, "num_key_value_heads": 4, "query_pre_attn_scalar": 256}
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict()
  legacy = _legacy_gemma3_text(dict(config))
  as_hf_reads_it = H.transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"}).to_dict()
  assert as_hf_reads_it["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
  family = families.family_for_hf_config(legacy)
  assert family.model_keys(legacy) == family.model_keys(as_hf_reads_it)
  assert family.model_keys(legacy)["attention_layer_pattern"] == ["local", "local", "global"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_fields_config_json_leaves_out_take_transformers_defaults(family):
  fields = {**H.REFERENCE_CONFIGS[family], "head_dim": 256, "query_pre_attn_scalar": 256}
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  defaults = type(config)().to_dict()
  full = config.to_dict()
  trimmed = {k: v for k, v in full.items() if k == "model_type" or k not in defaults or defaults[k] != v}
  assert "query_pre_attn_scalar" not in trimmed and "head_dim" not in trimmed
  reader = families.family_for_hf_config(full)
  assert reader.model_keys(trimmed) == reader.model_keys(full)


# Fields of each tiny reference config set to transformers' default (so that the trimmed config.json leaves
# them out); Mixtral's reference gives no RoPE, so it already takes MixtralConfig's base (1e6).
_AT_TRANSFORMERS_DEFAULT = {
    "mistral": {"sliding_window": 4096},
    "mixtral": {"rms_norm_eps": 1e-5, "num_experts_per_tok": 2},
    "olmo2": {"rms_norm_eps": 1e-5},
    "olmo3": {"rms_norm_eps": 1e-5, "sliding_window": 4096},
    "gpt_oss": {"rms_norm_eps": 1e-5, "sliding_window": 128, "rope_parameters": None},  # None: GptOssConfig's YaRN
    "deepseek3": {"n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
                  "topk_group": 4, "first_k_dense_replace": 3, "q_lora_rank": 1536},
    "deepseek2-lite": {"n_shared_experts": 2, "q_lora_rank": 1536},
    "deepseek32": {"n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
                   "topk_group": 4, "q_lora_rank": 1536},
}
# DeepSeek-V3's default first_k_dense_replace (3) needs a fourth layer to leave one MoE layer (an all-dense
# DeepSeek is refused).
_LAYERS_FOR_DEFAULTS = {"deepseek3": {"num_hidden_layers": 4}}


@pytest.mark.parametrize("family", list(_AT_TRANSFORMERS_DEFAULT))
def test_fields_config_json_leaves_out_take_transformers_defaults(family):
  """As for Gemma: a field at transformers' default, left out of config.json, converts to the same model."""
  at_default = _AT_TRANSFORMERS_DEFAULT[family]
  fields = {**H.REFERENCE_CONFIGS[family], **_LAYERS_FOR_DEFAULTS.get(family, {}), **at_default}
  config = H.transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  defaults = type(config)().to_dict()
  full = config.to_dict()
  trimmed = {k: v for k, v in full.items() if k == "model_type" or k not in defaults or defaults[k] != v}
  assert not set(at_default) & set(trimmed)
  reader = families.family_for_hf_config(full)
  assert reader.model_keys(trimmed) == reader.model_keys(full)


# Each family's tiny model with num_key_value_heads and head_dim at what transformers takes when config.json leaves
# them out (its query heads set so that they fit): a fixed number where its config class has one (Mistral's 8 KV
# heads, Qwen3's head_dim 128, GPT-OSS's 8 and 64, ...), else LlamaConfig's derived ones (as many KV heads as query
# heads; hidden_size // num_attention_heads). Checked against transformers 5's configuration_*.py.
_SHAPE_AT_TRANSFORMERS_DEFAULT = {
    "llama3.1": {"num_key_value_heads": 4, "head_dim": 16},
    "mistral": {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 4},
    "mixtral": {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 4},
    "olmo2": {"num_key_value_heads": 4, "head_dim": 16},
    "olmo3": {"num_key_value_heads": 4, "head_dim": 16},
    "qwen3": {"num_attention_heads": 64, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8},
    "qwen3_next": {"num_key_value_heads": 2, "head_dim": 256},
    "qwen3_5": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "qwen3_5_moe": {"num_key_value_heads": 2, "head_dim": 256},
    "gemma": {"num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256},
    "gemma2": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "gemma3": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "gemma4": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "gpt_oss": {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64},
    "llama4": {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "deepseek2-lite": {"num_key_value_heads": 4},
    "deepseek3": {"num_attention_heads": 128, "num_key_value_heads": 128},
    "deepseek32": {"num_attention_heads": 128, "num_key_value_heads": 128},
}

# Gemma 4 at head_dim 256: unscaled queries (QK-norm sets their size) give attention logits ~4x the reference's,
# rounding to 7e-5 at one position (as tests/test_gemma4.py's converted checkpoint, 1e-4); a bug moves them >= 0.3.
_SHAPE_ATOL = {"gemma4": 1e-4}


@pytest.mark.parametrize("family", [_family_case(f) for f in _SHAPE_AT_TRANSFORMERS_DEFAULT])
def test_kv_heads_and_head_dim_config_json_leaves_out_take_transformers_defaults(family, tmp_path):
  """A config.json without num_key_value_heads / head_dim converts to the model transformers builds from it (ours
  took as many KV heads as query heads and hidden_size // num_attention_heads for every family: a conversion
  that stopped on the tensors' shapes, e.g. Mistral's 8 KV heads)."""
  shape = _SHAPE_AT_TRANSFORMERS_DEFAULT[family]
  model = H.build_hf_model(family, **shape)
  hf_dir = _save_hf(model, tmp_path / "hf")
  config = json.loads((hf_dir / "config.json").read_text())
  left_out = {"num_key_value_heads", "head_dim"} & set(shape)
  (hf_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in left_out}))
  # The model transformers builds from the trimmed config.json has the same shapes. from_config on the meta device,
  # not from_pretrained(device_map="meta"): transformers 5.2x refuses "meta" in from_pretrained's kernel setup.
  with H.torch.device("meta"):
    as_hf_reads_it = H.transformers.AutoModelForCausalLM.from_config(H.transformers.AutoConfig.from_pretrained(str(hf_dir)))
  assert {k: v.shape for k, v in as_hf_reads_it.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
  hf_to_maxtext.convert(str(hf_dir), str(tmp_path / "ckpt"), [])
  ours, params = H.converted_checkpoint(tmp_path / "ckpt")
  token_ids = H.tokens()
  np.testing.assert_allclose(H.our_logits(ours, params, token_ids), H.hf_logits(model, token_ids),
                             atol=_SHAPE_ATOL.get(family, H.CHECKER_FP32_ATOL.get(family, H.FP32_ATOL)), rtol=0)


def _without(config: dict, *path: str) -> dict:
  config = json.loads(json.dumps(config))
  inner = config
  for key in path[:-1]:
    inner = inner[key]
  del inner[path[-1]]
  return config


@pytest.mark.parametrize("hf_config, message", [
    (lambda: _without(H.REFERENCE_CONFIGS["mistral"], "hidden_size"),
     "config.json has no 'hidden_size', which a mistral config always has"),
    # The family's own spelling of the expert count (the reader falls back to the other one's).
    (lambda: _without(H.REFERENCE_CONFIGS["gpt_oss"], "num_local_experts"),
     "config.json has no 'num_local_experts', which a gpt_oss config always has"),
    (lambda: _without(H.REFERENCE_CONFIGS["qwen3_moe"], "num_experts"),
     "config.json has no 'num_experts', which a qwen3_moe config always has"),
    # An image-text config.json: the field its text_config lacks.
    (lambda: _without(H.MULTIMODAL_CONFIGS["llama4-vision"], "text_config", "hidden_size"),
     "config.json has no 'text_config.hidden_size', which a llama4 config always has"),
    # DeepseekV3Config takes 128 KV heads: no model transformers can run beside 4 query heads (was: converted as 4).
    (lambda: _without(H.REFERENCE_CONFIGS["deepseek3"], "num_key_value_heads"),
     "HF deepseek_v3 config.json leaves out num_key_value_heads, which transformers then takes as 128"),
])
def test_a_config_json_missing_a_field_is_one_line_naming_it(hf_config, message, tmp_path):
  assert "Traceback" not in _convert_config_json(hf_config(), tmp_path, message).stderr


def test_a_bidirectional_gemma3_is_refused_in_one_line():
  """EmbeddingGemma's encoder (use_bidirectional_attention) would convert to a causal model: 5 logits off."""
  config = {**H.REFERENCE_CONFIGS["gemma3"], "use_bidirectional_attention": True}
  with pytest.raises(ConfigError, match=r"^HF config use_bidirectional_attention=True is not supported by the "
                                        r"gemma3_text converter \(supported: None, False\)$"):
    families.family_for_hf_config(config).model_keys(config)


@pytest.mark.parametrize("arg, message", [
    ("atol=nan", "atol must be a number >= 0"), ("atol=-0.1", "atol must be a number >= 0"),
    ("max_kl=nan", "max_kl must be a number >= 0"), ("max_kl=-1", "max_kl must be a number >= 0"),
    ("batch_size=0", "batch_size must be >= 1"), ("sequence_length=0", "sequence_length must be >= 1"),
    ("sequence_length=-4", "sequence_length must be >= 1")])
def test_checker_tolerances_and_shapes_out_of_range_are_one_line(arg, message):
  # A nan or negative tolerance failed every comparison as a mismatch; an empty batch ended in a numpy traceback.
  with pytest.raises(UserError, match=f"^{re.escape(message)}"):
    logit_checker.split_checker_args(["hf_model_path=hf", arg])
  assert logit_checker.split_checker_args(["hf_model_path=hf", "atol=0", "max_kl=0"])[0].atol == 0


def test_checker_sequence_past_a_learned_position_table_is_one_line(converted):
  """Past its 64 positions GPT-3's table was read clamped on our side (HF's raises an index error), and the
  checker compared what no model computes; a RoPE model has no such end and runs past max_target_length."""
  hf_dir, ckpt = converted("gpt3")
  with pytest.raises(UserError, match=r"^sequence_length=65 is longer than this model's learned position table "
                                      r"\(64 positions"):
    _check(hf_dir, ckpt, "sequence_length=65", "dtype=float32", "hardware=cpu")
  hf_dir, ckpt = converted("llama3.1")
  assert _check(hf_dir, ckpt, "sequence_length=40", "max_target_length=16", "dtype=float32", "hardware=cpu") == 0
