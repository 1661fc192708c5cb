"""train.py when the train step does not fit: XLA's out-of-memory error while the step compiles or
first runs is one `error:` line (how much against how much per device, what uses less), exit code 2,
and a resumed run's checkpoint stays as it was; one after steps ran (a hook's, or the step's beside
memory that grew) is one line too, exit code 3, naming the checkpoint a rerun resumes from. No device of this machine is to be filled: the
jitted step is replaced by one that raises the error XLA raises (its real texts, GPU and TPU)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import numpy as np
import pytest

from MaxText import errors, train
from MaxText.aot import memory_report
from MaxText.configuration.config import BASE_CONFIG_PATH
from MaxText.training import train_step

GIB = memory_report.GIB
TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
            print_config=False, cpu_peak_tflops=1.0, enable_tensorboard=False)
# First lines of XLA's errors as it raises them (each followed by more lines that the error line leaves out).
TPU_COMPILE = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used "
               "20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G.\n\nTotal hbm usage >= 20.50G:")
TPU_RUN = ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 4.39G. That was not possible. "
           "There are 2.30G free.; (0x0x0_HBM0)")
GPU_RUN = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4770354232 bytes.\nBufferAssignment OOM "
           "Debugging.\nBufferAssignment stats:\n             parameter allocation:  372.76MiB")
GPU_BFC = ("RESOURCE_EXHAUSTED: Failed to allocate request for 32.00MiB (33554432B) on device ordinal 0: while running "
           "replica 0 and partition 0 of a replicated computation (other replicas may have failed as well).")


def test_xla_run_time_allocation_failures_read_as_one_allocation_against_what_was_free():
  assert memory_report.parse_xla_oom(TPU_RUN) == memory_report.XlaOom(
      "hbm", int(4.39 * GIB), int(2.30 * GIB), one_allocation=True)
  assert memory_report.parse_xla_oom(GPU_RUN) == memory_report.XlaOom("", 4770354232, 0, one_allocation=True)
  assert memory_report.parse_xla_oom(GPU_BFC) == memory_report.XlaOom("", 32 * 2**20, 0, one_allocation=True)
  assert memory_report.oom_sizes(memory_report.parse_xla_oom(TPU_RUN), "chip") == \
      "allocating 4.390 GiB more per chip failed with 2.300 GiB free"
  assert memory_report.oom_sizes(memory_report.parse_xla_oom(GPU_RUN), "device", 80 * GIB) == \
      "allocating 4.443 GiB more per device failed, a device holds 80.000 GiB"
  assert memory_report.oom_sizes(memory_report.parse_xla_oom(TPU_COMPILE), "chip") == \
      "needs 20.500 GiB per chip, 15.750 GiB available"
  assert all(memory_report.is_xla_oom(m) for m in (TPU_COMPILE, TPU_RUN, GPU_RUN, "CUDA_ERROR_OUT_OF_MEMORY: "
                                                                                "out of memory"))
  assert not memory_report.is_xla_oom("INTERNAL: Failed to execute XLA Runtime executable")


class _Unreadable:
  """A step's metric whose value never arrives: the first step failed on the device after it was
  dispatched (XLA raises its error when the host reads the result)."""

  def __init__(self, message: str):
    self.message = message

  def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
    raise jax.errors.JaxRuntimeError(self.message)


def _failing_step(monkeypatch: pytest.MonkeyPatch, message: str, when: str = "call", after: int = 0) -> None:
  """train.py's jitted step raises XLA's `message` when called (`when="call"`: its compile, or a
  synchronous failure) or when its metrics are read (`"read"`: the device's failure, surfacing later);
  the first `after` calls return made-up metrics instead."""
  calls = []

  def jit_train_step(*args: object, **kwargs: object):
    def step(state, batch, rng, *rest):
      calls.append(1)
      if len(calls) <= after:
        return state, {"loss": np.float32(4.0), "grad_norm": np.float32(1.0), "num_tokens": np.float32(256)}
      if when == "call":
        raise jax.errors.JaxRuntimeError(message)
      return state, {"loss": _Unreadable(message)}
    return step
  monkeypatch.setattr(train_step, "jit_train_step", jit_train_step)


def _cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], **overrides: object) -> tuple[int, str]:
  """train.py's entry point as `python3 -m MaxText.train` runs it: (exit code, stderr)."""
  args = {**TINY, "run_name": "oom", "base_output_directory": tmp_path, "steps": 2, **overrides}
  capsys.readouterr()
  with pytest.raises(SystemExit) as exited:
    errors.run_cli(train.main, ["train", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in args.items()])
  return int(exited.value.code or 0), capsys.readouterr().err


def _error_line(stderr: str) -> str:
  assert "Traceback" not in stderr, stderr[-3000:]
  errors_ = [line for line in stderr.splitlines() if line.startswith("error")]
  assert errors_ == [stderr.strip().splitlines()[-1]], stderr[-3000:]
  return errors_[0]


@pytest.mark.parametrize("message, when, sizes", [
    (TPU_COMPILE, "call", "needs 20.500 GiB per device, 15.750 GiB available"),
    (GPU_RUN, "read", "allocating 4.443 GiB more per device failed, a device holds 80.000 GiB"),
], ids=["tpu-compile", "gpu-run"])
def test_a_step_too_large_for_the_devices_is_one_line_with_the_sizes_and_what_uses_less(tmp_path, capsys, monkeypatch,
                                                                                       message, when, sizes):
  """Was: XLA's traceback from the trainer's first step (or from reading its metrics)."""
  _failing_step(monkeypatch, message, when)
  monkeypatch.setattr(train, "_device_bytes", lambda: 80 * GIB)  # what a GPU's allocator says it may use
  code, stderr = _cli(tmp_path, capsys, enable_checkpointing=False)
  assert code == 2
  line = _error_line(stderr)
  first = message.splitlines()[0]
  assert line.startswith(f"error: the train step does not fit in the devices' memory (compiling or running step 1): "
                         f"{sizes} (train state per device: parameters "), line
  assert f"; XLA: {first}); use less per device: a smaller per_device_batch_size (now 1), a remat_policy that saves " \
         "less (remat_policy=full; now " in line, line
  assert line.endswith("more fsdp sharding (ici_fsdp_parallelism; now fsdp=8), the optimizer state in host memory "
                       "(optimizer_memory_host_offload=true); python3 -m MaxText.train_compile with the same overrides "
                       "and compile_topology=local (or the slice's, e.g. v5e-256) prints the step's memory report"), line


def _tree_digest(directory: Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_resumed_run_whose_first_step_does_not_fit_leaves_its_checkpoint_as_it_was(tmp_path, capsys, monkeypatch):
  code, stderr = _cli(tmp_path, capsys, steps=2, checkpoint_period=2)
  assert code == 0, stderr[-3000:]
  checkpoints = tmp_path / "oom" / "checkpoints"
  saved = _tree_digest(checkpoints)
  assert any(name.startswith("2/") for name in saved), sorted(saved)

  _failing_step(monkeypatch, TPU_RUN)
  code, stderr = _cli(tmp_path, capsys, steps=4, checkpoint_period=2)
  assert code == 2
  line = _error_line(stderr)
  assert line.startswith("error: the train step does not fit in the devices' memory (compiling or running step 3): "
                         "allocating 4.390 GiB more per device failed with 2.300 GiB free (train state per device: "), line
  assert _tree_digest(checkpoints) == saved  # not a file added, removed or rewritten

  monkeypatch.undo()
  code, stderr = _cli(tmp_path, capsys, steps=3, checkpoint_period=2)
  assert code == 0, stderr[-3000:]
  assert "3" in {p.name for p in checkpoints.iterdir()}


def _train_raises(tmp_path: Path, run_name: str) -> None:
  args = {**TINY, "run_name": run_name, "base_output_directory": tmp_path, "steps": 3, "enable_checkpointing": False}
  train.main(["train", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in args.items()])


def test_other_xla_errors_keep_their_traceback(tmp_path, monkeypatch):
  _failing_step(monkeypatch, "INTERNAL: Failed to execute XLA Runtime executable: run time error.")
  with pytest.raises(jax.errors.JaxRuntimeError, match="^INTERNAL: Failed to execute"):
    _train_raises(tmp_path, "internal")


@pytest.mark.parametrize("when", ["call", "read"])
def test_an_out_of_memory_after_steps_ran_is_one_line_naming_the_checkpoint_to_resume(tmp_path, capsys, monkeypatch,
                                                                                      when):
  """Was XLA's traceback: steps 1 and 2 ran and saved, step 3's allocation failed (at its dispatch, or when its
  metrics were read). The saved checkpoint is left as it was and the line says a rerun resumes from it."""
  _failing_step(monkeypatch, TPU_RUN, when, after=2)
  code, stderr = _cli(tmp_path, capsys, steps=4, checkpoint_period=2)
  assert code == 3
  line = _error_line(stderr)
  assert line.startswith("error: the devices ran out of memory in the train step after step 2 (steps 1..2 of this "
                         "start ran, so one step alone fits: memory held beside the step grew, or the device "
                         "allocator fragmented; XLA: RESOURCE_EXHAUSTED: Error allocating device buffer: "), line
  assert "; the newest checkpoint is step 2: rerun the same command to resume from it; to leave more room per " \
         "device: a smaller per_device_batch_size (now 1), " in line, line
  checkpoints = tmp_path / "oom" / "checkpoints"
  assert {p.name for p in checkpoints.iterdir() if p.name.isdigit()} == {"2"}

  monkeypatch.undo()
  code, stderr = _cli(tmp_path, capsys, steps=4, checkpoint_period=2)
  assert code == 0, stderr[-3000:]
  assert "4" in {p.name for p in checkpoints.iterdir()}


def test_an_out_of_memory_in_the_evaluation_names_it(tmp_path, capsys, monkeypatch):
  from MaxText.training import trainer

  def on_step(self, trainer_, record, state):
    raise jax.errors.JaxRuntimeError(GPU_BFC)

  monkeypatch.setattr(trainer.EvalHook, "on_step", on_step)
  code, stderr = _cli(tmp_path, capsys, steps=3, eval_interval=2, enable_checkpointing=False)
  assert code == 3
  line = _error_line(stderr)
  assert line.startswith("error: the devices ran out of memory in the evaluation at step 2 (steps 1..2 of this start "
                         "ran, so the train step fits; this needs more beside the train state; XLA: RESOURCE_EXHAUSTED: Failed to "
                         "allocate request for 32.00MiB"), line
  assert "; checkpointing is off, so a rerun starts over; " in line, line
