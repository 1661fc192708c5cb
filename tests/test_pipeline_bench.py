"""benchmarks/pipeline_bench.py runs end to end on the 8 CPU test devices with a tiny model."""

import importlib.util

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.slow  # ~30 s: four schedules compiled
def test_prints_one_row_per_schedule(capsys):
  spec = importlib.util.spec_from_file_location("pipeline_bench", REPO_ROOT / "benchmarks" / "pipeline_bench.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.main(["ici_pipeline_parallelism=2", "num_pipeline_microbatches=4", "base_num_decoder_layers=4",
               "base_emb_dim=32", "max_target_length=16", "per_device_batch_size=2", "steps=1"])
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "MiB" in line]
  assert [row.split(" | ")[0] for row in rows] == ["| gpipe", "| circular", "| 1f1b", "| interleaved 1f1b"]
  # 2 stages, 4 microbatches: GPipe's bubble 1/5, two passes 1/9; 1F1B keeps min(4, 3) and 5 (interleaved) inputs.
  assert [row.split(" | ")[2] for row in rows] == ["0.200", "0.111", "0.200", "0.111"]
  assert [row.split(" | ")[3] for row in rows][2:] == ["3", "5"]
