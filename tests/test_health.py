"""The straggler report: the process that waits longest for its input is named, in the log and in
the metrics; an even run names nobody. Unit-tested with a stand-in for the cross-process gather,
and for real with two processes on loopback, one of them slowed on purpose through a test hook."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from MaxText.health import StragglerHook
from MaxText.trainer import StepRecord
from tests.conftest import REPO_ROOT


class _FakeProcesses:
  """Stands in for the all-gather: this process's values plus fixed ones for the others."""

  def __init__(self, others: list[tuple[float, float]]):
    self.others = others

  def __call__(self, mine: np.ndarray) -> np.ndarray:
    return np.asarray([mine, *self.others])


def _records(hook: StragglerHook, steps: int, seconds: float, wait: float) -> None:
  for step in range(1, steps + 1):
    hook.on_step(None, StepRecord(step, seconds, {"input_wait_s": wait}), None)  # type: ignore[arg-type]


def test_the_process_waiting_longest_for_input_is_named(capsys):
  hook = StragglerHook(4, 0.2, None, True, gather=_FakeProcesses([(1.0, 0.02), (1.0, 0.6), (1.0, 0.03)]))
  _records(hook, 8, seconds=1.0, wait=0.01)
  assert hook.reported == [(4, [2]), (8, [2])]
  err = capsys.readouterr().err
  assert "warning: stragglers over steps 1..4: process 2 (input wait 0.600 s a step); the median process waits" in err


def test_an_even_run_names_nobody(capsys):
  hook = StragglerHook(5, 0.2, None, True, gather=_FakeProcesses([(1.0, 0.05), (1.0, 0.1)]))
  _records(hook, 5, seconds=1.0, wait=0.01)
  assert hook.reported == [(5, [])] and "straggler" not in capsys.readouterr().err


SLOW_PROCESS_1 = textwrap.dedent("""
    # Test hook, loaded by Python at start-up (sitecustomize): process 1's batches take 0.3 s
    # longer to arrive, as on a host with a slow input pipeline.
    import os, time
    if os.environ.get("JAX_PROCESS_ID") == "1":
      from MaxText.input_pipeline import pipeline
      _next = pipeline.PackedBatchIterator.__next__
      def _slow_next(self):
        time.sleep(0.3)
        return _next(self)
      pipeline.PackedBatchIterator.__next__ = _slow_next
""")


@pytest.mark.slow  # two train.py processes
def test_two_processes_name_the_one_slowed_on_purpose(tmp_path):
  import socket

  sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
  from sft_fixtures import WORDS, write_tokenizer

  hooks = tmp_path / "hooks"
  hooks.mkdir()
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) + "\n" for i in range(len(WORDS))))
  (hooks / "sitecustomize.py").write_text(SLOW_PROCESS_1)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=slow", f"base_output_directory={tmp_path}",
             "base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
             "print_config=False", "cpu_peak_tflops=0.1", "steps=8", "enable_checkpointing=False",
             "straggler_report_period=4", "dcn_data_parallelism=2", "distributed_init_timeout_seconds=120",
             # Host-local batches: a synthetic batch is generated on the devices, which ties the processes together.
             "dataset_type=hf", f"hf_data_files={data}", "tokenizer_type=huggingface",
             f"tokenizer_path={write_tokenizer(tmp_path / 'tokenizer', None)}", "vocab_size=320",
             "data_prefetch_batches=0"]
  procs = []
  for i in range(2):
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PATH": "/usr/bin:/bin",
           "HOME": str(Path.home()), "PYTHONPATH": f"{hooks}:{REPO_ROOT}", "JAX_COORDINATOR_ADDRESS": address,
           "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": str(i)}
    procs.append(subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
  outs = [p.communicate(timeout=600) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  assert "warning: stragglers over steps 5..8: process 1 (input wait" in outs[0][1], outs[0][1][-3000:]
  records = [json.loads(line) for line in (tmp_path / "slow" / "metrics.jsonl").read_text().splitlines()]
  report = [r for r in records if "stragglers" in r and r["step"] == 8]
  assert report and report[0]["stragglers"] == 1 and report[0]["input_wait_s/process_1"] > 0.25, report
