"""The local checkpoint tier after a change of hosts: a process without the newest local step gets
it from the peers that hold it (peer_handover.py), a host whose process index changed finds the
steps it saved under the old one, and a damaged or missing peer copy falls back to the
persistent tier with one line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText.platform.loopback_launch import host_local_directory
from MaxText.run_dir import peer_handover
from MaxText.run_dir.local_checkpoints import LocalTier
from tests.compile_settings import jax_cache_env
from tests.conftest import REPO_ROOT

# Two leaves over processes 0..2: "a" replicated (every process holds the halves 0:4 and 4:8),
# "b" split so that process 2's region is held by no other process.
_HALVES = [json.dumps([[0, 4]]), json.dumps([[4, 8]])]
_NEEDS = [{0: _HALVES, 1: _HALVES, 2: _HALVES},
          {0: [json.dumps([[0, 2]])], 1: [json.dumps([[2, 4]])], 2: [json.dumps([[4, 8]])]}]


def test_a_process_without_the_step_gets_it_from_the_holders_of_its_regions():
  plan, note = peer_handover.choose([[3, 5], [3, 5], [3]], _NEEDS[:1], persistent_step=2)
  assert plan is not None and note == ""
  assert (plan.step, plan.holders, plan.lackers) == (5, (0, 1), (2,))
  assert plan.transfers == ((0, _HALVES[0], 0), (0, _HALVES[1], 0))  # each region once, from the first holder
  assert plan.describe() == "handed over to process(es) 2 by process(es) 0"
  every, _ = peer_handover.choose([[3, 5]] * 3, _NEEDS, persistent_step=None)
  assert every is not None and (every.step, every.lackers, every.describe()) == (5, (), "")


def test_a_step_whose_regions_no_holder_has_is_passed_over_with_one_line():
  plan, note = peer_handover.choose([[3, 5], [3, 5], [3]], _NEEDS, persistent_step=2)
  assert plan is not None and (plan.step, plan.lackers) == (3, ())  # the newest step everyone holds
  assert note == "local checkpoint step 5 is held by process(es) 0, 1 only, which do not hold the regions process(es) 2 need"
  plan, note = peer_handover.choose([[3, 5], [3, 5], []], _NEEDS, persistent_step=2)
  assert plan is None and note.startswith("local checkpoint step 5 ")
  assert peer_handover.choose([[3, 5], [3, 5], [3]], _NEEDS, persistent_step=5) == (None, "")  # not newer


def test_a_renumbered_host_finds_the_steps_saved_under_its_old_index(tmp_path):
  """The folder a process wrote as process 1 serves it as process 0; its next saves go under
  process_0 and the old folder's older steps are pruned."""
  sharding = NamedSharding(Mesh(np.asarray(jax.devices()[:4]), ("fsdp",)), PartitionSpec("fsdp"))
  abstract = {"w": jax.ShapeDtypeStruct((16,), np.float32)}
  tier = LocalTier(str(tmp_path), period=1, max_to_keep=2)
  tier.save(3, {"w": jax.device_put(np.arange(16, dtype=np.float32), sharding)}, {"step": 3}, {})
  tier.wait()
  (tmp_path / "process_0").rename(tmp_path / "process_1")  # saved while this host ran process 1

  tier = LocalTier(str(tmp_path), period=1, max_to_keep=2)
  assert tier.steps() == [3] and tier.locate(3, abstract, {"w": sharding}) == str(tmp_path / "process_1" / "3")
  restored, data, _ = tier.restore(3, abstract, {"w": sharding})
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(16))
  assert data == {"step": 3}
  for step in (4, 5):
    tier.save(step, restored, {"step": step}, {})
  tier.wait()
  assert sorted(p.name for p in (tmp_path / "process_0").iterdir()) == ["4", "5"]
  assert list((tmp_path / "process_1").iterdir()) == []  # older than every step kept: pruned


