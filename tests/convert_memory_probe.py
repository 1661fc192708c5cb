"""Run as a fresh process by test_convert.py: peak anonymous memory of the one-by-one Orbax write
and of a one-parameter read, measured away from other tests' threads and caches (an in-process
probe also counted whatever earlier tests left running). Prints {"write_mib": x, "read_mib": y}."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from MaxText.convert import streaming


def peak_extra_rss_mib(action: Callable[[], object]) -> float:
  """Peak anonymous resident memory above the starting level while `action()` runs (5 ms sampling)."""
  def rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith("RssAnon:"):
        return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")

  streaming._release_free_memory()  # noqa: SLF001 - start from a trimmed heap, as the converters do
  start, peak, done = rss_anon_kib(), [0], threading.Event()

  def sample() -> None:
    while not done.is_set():
      peak[0] = max(peak[0], rss_anon_kib())
      time.sleep(0.005)

  sampler = threading.Thread(target=sample)
  sampler.start()
  try:
    action()
  finally:
    done.set()
    sampler.join()
  return (peak[0] - start) / 1024


def main(directory: Path) -> None:
  # 12 random float32 parameters of 16 MiB on disk (memory maps, as hf_to_maxtext stages them).
  params = {}
  for i in range(12):
    staged = np.memmap(directory / f"p{i}.bin", dtype=np.float32, mode="w+", shape=(1024, 4096))
    staged[:] = np.random.default_rng(i).standard_normal((1024, 4096), dtype=np.float32)
    staged.flush()
    params[f"p{i}"] = np.memmap(directory / f"p{i}.bin", dtype=np.float32, mode="r", shape=(1024, 4096))
  write_mib = peak_extra_rss_mib(lambda: streaming.save_params_one_by_one(str(directory / "ckpt"), params))
  reader = streaming.ParamReader(directory / "ckpt", np.float32)
  read_mib = peak_extra_rss_mib(lambda: reader.read(("p3",)))
  reader.close()
  print(json.dumps({"write_mib": write_mib, "read_mib": read_mib}))


if __name__ == "__main__":
  main(Path(sys.argv[1]))
