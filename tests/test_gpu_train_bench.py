"""benchmarks/gpu_train.py runs end to end (smoke=true: a tiny model on the CPU test devices)."""

import importlib.util
import math

from tests.conftest import REPO_ROOT


def _load_bench():
  spec = importlib.util.spec_from_file_location("gpu_train", REPO_ROOT / "benchmarks" / "gpu_train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_smoke_run_prints_step_time_throughput_and_mfu(capsys):
  # cpu_peak_tflops is given so the test does not spend time measuring the matmul peak.
  _load_bench().main(["smoke=true", "steps=2", "quantization=int8", "cpu_peak_tflops=0.5"])
  out = capsys.readouterr().out
  result = next(line for line in out.splitlines() if line.startswith("RESULT "))
  fields = dict(item.split("=", 1) for item in result.split()[1:])
  step_s, tokens_per_s = float(fields["step_s"]), float(fields["tokens_per_s"])
  tflops, mfu = float(fields["tflops_per_s_per_device"]), float(fields["mfu"])
  assert step_s > 0 and tflops > 0
  batch_tokens = 8 * 64  # 8 test devices x per_device_batch_size 1 x max_target_length 64
  assert math.isclose(tokens_per_s, batch_tokens / step_s, rel_tol=1e-3)
  assert math.isclose(mfu, tflops / 0.5, rel_tol=1e-2)
  assert "TFLOP/s/device" in out and "MFU" in out
