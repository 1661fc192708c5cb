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

from MaxText.training.health import StragglerHook
from MaxText.training.trainer import StepRecord
from tests.conftest import REPO_ROOT
from tests.compile_settings import cpu_xla_flags, jax_cache_env


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
  hooks = tmp_path / "hooks"
  hooks.mkdir()
  (hooks / "sitecustomize.py").write_text(SLOW_PROCESS_1)
  procs = _two_processes(tmp_path, hooks, "steps=8", "enable_checkpointing=False", "straggler_report_period=4")
  outs = [p.communicate(timeout=600) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  assert "warning: stragglers over steps 5..8: process 1 (input wait" in outs[0][1], outs[0][1][-3000:]
  records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
  report = [r for r in records if "stragglers" in r and r["step"] == 8]
  assert report and report[0]["stragglers"] == 1 and report[0]["input_wait_s/process_1"] > 0.25, report


def test_goodput_counts_each_step_once_and_names_what_was_lost():
  from MaxText.training.health import StartRecord, summarize

  killed = StartRecord(started=0.0, wall_s=100.0, startup_s=20.0, compile_s=10.0, data_wait_s=2.0, first_step=1,
                       last_step=14, median_step_s=4.0)
  resumed = StartRecord(started=200.0, wall_s=80.0, startup_s=15.0, compile_s=8.0, data_wait_s=1.0, first_step=11,
                        last_step=20, median_step_s=5.0)
  t = summarize([killed, resumed])
  # Steps 11..14 ran twice: the first start's copies (4 x 4 s) are lost; the rest is productive.
  assert t["redone_s"] == 16.0 and t["productive_s"] == 10 * 4.0 + 10 * 5.0
  assert (t["startup_s"], t["compile_s"], t["data_wait_s"]) == (35.0, 18.0, 3.0)
  assert t["other_s"] == 180.0 - (90.0 + 35.0 + 18.0 + 3.0 + 16.0) and t["goodput"] == 90.0 / 180.0
  assert "resize_s" not in t  # no elastic resize: the summary and the line are as before


@pytest.mark.parametrize("damage", [b'{"starts": [{"started": 1.0, ', b"\xff\xfe", b"[]", b'{"starts": [1]}'])
def test_an_unreadable_goodput_file_is_one_warning_not_the_end_of_the_run(tmp_path, capsys, damage):
  """A goodput.json cut short by a copy or edited by hand stopped the resumed run with a traceback."""
  from MaxText.training.health import GoodputHook

  (tmp_path / "goodput.json").write_bytes(damage)
  assert GoodputHook(str(tmp_path), process_started=0.0, start_step=4, writer=None).earlier == []
  assert f"warning: {tmp_path / 'goodput.json'} is unreadable (" in capsys.readouterr().out


def test_goodput_counts_an_elastic_resize_from_its_detection_to_the_first_new_step():
  from MaxText.training.health import StartRecord, _resizes, summarize

  # A slice is lost at t=95 (the run had logged its last step at t=90 and was killed); the survivors'
  # processes start at t=110 and take 15 s to start up and 8 s to compile.
  killed = StartRecord(started=0.0, wall_s=90.0, startup_s=20.0, compile_s=10.0, data_wait_s=2.0, first_step=1,
                       last_step=14, median_step_s=4.0)
  shrunk = StartRecord(started=110.0, wall_s=80.0, startup_s=15.0, compile_s=8.0, data_wait_s=1.0, first_step=15,
                       last_step=24, median_step_s=5.0, resize_detected=95.0)
  t = summarize([killed, shrunk])
  # 15 s between the detection and the new processes (outside both starts' wall time) + 15 + 8.
  assert (t["resize_s"], t["resizes"]) == (38.0, 1.0)
  assert (t["startup_s"], t["compile_s"], t["wall_s"]) == (20.0, 10.0, 185.0)
  assert t["other_s"] == 185.0 - (14 * 4.0 + 10 * 5.0 + 20.0 + 10.0 + 3.0 + 38.0)
  assert _resizes(t) == "elastic resizes 38 s (1), "
  # A grow-back: the old start saved and stopped for 6 s after the SIGTERM, inside its own wall time.
  stopped = StartRecord(started=0.0, wall_s=101.0, startup_s=20.0, compile_s=10.0, data_wait_s=0.0, first_step=1,
                        last_step=14, median_step_s=4.0)
  grown = StartRecord(started=104.0, wall_s=50.0, startup_s=10.0, compile_s=5.0, data_wait_s=0.0, first_step=15,
                      last_step=20, median_step_s=4.0, resize_detected=95.0)
  t = summarize([stopped, grown])
  assert (t["resize_s"], t["wall_s"]) == (6.0 + 3.0 + 10.0 + 5.0, 154.0)


SLOW_STEPS = textwrap.dedent("""
    # Test hook (sitecustomize): every batch takes 0.1 s longer, so the test can kill the run
    # between two known steps.
    import time
    from MaxText.input_pipeline import synthetic
    _next = synthetic.SyntheticIterator.__next__
    def _slow_next(self):
      time.sleep(0.1)
      return _next(self)
    synthetic.SyntheticIterator.__next__ = _slow_next
""")


def _train(tmp_path: Path, hooks: Path | None, *extra: str) -> subprocess.Popen:
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=gp", f"base_output_directory={tmp_path}",
             "base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
             "print_config=False", "cpu_peak_tflops=0.1", "steps=40", "checkpoint_period=15",
             "async_checkpointing=False", *extra]
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
         "HOME": str(Path.home()), "PYTHONPATH": f"{hooks}:{REPO_ROOT}" if hooks else str(REPO_ROOT),
         **jax_cache_env()}
  return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # three train.py processes