def test_the_loopback_launcher_keeps_each_hosts_local_directory_with_the_host():
  argv = ["python3", "-m", "MaxText.train", "local_checkpoint_directory=/tmp/local", "steps=3"]
  assert host_local_directory(argv, 2, 1) == ["python3", "-m", "MaxText.train",
                                              "local_checkpoint_directory=/tmp/local/slice_2_host_1", "steps=3"]
  assert host_local_directory(["steps=3"], 0, 0) == ["steps=3"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow  # two real processes, four restores: about a minute on a loaded 2-core machine
def test_two_processes_hand_over_rename_and_fall_back(tmp_path):
  port = _free_port()
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), **jax_cache_env()}
  procs = [subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "peer_handover_worker.py"), str(i), str(port),
                             str(tmp_path)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  results = {line.split()[1]: line.split(maxsplit=5)[2:] for line in outs[0].splitlines()
             if line.startswith("RESULT ")}
  local = str(tmp_path / "{}" / "host{}" / "run")
  # Process 1 lost step 5: process 0 hands its replica over, bit for bit (-0.0 and a NaN payload too),
  # and process 1 writes it to its own disk.
  assert results["handover"] == ["5", "bitwise=True", "on_disk=1,1",
                                 f"the local tier ({local.format('handover', 0)}; handed over to process(es) 1 by "
                                 "process(es) 0)"]
  # The processes swapped hosts: each finds the other index's folder on its disk; nothing moves.
  assert results["renumbered"] == ["5", "bitwise=True", "on_disk=0,0", f"the local tier ({local.format('renumbered', 1)})"]
  # The holder's copy is damaged: one line on it, and everyone reads the persistent tier.
  assert results["corrupt"] == ["2", "bitwise=True", "on_disk=0,0", str(tmp_path / "corrupt" / "persistent")]
  damaged = [line for line in outs[0].splitlines() if line.startswith("warning: local checkpoint")]
  assert len(damaged) == 1 and damaged[0].startswith("warning: local checkpoint step 5 on process 0 is unreadable ("), \
      outs[0]
  assert damaged[0].endswith("); using the persistent tier")
  # Process 1 needs regions that only it held: one line, then the persistent tier.
  assert results["missing"] == ["2", "bitwise=True", "on_disk=0,0", str(tmp_path / "missing" / "persistent")]
  assert "local checkpoint step 5 is held by process(es) 0 only, which do not hold the regions process(es) 1 need; " \
         "using the persistent tier" in outs[0]


class _Preempted:
  """SIGTERM seen at step 3."""

  def reached(self, step):
    return step == 3

  def close(self):
    pass


class _Tiers:
  directory, local, last_saved_step = "checkpoints", object(), None

  def __init__(self):
    self.saved, self.saved_local = [], []

  def local_due(self, step):
    return False

  def save_local(self, step, state, data_state, meta):
    self.saved_local.append(step)

  def wait_local(self):
    pass

  def save(self, step, state, data_state, meta):
    self.saved.append(step)
    self.last_saved_step = step

  def wait(self, step=None):
    pass


@pytest.mark.parametrize("grow_back", [True, False])
def test_the_supervisors_grow_back_stop_saves_to_the_local_tier_only(grow_back):
  """A preemption's SIGTERM saves to the persistent tier; the elastic supervisor's grow-back stop
  (its marker in the run folder) saves the step to the local tier, which the returning processes
  are handed."""
  from types import SimpleNamespace

  from MaxText.training.trainer import CheckpointHook, StepRecord

  tiers = _Tiers()
  hook = CheckpointHook(tiers, 5, 10, _Preempted(), jax.random.key(0), grow_back=lambda: grow_back)
  trainer = SimpleNamespace(stop_reason=None, data=SimpleNamespace(get_state=lambda: {"step": 3}))
  for step in (1, 2, 3):
    if hook.due(step):
      hook.on_step(trainer, StepRecord(step, 0.0, {}), "state")
  assert (tiers.saved_local, tiers.saved) == (([3], []) if grow_back else ([], [3]))
  assert trainer.stop_reason == ("SIGTERM to grow the elastic job back: saved step 3 to the local tier, which the "
                                 "returning processes are handed" if grow_back else "SIGTERM: saved step 3 to checkpoints")


def test_the_grow_back_marker_is_read_from_the_run_folder(tmp_path):
  from MaxText.run_dir import preemption

  assert not preemption.is_grow_back(str(tmp_path))
  (tmp_path / preemption.GROW_BACK_MARKER).write_text("1\n")
  assert preemption.is_grow_back(str(tmp_path))
