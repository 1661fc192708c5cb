"""Every test runs on CPU with 8 simulated devices; set before JAX is imported anywhere. The session
and the processes it starts share one persistent compilation cache, and compile without LLVM's optimisation
of the CPU code (tests/compile_settings.py)."""

import os
import shutil
import tempfile
import time

os.environ["JAX_PLATFORMS"] = "cpu"
from tests.compile_settings import FAST_COMPILE_FLAG  # noqa: E402  (os only: nothing initialises JAX)

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags = f"{_flags} --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:  # a level set beforehand is kept
  _flags = f"{_flags} {FAST_COMPILE_FLAG}"
os.environ["XLA_FLAGS"] = _flags.strip()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Broadcasting must be explicit (x * scale[None, None, :]): an implicit rank promotion is an error in tests.
jax.config.update("jax_numpy_rank_promotion", "raise")

_owned_cache_dir: str | None = None


def pytest_configure(config):
  """Points JAX's persistent compilation cache at a directory of this session's own, here and (through the
  environment) in every process a test starts, and caches every program: the tiny test models compile in
  well under JAX's 1 s threshold. A JAX_COMPILATION_CACHE_DIR set beforehand is kept ('' turns it off)."""
  global _owned_cache_dir
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _owned_cache_dir = tempfile.mkdtemp(prefix="maxtext-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _owned_cache_dir
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"] or None)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
  # Tests that call run_cli catch its SystemExit: pytest's own exit status stands, not the last such test's.
  from MaxText import errors  # noqa: PLC0415

  errors.forget_exit_status()
  if _owned_cache_dir is not None:
    shutil.rmtree(_owned_cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """MAXTEXT_REVERSE_MODULES=1 (.ci/run, every other run of the slow stage, whose last modules the deadline
  skips): the modules in reverse order, so two runs cover them all. Each module's tests keep their order."""
  if os.environ.get("MAXTEXT_REVERSE_MODULES") != "1":
    return
  modules: dict[str, list] = {}
  for item in items:
    modules.setdefault(item.nodeid.split("::")[0], []).append(item)
  items[:] = [item for module in reversed(list(modules)) for item in modules[module]]


def _minutes_needed(item) -> float:
  """The most a test may take, for the CI deadline: a docs command half its time limit, another slow test 6
  minutes, the rest 1."""
  block = getattr(getattr(item, "callspec", None), "params", {}).get("block")
  if block is not None and hasattr(block, "timeout_s"):
    return block.timeout_s / 120
  return 6.0 if item.get_closest_marker("slow") else 1.0


def pytest_runtest_setup(item):
  """.ci/run sets MAXTEXT_CI_DEADLINE (epoch seconds): a test that might not end before it is skipped, saying
  so, rather than the whole run being stopped at CI's 90 minutes."""
  deadline = os.environ.get("MAXTEXT_CI_DEADLINE")
  if not deadline:
    return
  left_s, need = float(deadline) - time.time(), _minutes_needed(item)
  if left_s < need * 60:
    pytest.skip(f"CI budget: {max(left_s, 0) / 60:.1f} minutes left before MAXTEXT_CI_DEADLINE, this test may take "
                f"{need:.0f}")


REPO_ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture
def tiny_overrides() -> dict:
  """A model small enough that a train step compiles and runs in about a second."""
  return dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
              base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
              print_config=False)


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """One GCS emulator on 127.0.0.1 for the session; this process talks to it too."""
  from tests.gcs_emulator import GcsServer, binary

  if binary() is None:
    pytest.skip("fake-gcs-server is not installed for this platform (EXTRAS=test bash setup.sh installs it)")

  server = GcsServer(tmp_path_factory.mktemp("gcs") / "data")
  server.start()
  previous = {k: os.environ.get(k) for k in _CLOUD_ENV}
  os.environ.update(server.env())
  from MaxText.paths import cloud_env

  cloud_env.configure_cloud_env()
  yield server
  for key, value in previous.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  server.stop()


# What configure_cloud_env may set; restored after the session.
_CLOUD_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
              "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


@pytest.fixture
def gcs_bucket(gcs) -> str:
  """A fresh, empty bucket: 'gs://<name>'."""
  return f"gs://{gcs.create_bucket()}"
