"""Every shipped recipe: its dry run prints a command whose keys and mesh load for the recipe's
hardware, its flags are accepted, and (slow) the TPU recipes compile for their real topology
and fit in HBM."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.platform import accelerators
from MaxText.platform.accelerators import DeviceTarget
from MaxText.configuration.config import load_config

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.relative_to(REPO) for p in REPO.glob("configs/*/*.sh"))
TPU_RECIPES = [r for r in RECIPES if r.parts[1] in ("v5e", "v5p", "long_context")]
# What each GPU recipe is for: one H100, or one node of eight.
GPU_TARGETS = {"llama2-7b-1gpu.sh": 1, "llama2-7b-8gpu.sh": 8}


def recipe(path: Path, *args: str, env: dict | None = None, timeout: int = 60) -> subprocess.CompletedProcess:
  clean = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS", "JOBSET_NAME")}
  return subprocess.run(["bash", str(REPO / path), *args], cwd=REPO, env={**clean, **(env or {})},
                        capture_output=True, text=True, timeout=timeout)


def dry_run(path: Path, *args: str, env: dict | None = None) -> tuple[dict[str, str], list[str]]:
  """(environment assignments, python argv) of the command the recipe would run."""
  result = recipe(path, "DRY_RUN=1", *args, env=env)
  assert result.returncode == 0, result.stderr
  _, _, command = result.stdout.strip().partition(" && ")
  words = shlex.split(command)
  assert words[0] == "env"
  first_python = words.index("python3")
  assignments = dict(w.split("=", 1) for w in words[1:first_python])
  return assignments, words[first_python:]


def recipe_topology(path: Path) -> str:
  return re.search(r"^RECIPE_TOPOLOGY=(\S+)", (REPO / path).read_text(), re.M).group(1)


def test_every_hardware_family_has_recipes():
  families = {r.parts[1] for r in RECIPES}
  assert {"v5e", "v5p", "largest_job", "gpu"} <= families
  assert {r.name for r in RECIPES if r.parts[1] == "v5e"} == {"16b.sh", "32b.sh", "64b.sh", "128b.sh"}
  assert {r.name for r in RECIPES if r.parts[1] == "largest_job"} == {"16b.sh", "32b.sh", "64b.sh", "128b.sh"}


@pytest.mark.parametrize("path", RECIPES, ids=str)
def test_recipe_dry_run_loads_for_its_hardware(path):
  env, command = dry_run(path, "RUN_NAME=recipe_test", "OUTPUT_PATH=/tmp/recipe_outputs")
  assert command[:4] == ["python3", "-m", "MaxText.train", "configs/base.yml"]
  assert "run_name=recipe_test" in command and "base_output_directory=/tmp/recipe_outputs" in command
  topology = recipe_topology(path)
  if topology == "gpu":
    assert env["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=true")
    target = DeviceTarget("gpu", "NVIDIA H100 80GB HBM3", GPU_TARGETS[path.name])
  else:
    assert "--xla_tpu_enable_async_collective_fusion=true" in env["LIBTPU_INIT_ARGS"]
    target = accelerators.tpu_topology(topology).target()
  config = load_config(["train"] + command[3:], environ={}, target=target)  # unknown keys/impossible meshes raise
  if path.parts[1] == "long_context":  # 128k tokens, the sequence split over `sequence` and balanced
    assert config.data.max_target_length == 131072 and config.model.attn.context_parallel_degree > 1
    assert config.model.attn.context_parallel_load_balance and config.model.rope.rope_type == "llama3"
  else:
    assert config.data.max_target_length in (2048, 4096)
  assert config["enable_checkpointing"] is False and config["dataset_type"] == "synthetic"


def test_v5e_recipes_reproduce_the_published_settings():
  expected = {"16b.sh": (16, 6.0, "full"), "32b.sh": (32, 4.0, "full"), "64b.sh": (64, 2.0, "full"),
              "128b.sh": (128, 1.0, "minimal_offloaded")}
  for name, (scale, batch, remat) in expected.items():
    _, command = dry_run(Path("configs/v5e") / name, "RUN_NAME=r")
    config = load_config(["train"] + command[3:], environ={}, target=accelerators.tpu_topology("v5e-256").target())
    assert (config["global_parameter_scale"], config["per_device_batch_size"], config.model.remat_policy) == \
        (scale, batch, remat), name
  config = load_config(["train"] + dry_run(Path("configs/v5e/128b.sh"), "RUN_NAME=r")[1][3:], environ={},
                       target=accelerators.tpu_topology("v5e-256").target(num_slices=2))
  assert dict(config.mesh.shape)["fsdp"] == 16 and dict(config.mesh.shape)["tensor"] == 16
  assert dict(config.mesh.shape)["data"] == 2  # one more slice = data parallelism over DCN


def test_aot_mode_targets_the_recipe_topology():
  _, command = dry_run(Path("configs/v5p/128b.sh"), "EXECUTABLE=train_compile", "NUM_SLICES=2")
  assert command[2] == "MaxText.train_compile"
  assert "compile_topology=v5p-256" in command and "compile_topology_num_slices=2" in command


def test_user_flags_and_overrides_come_last():
  env, command = dry_run(Path("configs/v5e/16b.sh"), "RUN_NAME=r", "steps=3",
                         env={"LIBTPU_INIT_ARGS": "--xla_tpu_overlap_compute_collective_tc=false"})
  assert env["LIBTPU_INIT_ARGS"].endswith(" --xla_tpu_overlap_compute_collective_tc=false")
  assert command[-1] == "steps=3"


def test_gke_takes_the_run_name_from_the_jobset():
  _, command = dry_run(Path("configs/largest_job/64b.sh"), env={"JOBSET_NAME": "my-workload"})
  assert "run_name=my-workload" in command
  env, _ = dry_run(Path("configs/largest_job/64b.sh"), "RUN_NAME=r")
  assert env["GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS"] == "1"


@pytest.mark.parametrize("args, message", [
    (["RUN_NAME=r", "PLATFORM=aws"], "PLATFORM must be gce or gke, got 'aws'"),
    ([], "RUN_NAME=... is required"),
    (["RUN_NAME=r", "EXECUTABLE=decode"], "EXECUTABLE must be train or train_compile"),
    (["RUN_NAME=r", "NUM_SLICES=two"], "NUM_SLICES must be a positive integer"),
    (["RUN_NAME=r", "Steps=3"], "unexpected argument 'Steps=3'"),
])
def test_bad_recipe_arguments_are_one_line_errors(args, message):
  result = recipe(Path("configs/v5e/32b.sh"), "DRY_RUN=1", *args)
  assert result.returncode == 2 and message in result.stderr and result.stdout == ""


def test_dataset_path_is_passed_on_and_the_override_switches_to_real_data():
  result = recipe(Path("configs/v5e/32b.sh"), "DRY_RUN=1", "RUN_NAME=r", "DATASET_PATH=gs://bucket/data",
                  "dataset_type=tfds", "dataset_name=c4/en:3.1.0")
  assert result.returncode == 0 and result.stderr == ""
  words = result.stdout.split()
  assert "dataset_path=gs://bucket/data" in words
  # The user's dataset_type comes after the recipe's synthetic one, so it wins (last value).
  assert words.index("dataset_type=tfds") > words.index("dataset_type=synthetic")


@pytest.mark.parametrize("path", [r for r in RECIPES if r.parts[1] == "gpu"], ids=str)
def test_gpu_recipe_flags_exist_in_this_jaxlib(path):
  """XLA aborts on flags it does not know; XLA_FLAGS is parsed the same way on every backend."""
  env, _ = dry_run(path, "RUN_NAME=r")
  result = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"],
                          env={**os.environ, "XLA_FLAGS": env["XLA_FLAGS"], "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("path", TPU_RECIPES, ids=str)
def test_tpu_recipe_compiles_for_its_topology_and_fits(path):
  result = recipe(path, "EXECUTABLE=train_compile", "print_config=false", timeout=3600)
  print(result.stdout)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "fits:" in result.stdout