def test_goodput_across_a_kill_and_a_resume(tmp_path):
  import signal
  import time

  hooks = tmp_path / "hooks"
  hooks.mkdir()
  (hooks / "sitecustomize.py").write_text(SLOW_STEPS)
  record = tmp_path / "gp" / "goodput.json"
  proc = _train(tmp_path, hooks)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:  # killed after the record of step 20
    if record.exists() and json.loads(record.read_text())["starts"][-1]["last_step"] >= 20:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
  out, err = _train(tmp_path, None).communicate(timeout=600)
  assert "resumed from step 15" in out, err[-2000:]
  starts = json.loads(record.read_text())["starts"]
  assert [(s["first_step"], s["last_step"]) for s in starts] == [(1, 20), (16, 40)], starts
  line = next(l for l in out.splitlines() if l.startswith("goodput: "))
  assert " over 2 start(s): " in line, line
  records = [json.loads(line) for line in (tmp_path / "gp" / "metrics.jsonl").read_text().splitlines()]
  # One record per step, nothing else: `[json.loads(l)["loss"] for l in f]` works on it.
  assert [r["step"] for r in records] == list(range(1, 41)) and all("loss" in r for r in records)
  summary = json.loads(record.read_text())["summary"]
  # Steps 16..20 ran twice; both start-ups and compilations are lost time.
  assert summary["redone_s"] == pytest.approx(5 * starts[0]["median_step_s"])
  assert summary["startup_s"] == pytest.approx(starts[0]["startup_s"] + starts[1]["startup_s"])
  assert starts[1]["startup_s"] > 1 and summary["compile_s"] > 0


@pytest.mark.slow  # a train.py process
def test_an_uninterrupted_run_counts_nearly_all_of_its_step_time_as_productive(tmp_path):
  out, err = _train(tmp_path, None, "steps=30", "enable_checkpointing=False").communicate(timeout=600)
  assert "goodput: " in out, err[-2000:]
  (start,) = json.loads((tmp_path / "gp" / "goodput.json").read_text())["starts"]
  step_time = start["wall_s"] - start["startup_s"] - start["compile_s"] - start["data_wait_s"]
  # Productive = 30 typical steps; what else the loop did (logging, metric files) is the rest.
  assert 30 * start["median_step_s"] > 0.7 * step_time, start


