"""benchmarks/checkpoint_bench.py runs end to end: local disk, a GCS server on loopback, the local tier."""

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.compile_settings import jax_cache_env


@pytest.mark.slow  # one ~0.9 GB state saved and restored three ways
def test_prints_a_result_line_per_target(gcs, tmp_path):
  proc = subprocess.run([sys.executable, "benchmarks/checkpoint_bench.py", "base_num_decoder_layers=1", "steps=1",
                         "gcs=true", f"dir={tmp_path / 'bench'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=900, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", **gcs.env(), **jax_cache_env()})
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  assert [r[1] for r in results] == ["target=local", "target=gcs", "target=local-tier"]
  for fields in results:
    values = dict(f.split("=") for f in fields[2:])
    assert float(values["save_gbps"]) > 0 and float(values["restore_gbps"]) > 0
