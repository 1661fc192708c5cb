"""Peak host memory of `hf_to_maxtext` against the size of the largest tensor and of the model.

  python3 benchmarks/convert_memory.py [--hidden 1024] [--layers 8] [--vocab 32000] [--workdir DIR]

Saves a random Llama checkpoint with transformers (float32, 200 MB shards), converts it in a
child process while sampling the child's /proc/<pid>/status every 10 ms, and does the same for
a tiny model to measure what the runtime itself (Python, JAX, Orbax) occupies. Prints the peak
anonymous memory (RssAnon: what the process really holds; memory-mapped file pages, which
the kernel can drop, are reported separately as RssFile) above that baseline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _status_kib(pid: int) -> dict[str, int]:
  values = {}
  try:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
      key, _, rest = line.partition(":")
      if key in ("RssAnon", "RssFile", "VmRSS"):
        values[key] = int(rest.split()[0])
  except (FileNotFoundError, ProcessLookupError):
    pass
  return values


def convert_and_sample(hf_dir: Path, out_dir: Path) -> dict[str, int]:
  """Runs the converter as a child and returns its peak RssAnon / RssFile / VmRSS in KiB."""
  child = subprocess.Popen([sys.executable, "-m", "MaxText.convert.hf_to_maxtext", "--hf_path", str(hf_dir),
                            "--output_path", str(out_dir), "hardware=cpu"], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}

  def sample() -> None:
    while child.poll() is None:
      for key, value in _status_kib(child.pid).items():
        peaks[key] = max(peaks[key], value)
      time.sleep(0.01)

  sampler = threading.Thread(target=sample)
  sampler.start()
  output, _ = child.communicate()
  sampler.join()
  if child.returncode != 0:
    raise SystemExit(f"conversion failed:\n{output[-3000:]}")
  return peaks


def save_llama(directory: Path, hidden: int, layers: int, vocab: int) -> tuple[int, int]:
  """Saves a random Llama; returns (largest tensor bytes, total bytes)."""
  import torch
  import transformers

  config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=max(hidden // 128, 1),
                                    num_key_value_heads=max(hidden // 512, 1), head_dim=128)
  with torch.no_grad():
    model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(str(directory), max_shard_size="200MB")
  sizes = [p.numel() * 4 for p in model.parameters()]
  return max(sizes), sum(sizes)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--workdir", default=None)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory(dir=args.workdir) as work:
    work_dir = Path(work)
    save_llama(work_dir / "tiny", 128, 1, 256)
    baseline = convert_and_sample(work_dir / "tiny", work_dir / "tiny_ckpt")
    largest, total = save_llama(work_dir / "hf", args.hidden, args.layers, args.vocab)
    peaks = convert_and_sample(work_dir / "hf", work_dir / "ckpt")
  mib = 1024
  print(f"model: {total / 2**20:.0f} MiB float32, largest tensor {largest / 2**20:.0f} MiB")
  print(f"runtime baseline (tiny model): RssAnon {baseline['RssAnon'] / mib:.0f} MiB")
  extra = (peaks["RssAnon"] - baseline["RssAnon"]) / mib
  print(f"conversion: peak RssAnon {peaks['RssAnon'] / mib:.0f} MiB = baseline + {extra:.0f} MiB "
        f"({extra / (largest / 2**20):.1f}x the largest tensor, {extra / (total / 2**20):.0%} of the model); "
        f"peak RssFile (mapped, reclaimable) {peaks['RssFile'] / mib:.0f} MiB, peak VmRSS {peaks['VmRSS'] / mib:.0f} MiB")


if __name__ == "__main__":
  main()