def test_the_watchdog_fires_when_no_step_finishes_in_time(capsys):
  import time

  from MaxText.training.health import StepWatchdog

  exits: list[int] = []
  watchdog = StepWatchdog(0.5, exit=exits.append)
  for step in range(1, 4):
    assert watchdog.due(step)
    watchdog.on_step(None, StepRecord(step, 0.1, {}), None)  # type: ignore[arg-type]
    time.sleep(0.1)
  assert not exits  # steps keep finishing within the timeout
  time.sleep(1.5)
  assert exits == [StepWatchdog.EXIT_CODE]
  err = capsys.readouterr().err
  assert "error: no step finished in step_timeout_seconds=0.5 after step 3 on this process; every process " \
         "started step 3, and it did not finish; Python stacks above" in err and "thread step-watchdog" in err


HANG_IN_STEP_5 = textwrap.dedent("""
    # Test hook (sitecustomize): process 1 stops inside its 5th batch, as a stuck host would.
    import os, time
    if os.environ.get("JAX_PROCESS_ID") == "1":
      from MaxText.input_pipeline import pipeline
      _next, _calls = pipeline.PackedBatchIterator.__next__, [0]
      def _stuck_next(self):
        _calls[0] += 1
        if _calls[0] == 5:
          time.sleep(600)
        return _next(self)
      pipeline.PackedBatchIterator.__next__ = _stuck_next
      # Its watchdog also fires later than process 0's, which hosts the coordination service: process 0
      # must not exit before the others have named the hang (their clients would abort, status -6).
      from MaxText.training import health
      _print_stacks = health._print_stacks
      def _slow_print_stacks():
        time.sleep(5)
        _print_stacks()
      health._print_stacks = _slow_print_stacks
""")


