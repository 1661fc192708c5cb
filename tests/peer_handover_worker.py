"""One of two real processes (jax.distributed on 127.0.0.1, gloo, 2 CPU devices each) for
tests/test_peer_handover.py: saves and restores the local checkpoint tier in four cases, each with
its own host folders under ROOT, and prints one `RESULT case step source` line per case (process
0) after checking, on every process, that each restored shard is bitwise the saved one.

    python3 peer_handover_worker.py PROCESS_ID PORT ROOT
"""

import os
import shutil
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def values(seed: int) -> dict[str, np.ndarray]:
  w = np.arange(16, dtype=np.float32) * 0.1 + seed
  w[0] = -0.0  # the bit patterns must travel, not the values: -0.0 and a NaN payload stay
  w[1] = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
  return {"w": w, "b": (np.arange(8, dtype=np.float32) * 0.3 + seed).astype(jnp.bfloat16),
          "n": np.asarray(seed, np.int32), "spread": np.arange(8, dtype=np.float32) + seed}


def shardings(mesh: Mesh, spread_across_processes: bool) -> dict[str, NamedSharding]:
  """Replicated over the processes (an elastic run's slices), split over each process's devices;
  `spread` over every device when asked (then no process holds another's regions)."""
  return {"w": NamedSharding(mesh, P("fsdp")), "b": NamedSharding(mesh, P("fsdp")), "n": NamedSharding(mesh, P()),
          "spread": NamedSharding(mesh, P(("data", "fsdp")) if spread_across_processes else P("fsdp"))}


def state(seed: int, where: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_callback(v.shape, where[k], lambda index, v=v: v[index])
          for k, v in values(seed).items()}


def same_bits(restored: dict[str, jax.Array], seed: int) -> bool:
  want = values(seed)
  for key, array in restored.items():
    for shard in array.addressable_shards:
      got, expected = np.asarray(shard.data), want[key][shard.index]
      if got.dtype != expected.dtype or got.tobytes() != np.ascontiguousarray(expected).tobytes():
        return False
  return True


def run_case(name: str, root: str, me: int, spread: bool, host: int, damage) -> None:
  from MaxText.run_dir.checkpointing import RunCheckpoints
  from MaxText.run_dir.local_checkpoints import LocalTier

  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "fsdp"))
  where = shardings(mesh, spread)
  local = lambda h: LocalTier(os.path.join(root, name, f"host{h}", "run"), period=1, max_to_keep=5)  # noqa: E731
  checkpoints = RunCheckpoints(os.path.join(root, name, "persistent"), local=local(me))
  if name != "renumbered":
    checkpoints.save(2, state(2, where), {"step": 2}, {"rng_key_data": [2]})
  for step in (3, 5):
    checkpoints.save_local(step, state(step, where), {"step": step}, {"rng_key_data": [step]})
  checkpoints.close()
  damage(os.path.join(root, name, f"host{me}", "run", f"process_{me}"))
  multihost_utils.sync_global_devices(f"{name}_saved")

  # A restart: process `me` now runs on host `host` (renumbered when they differ).
  checkpoints = RunCheckpoints(os.path.join(root, name, "persistent"), local=local(host))
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values(0).items()}
  restored = checkpoints.restore_latest(abstract, where)
  assert restored is not None, name
  assert restored.data_state == {"step": restored.step} and restored.meta == {"rng_key_data": [restored.step]}, \
      (name, restored.data_state, restored.meta)
  bitwise = same_bits(restored.state, restored.step)
  everyone = np.asarray(multihost_utils.process_allgather(np.int32(bitwise))).reshape(-1)
  checkpoints.close()  # waits for the local copy a process that was handed the step writes
  kept = os.path.isdir(os.path.join(root, name, f"host{host}", "run", f"process_{me}", str(restored.step)))
  on_disk = ",".join(map(str, np.asarray(multihost_utils.process_allgather(np.int32(kept))).reshape(-1).tolist()))
  if me == 0:
    print(f"RESULT {name} {restored.step} bitwise={bool(everyone.all())} on_disk={on_disk} {restored.source}",
          flush=True)


def main() -> None:
  me, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=me, initialization_timeout=120)

  def drop(*steps: int):  # process 1's disk lost these steps (a replaced host, a wiped disk)
    return lambda folder: [shutil.rmtree(os.path.join(folder, str(s))) for s in steps if me == 1]

  def truncate(folder: str) -> None:  # process 1 lost step 5; process 0's copy of it is damaged
    drop(5)(folder)
    if me == 0:
      with open(os.path.join(folder, "5", "0.npy"), "r+b") as f:
        f.truncate(40)

  run_case("handover", root, me, spread=False, host=me, damage=drop(5))
  run_case("renumbered", root, me, spread=False, host=1 - me, damage=lambda folder: None)
  run_case("corrupt", root, me, spread=False, host=me, damage=truncate)
  run_case("missing", root, me, spread=True, host=me, damage=drop(3, 5))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
