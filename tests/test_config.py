"""Config loading: precedence, type parsing, user errors, derived values."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from MaxText.platform import xla_flags
from MaxText.platform.accelerators import DeviceTarget
from MaxText.configuration.config import BASE_CONFIG_PATH, CONFIGS_DIR, Config, load_config, read_descriptions, read_yaml
from MaxText.configuration.model_checks import parameter_scales
from MaxText.errors import ConfigError

CPU8 = DeviceTarget(platform="cpu", device_kind="cpu", num_devices=8)
TPU256 = DeviceTarget(platform="tpu", device_kind="TPU v5 lite", num_devices=256)
REPO = Path(__file__).resolve().parent.parent


def load(*args: str, env: dict | None = None, target: DeviceTarget = CPU8) -> Config:
  return load_config(["train.py", str(BASE_CONFIG_PATH), *args], environ=env or {}, target=target)


def test_precedence_base_model_env_argv(tmp_path):
  assert load().model.emb_dim == 256  # cpu_defaults.yml over base.yml on CPU
  assert load(target=TPU256).model.emb_dim == 2048  # base.yml elsewhere
  assert load("cpu_defaults=False").model.emb_dim == 2048
  assert load("model_name=llama2-7b").model.emb_dim == 4096  # model YAML over cpu defaults
  assert load("model_name=llama2-7b", env={"M_BASE_EMB_DIM": "512"}).model.emb_dim == 512  # env over model
  assert load("base_emb_dim=128", env={"M_BASE_EMB_DIM": "512"}).model.emb_dim == 128  # argv over env
  child = tmp_path / "recipe.yml"
  child.write_text(f"base_config: {BASE_CONFIG_PATH}\nsteps: 7\n")
  config = load_config(["train.py", str(child)], environ={}, target=CPU8)
  assert config["steps"] == 7 and config["learning_rate"] == 3e-3


def test_a_config_file_setting_a_key_twice_is_one_line(tmp_path):
  """An upstream tuning block pasted with a placement typed twice ran with whichever came second, silently."""
  recipe = tmp_path / "recipe.yml"
  recipe.write_text("remat_policy: custom\nquery_proj: device\nsteps: 7\nquery_proj: offload\n")
  with pytest.raises(ConfigError, match=r"recipe.yml': it sets query_proj twice \(lines 2 and 4\); keep one$"):
    load_config(["train.py", str(recipe)], environ={}, target=CPU8)
  recipe.write_text("shared: &s {steps: 3}\nkeys:\n  <<: *s\n  steps: 4\n")  # a merge key may be set again
  assert read_yaml(recipe)["keys"] == {"steps": 4}


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
  """`train.py configs ...` (the folder for the file) said the folder does not exist."""
  with pytest.raises(ConfigError, match=r"^config file '.*' is a directory; name a .yml file in it$"):
    load_config(["train.py", str(tmp_path)], environ={}, target=CPU8)


def test_a_base_config_chain_that_comes_back_is_one_line(tmp_path):
  """A user's own base.yml naming `base_config: base.yml` (meaning the repo's) named itself: a RecursionError
  traceback before."""
  own = tmp_path / "base.yml"
  own.write_text("base_config: base.yml\nsteps: 3\n")
  with pytest.raises(ConfigError, match=r"^base_config goes round in a circle \('.*base.yml' -> '.*base.yml'\)"):
    load_config(["train.py", str(own)], environ={}, target=CPU8)
  (tmp_path / "a.yml").write_text("base_config: b.yml\n")
  (tmp_path / "b.yml").write_text("base_config: ./a.yml\n")
  with pytest.raises(ConfigError, match=r"a.yml' -> '.*b.yml' -> '.*a.yml'\)"):
    read_yaml(tmp_path / "a.yml")


def test_a_config_file_key_the_model_file_sets_otherwise_is_one_line(tmp_path):
  """The model file is read after the user's YAML: `base_emb_dim: 512` beside `model_name: llama2-7b` in a recipe trained
  at 4096, silently. The same value, or the key on the command line (which wins), is fine."""
  recipe = tmp_path / "recipe.yml"
  recipe.write_text(f"base_config: {BASE_CONFIG_PATH}\nmodel_name: llama2-7b\nbase_emb_dim: 512\nsteps: 3\n")
  with pytest.raises(ConfigError, match=r"recipe.yml' sets base_emb_dim: 512, which model_name=llama2-7b \(llama2-7b.yml\) "
                                        r"sets otherwise \(base_emb_dim=4096\) and wins; drop it from the file, or give "
                                        r"it on the command line, which wins over the model$"):
    load_config(["train.py", str(recipe)], environ={}, target=CPU8)
  assert load_config(["train.py", str(recipe), "base_emb_dim=512"], environ={}, target=CPU8).model.emb_dim == 512
  recipe.write_text("base_emb_dim: 4096\nsteps: 3\n")
  assert load_config(["train.py", str(recipe), "model_name=llama2-7b"], environ={}, target=CPU8).model.emb_dim == 4096


def test_types_are_coerced_to_the_default_type():
  config = load("scan_layers=false", "steps=12", "learning_rate=1e-4", "mlp_activations=gelu,linear",
                "per_device_batch_size=2", "run_name=123")
  assert config["scan_layers"] is False and config["steps"] == 12 and config["learning_rate"] == 1e-4
  assert config.model.mlp_activations == ("gelu", "linear")
  assert config["per_device_batch_size"] == 2.0 and config["run_name"] == "123"
  assert load("mlp_activations=[silu, linear]").model.mlp_activations == ("silu", "linear")
  # String keys take the text as typed: no YAML booleans or nulls.
  assert load("run_name=off")["run_name"] == "off" and load("run_name='on'")["run_name"] == "on"
  assert load("load_parameters_path=")["load_parameters_path"] == ""


@pytest.mark.parametrize("args, env, message", [
    (["embd_dim=3"], {}, "unknown config key 'embd_dim' from the command line (did you mean 'base_emb_dim'?)"),
    (["emb_dim=3"], {}, "emb_dim (the command line) is derived, not set directly: set 'base_emb_dim'"),
    ([], {"M_STEPZ": "3"}, "unknown config key 'stepz' from environment variable M_STEPZ (did you mean 'steps'?)"),
    (["per_device_batch_size=-2"], {}, "per_device_batch_size must be > 0, got -2"),
    (["steps=ten"], {}, "steps must be a whole number like its default 150001, got 'ten'"),
    (["scan_layers=maybe"], {}, "scan_layers must be a boolean (true or false)"),
    (["ici_fsdp_parallelism=3", "ici_tensor_parallelism=2"], {},
     "ici_fsdp_parallelism * ici_tensor_parallelism = 6 does not divide 8 devices per slice"),
    (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], {}, "uses only 4 of 8 devices per slice"),
    (["ici_fsdp_parallelism=-1", "ici_tensor_parallelism=-1"], {}, "at most one ici_*_parallelism may be -1"),
    # base.yml's ici_fsdp_parallelism: -1 is named: the user set only tensor's
    (["ici_tensor_parallelism=-1"], {}, "at most one ici_*_parallelism may be -1, got ici_fsdp_parallelism, "
     "ici_tensor_parallelism (ici_fsdp_parallelism is -1 in base.yml: set it to a degree, e.g. ici_fsdp_parallelism=1, "
     "for another to take the rest)"),
    (["model_name=llama9"], {}, "unknown model_name 'llama9'; known models:"),
    (["remat_policy=some"], {}, "remat_policy must be one of full, save_qkv_proj"),
    (["global_parameter_scale=3"], {}, "global_parameter_scale must be a power of two"),
    (["base_num_query_heads=3", "base_num_kv_heads=2"], {}, "must be a multiple of num_kv_heads"),
    (["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "scan_layers=False"], {},
         "pipeline parallelism needs scan_layers=True"),
    (["per_device_batch_size=0.5", "gradient_accumulation_steps=2"], {}, "must split evenly"),
    (["steps"], {}, "expected key=value, got 'steps'"),
    # Past an int32 step counter: a JAX OverflowError traceback at the first step before.
    (["steps=99999999999999999999999"], {}, "steps=99999999999999999999999 is 99999999999999999999999 optimizer "
                                            "updates, more than the 2**31 - 1"),
    (["learning_rate_schedule_steps=3000000000"], {}, "learning_rate_schedule_steps=3000000000 is 3000000000"),
    # '..' wrote the run (config.yml, checkpoints) into base_output_directory's parent; '.' into it.
    (["run_name=.."], {}, "run_name must be a directory name of its own (not '.' or '..', no control characters), got '..'"),
    (["run_name=."], {}, "run_name must be a directory name of its own"),
    (["run_name=a\tb"], {}, "no control characters), got 'a\\tb'"),
])
def test_user_errors_are_one_clear_line(args, env, message):
  with pytest.raises(ConfigError) as info:
    load(*args, env=env)
  assert message in str(info.value)
  assert "\n" not in str(info.value)


def test_config_is_immutable_and_printable():
  config = load()
  with pytest.raises(AttributeError):
    config.model = None
  with pytest.raises(dataclasses_error()):
    config.model.emb_dim = 1
  with pytest.raises(TypeError):
    config.values["steps"] = 1
  saved = yaml.safe_load(config.to_yaml())
  assert saved["steps"] == config["steps"] and saved["derived"]["emb_dim"] == 256
  assert "base_emb_dim = 256" in config.describe()


def dataclasses_error():
  import dataclasses
  return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("scale", [1, 2, 4, 8, 16, 32, 64, 128])
def test_global_parameter_scale(scale):
  base = load(target=TPU256).model
  model = load(f"global_parameter_scale={scale}", target=TPU256).model
  s = parameter_scales(scale)
  assert (model.emb_dim, model.mlp_dim, model.num_query_heads, model.num_kv_heads, model.num_decoder_layers) == (
      base.emb_dim * s["emb"], base.mlp_dim * s["mlp"], base.num_query_heads * s["heads"],
      base.num_kv_heads * s["heads"], base.num_decoder_layers * s["layers"])
  # Layer parameters (attention + MLP) grow exactly in proportion to the scale.
  def layer_params(m):
    return m.num_decoder_layers * m.emb_dim * (m.head_dim * (2 * m.num_query_heads + 2 * m.num_kv_heads) + 3 * m.mlp_dim)
  assert layer_params(model) == scale * layer_params(base)


def test_derived_batch_and_mesh():
  config = load("per_device_batch_size=2", "ici_fsdp_parallelism=-1", "ici_tensor_parallelism=2")
  assert config.data.global_batch_size == 16
  assert dict(config.mesh.shape) == {"data": 1, "stage": 1, "fsdp": 4, "fsdp_transpose": 1, "sequence": 1,
                                      "tensor": 2, "expert": 1, "autoregressive": 1}
  two_slices = DeviceTarget(platform="tpu", device_kind="TPU v5 lite", num_devices=512, num_slices=2)
  mesh = load(target=two_slices).mesh
  assert dict(mesh.dcn)["data"] == 2 and dict(mesh.ici)["fsdp"] == 256 and dict(mesh.shape)["data"] == 2
  assert load("steps=50").optim.learning_rate_schedule_steps == 50 and load("steps=50").optim.warmup_steps == 2


def test_environment_and_argv_both_set_reports_it(capsys):
  assert load("steps=9", env={"M_STEPS": "7"})["steps"] == 9
  assert "steps is set by both M_STEPS and the command line" in capsys.readouterr().out
  assert load(env={"M_STEPS": "7"})["steps"] == 7


def test_every_base_key_has_a_description():
  keys = read_yaml(BASE_CONFIG_PATH)
  descriptions = read_descriptions()
  missing = [k for k in keys if not descriptions.get(k)]
  assert not missing, f"keys without a one-line comment in base.yml: {missing}"


@pytest.mark.parametrize("path", sorted((CONFIGS_DIR / "models").glob("*.yml")), ids=lambda p: p.stem)
def test_every_model_yaml_loads(path):
  config = load(f"model_name={path.stem}", target=TPU256)
  assert config.model.emb_dim > 0


def test_xla_flags_never_clobber_user_flags():
  env = {"XLA_FLAGS": "--xla_a=1"}
  xla_flags.export_flags("--tpu_x=true", "--xla_a=2 --xla_b=3", env)
  assert env == {"XLA_FLAGS": "--xla_a=1 --xla_b=3", "LIBTPU_INIT_ARGS": "--tpu_x=true"}


def test_libtpu_compiler_flags_go_to_libtpu_not_to_xla_flags():
  """Upstream's recipes pass their TPU compiler flags in LIBTPU_INIT_ARGS: the libtpu_init_args key gets them there;
  in xla_flags jaxlib would abort the process on them (`Unknown flag in XLA_FLAGS`), so that is one error line."""
  env: dict[str, str] = {}
  xla_flags.export_flags("--xla_tpu_scoped_vmem_limit_kib=98304 --xla_enable_async_all_gather=true", "", env)
  assert env == {"LIBTPU_INIT_ARGS": "--xla_tpu_scoped_vmem_limit_kib=98304 --xla_enable_async_all_gather=true"}
  with pytest.raises(ConfigError, match=r"^xla_flags has libtpu's TPU compiler flag --xla_tpu_scoped_vmem_limit_kib="
                                        r"98304, which XLA_FLAGS aborts on; pass TPU flags in libtpu_init_args"):
    xla_flags.export_flags("", "--xla_dump_to=/tmp/d --xla_tpu_scoped_vmem_limit_kib=98304", {})


def test_jaxlibs_own_xla_tpu_flags_stay_in_xla_flags():
  """--xla_tpu_detect_nan / --xla_tpu_detect_inf are DebugOptions of jaxlib's own XLA: XLA_FLAGS takes them (the
  process starts), so xla_flags may carry them (they were refused as libtpu-only by their prefix)."""
  flags = "--xla_tpu_detect_nan=true --xla_tpu_detect_inf=true"
  env: dict[str, str] = {}
  xla_flags.export_flags("", flags, env)
  assert env == {"XLA_FLAGS": flags}
  started = subprocess.run([sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "XLA_FLAGS": flags,
                                                         "JAX_PLATFORMS": "cpu"})
  assert started.returncode == 0 and started.stdout.strip() == "2.0", started.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["embd_dim=3"], "error: unknown config key 'embd_dim'"),
    (["per_device_batch_size=-2"], "error: per_device_batch_size must be > 0, got -2"),
    (["ici_fsdp_parallelism=3", "ici_tensor_parallelism=2"], "= 6 does not divide 8 devices"),
])
def test_cli_user_errors_exit_nonzero_without_traceback(args, message, tmp_path):
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PATH": "/usr/bin:/bin"}
  proc = subprocess.run([sys.executable, "-m", "MaxText.train", "configs/base.yml", f"base_output_directory={tmp_path}",
                         *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert message in proc.stderr and "Traceback" not in proc.stderr
  assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1


def test_a_single_number_is_a_one_item_list():
  # YAML reads `prompt_token_ids=5` as the number 5; a list-typed key takes it as [5].
  assert load("prompt_token_ids=5")["prompt_token_ids"] == [5]
  assert load("prompt_token_ids=5,17")["prompt_token_ids"] == ["5", "17"]


def test_every_base_key_is_one_group_field_of_its_own_name():
  """A new key is a base.yml line plus a field named after it: nothing else lists keys."""
  from MaxText.configuration import config_fields, config_groups

  base = set(read_yaml(BASE_CONFIG_PATH))
  fields = config_fields.all_keys(config_groups.GROUPS)
  assert base - fields == set(), "base.yml keys no config group field holds"
  assert fields - base == set(), "group key fields without a base.yml key"
  config = load("model_name=llama2-7b", "ici_tensor_parallelism=2", "dataset_type=hf", "hf_path=x",
                "tokenizer_path=/tok.model")
  groups = [config.model, config.mesh, config.optim, config.data, config.run, config.checkpoint, config.decode,
            config.startup, config.rl, config.tasks, config.distill]
  auto = {"num_slices", "ici_fsdp_parallelism", "dcn_data_parallelism", "learning_rate_schedule_steps",
          "num_pipeline_microbatches", "logical_axis_rules"}  # -1 (or nested lists) resolved by the group
  seen: list[str] = []
  for group in groups:
    for name, value in config_fields.key_values(group).items():  # the model's nested records included
      seen.append(name)
      given = config[name]
      if name not in auto:
        assert value == (tuple(given) if isinstance(given, list) else given), name
  assert set(seen) == fields
  model_keys = [f.name for f in config_fields.nested_fields(type(config.model)) if f.name in fields]
  assert len(model_keys) == len(set(model_keys)), "a key held by two of the model's records"
  # A nested record's keys sit on it under their own names: config.model.moe.num_experts.
  assert config.model.moe.num_experts == config["num_experts"] and config.model.rope.rope_type == config["rope_type"]


def test_resume_and_architecture_key_lists_come_from_field_metadata():
  from MaxText.configuration import run_record
  from MaxText.configuration.model_config import ARCHITECTURE_KEYS, MODEL_KEYS

  assert "base_emb_dim" in ARCHITECTURE_KEYS and "dropout_rate" not in ARCHITECTURE_KEYS
  assert MODEL_KEYS == (*ARCHITECTURE_KEYS, "global_parameter_scale")
  fixed = run_record.FIXED_ON_RESUME
  assert fixed["model shape and function"] == MODEL_KEYS
  assert fixed["state layout"] == ("scan_layers", "weight_dtype", "lora_rank", "lora_alpha", "lora_target_modules",
                                   "distill_teacher_path", "distill_teacher_model_name", "distill_teacher_overrides",
                                   "distill_top_k_path") and fixed["optimizer state"] == ("indexer_warmup", "freeze_vision_encoder", "freeze_multimodal_projector", "opt_type")
  assert {"global_batch_size", "data_shuffle_seed", "tokenizer_path"} <= set(fixed["data position"])


def test_building_the_config_reads_no_file_and_no_clock(monkeypatch, tmp_path):
  """Validation is pure: data files and tokenizers are opened by the input pipeline, the clock
  is read once by the loader for an unnamed run."""
  import builtins
  import datetime as datetime_module
  from MaxText.configuration import config as config_lib

  values = config_lib.resolve_values(config_lib.parse_overrides(
      ["t", "dataset_type=grain", f"grain_train_files={tmp_path}/missing*.ar", "tokenizer_path=/missing.model",
       "run_name=named"], environ={}), "cpu")

  def refuse(*args, **kwargs):
    raise AssertionError(f"I/O while validating: {args}")

  class Clock(datetime_module.datetime):
    @classmethod
    def now(cls, tz=None):
      raise AssertionError("the clock was read while validating")

  monkeypatch.setattr(builtins, "open", refuse)
  monkeypatch.setattr(datetime_module, "datetime", Clock)
  config = Config(values, CPU8)
  assert config.data.grain_train_files.endswith("missing*.ar") and config.run.run_name == "named"


def test_an_unnamed_run_is_named_by_the_clock_on_one_process_only():
  config = load()
  assert config["run_name"].startswith("run_") and config.run.run_dir.endswith(config["run_name"])
  two_hosts = DeviceTarget(platform="cpu", device_kind="cpu", num_devices=8, num_processes=2)
  with pytest.raises(ConfigError, match="set run_name=NAME: with 2 processes"):
    load(target=two_hosts)
  assert load("run_name=shared", target=two_hosts).run.run_name == "shared"