def _two_processes(tmp_path: Path, hooks: Path | None, *extra: str) -> list[subprocess.Popen]:
  import socket

  sys.path.insert(0, str(Path(__file__).parent / "input_pipeline"))
  from sft_fixtures import WORDS, write_tokenizer

  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) + "\n" for i in range(len(WORDS))))
  tokenizer = tmp_path / "tokenizer"
  if not tokenizer.exists():
    write_tokenizer(tokenizer, None)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  command = [sys.executable, "-m", "MaxText.train", "configs/base.yml", "run_name=two", f"base_output_directory={tmp_path}",
             "base_emb_dim=64", "base_num_decoder_layers=1", "base_mlp_dim=128", "head_dim=16", "max_target_length=32",
             "print_config=False", "cpu_peak_tflops=0.1", "dcn_data_parallelism=2", "distributed_init_timeout_seconds=120",
             # Host-local batches: a synthetic batch is generated on the devices, which ties the processes together.
             "dataset_type=hf", f"hf_data_files={data}", "tokenizer_type=huggingface", f"tokenizer_path={tokenizer}",
             "vocab_size=320", "data_prefetch_batches=0", *extra]
  procs = []
  for i in range(2):
    path = f"{hooks}:{REPO_ROOT}" if hooks else str(REPO_ROOT)
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(2), "PATH": "/usr/bin:/bin",
           "HOME": str(Path.home()), "PYTHONPATH": path, "JAX_COORDINATOR_ADDRESS": address,
           "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": str(i), **jax_cache_env()}
    procs.append(subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
  return procs


@pytest.mark.slow  # two train.py processes, twice
def test_a_hung_process_is_named_both_exit_and_a_relaunch_resumes(tmp_path):
  import time

  hooks = tmp_path / "hooks"
  hooks.mkdir()
  (hooks / "sitecustomize.py").write_text(HANG_IN_STEP_5)
  started = time.time()
  procs = _two_processes(tmp_path, hooks, "steps=8", "checkpoint_period=2", "async_checkpointing=False",
                         "step_timeout_seconds=20")
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [4, 4], [o[1][-2000:] for o in outs]
  assert time.time() - started < 200  # the hang did not last its 600 s
  # Process 1 is stuck fetching batch 5; process 0 started step 5 and waits for it inside the step.
  assert "process(es) 1 did not reach step 5 (process 1 started step 4 last)" in outs[0][1], outs[0][1][-3000:]
  relaunched = _two_processes(tmp_path, None, "steps=8", "checkpoint_period=2", "async_checkpointing=False")
  outs = [p.communicate(timeout=300) for p in relaunched]
  assert [p.returncode for p in relaunched] == [0, 0], [o[1][-2000:] for o in outs]
  assert "state: resumed from step 4" in outs[0][0], outs[0][0][-2000:]  # step 4 was saved before the hang


LAST_SAVE_HANGS = textwrap.dedent("""
    # Test hook (sitecustomize): the write of checkpoint step 4 stops before Orbax renames its temporary
    # folder into the step, as on a local disk or NFS mount that stopped answering (for 90 s here).
    import asyncio
    from orbax.checkpoint._src.path import atomicity
    _finalize = atomicity.AtomicRenameTemporaryPath.finalize
    async def _stuck_finalize(self):
      if self.get_final().name == "4":
        await asyncio.sleep(90)
      return await _finalize(self)
    atomicity.AtomicRenameTemporaryPath.finalize = _stuck_finalize
""")


@pytest.mark.slow  # two train.py processes, one after the other
def test_a_hang_in_the_last_checkpoint_save_exits_4_and_the_relaunch_resumes_from_the_previous_step(tmp_path):
  """The watchdog had ended before the checkpoint hook's end waited for the last async save: a save that hung
  there hung the process (for good on a local disk: nothing else bounds it), with no stacks and no exit 4."""
  import time

  hooks = tmp_path / "hooks"
  hooks.mkdir()
  (hooks / "sitecustomize.py").write_text(LAST_SAVE_HANGS)
  keys = ("steps=4", "checkpoint_period=2", "async_checkpointing=True")
  started = time.time()
  first = _train(tmp_path, hooks, *keys, "step_timeout_seconds=20")
  out, err = first.communicate(timeout=600)
  assert first.returncode == 4, (out[-1000:], err[-3000:])
  assert "error: the final checkpoint save at step 4 did not finish in step_timeout_seconds=20; Python stacks " \
         "above. Exiting with status 4" in err, (out[-1000:], err[-3000:])
  assert time.time() - started < 85  # well before the hang would have ended
  left = sorted(p.name for p in (tmp_path / "gp" / "checkpoints").iterdir())
  assert left[0] == "2" and len(left) == 2 and left[1].startswith("4.orbax-checkpoint-tmp"), left  # cut mid-way
  relaunched = _train(tmp_path, None, *keys)
  out, err = relaunched.communicate(timeout=600)
  assert relaunched.returncode == 0, err[-2000:]
  assert "state: resumed from step 2" in out, out[-2000:]  # the unfinished step 4 is not taken
  assert "4" in [p.name for p in (tmp_path / "gp" / "checkpoints").iterdir()]


@pytest.mark.parametrize("value", [10**12, -1])
def test_a_step_timeout_beyond_what_a_thread_can_wait_is_a_config_error(value):
  """A value past threading.TIMEOUT_MAX (10**12 for "never") was taken: the watchdog thread's first wait raised
  OverflowError and the run went on unwatched."""
  import threading

  from MaxText.configuration.config import Config
  from MaxText.errors import ConfigError

  with pytest.raises(ConfigError) as error:
    Config.for_testing(step_timeout_seconds=value)
  assert str(error.value) == (f"step_timeout_seconds must be >= 0 (0 = off) and at most {threading.TIMEOUT_MAX:.0f}, "
                              f"got {float(value)}")  # a number of seconds, fractions allowed


@pytest.mark.parametrize("name", ["run_lease_timeout_seconds", "stack_trace_interval_seconds",
                                  "storage_timeout_seconds", "storage_retry_seconds"])
def test_a_wait_beyond_what_a_thread_can_wait_is_a_config_error(name):
  """10**13 ("never") was taken: the lease's refresh thread (a sixth of it) and the stack-trace thread died with
  OverflowError at their first wait, and a storage call's bounded wait raised it."""
  import threading

  from MaxText.configuration.config import Config
  from MaxText.errors import ConfigError

  with pytest.raises(ConfigError) as error:
    Config.for_testing(**{name: 10**13})
  got = float(10**13) if name in ("run_lease_timeout_seconds", "storage_retry_seconds") else 10**13  # fractions allowed
  assert str(error.value) == f"{name} must be at most {threading.TIMEOUT_MAX:.0f} (the longest a thread can wait), got {got}"
