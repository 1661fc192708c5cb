"""Peak host memory of `hf_to_maxtext` and `maxtext_to_hf` against the largest tensor and the model.

  python3 benchmarks/convert_memory.py [base_emb_dim=1024] [base_num_decoder_layers=8] [vocab_size=32000]
      [scan_layers=True] [max_shard_mb=200] [workdir=DIR]

Saves a random Llama checkpoint with transformers (float32, 200 MB shards), converts it to ours
and back in child processes while sampling each child's /proc/<pid>/status every 10 ms, and does
the same for a tiny model to measure what the runtime itself (Python, JAX, Orbax) occupies.
Prints the peak anonymous memory (RssAnon: what the process really holds; memory-mapped file
pages, which the kernel can drop, are reported separately as RssFile) above that baseline.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# The old names of options named after the config keys they set (the old --flags work with a warning).
RENAMED = {"hidden": "base_emb_dim", "layers": "base_num_decoder_layers", "vocab": "vocab_size"}


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


def run_and_sample(args: list[str]) -> dict[str, int]:
  """Runs `python -m args` as a child and returns its peak RssAnon / RssFile / VmRSS in KiB."""
  child = subprocess.Popen([sys.executable, "-m", *args, "hardware=cpu"], cwd=REPO,
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
    raise SystemExit(f"{args[0]} failed:\n{output[-3000:]}")
  return peaks


def round_trip(work_dir: Path, name: str, scan_layers: str, max_shard_mb: int) -> tuple[dict, dict]:
  """Peaks of HF → ours (from work_dir/name) and ours → HF."""
  ckpt, back = work_dir / f"{name}_ckpt", work_dir / f"{name}_back"
  to_ours = run_and_sample(["MaxText.convert.hf_to_maxtext", f"hf_model_path={work_dir / name}",
                            f"output_path={ckpt}", f"scan_layers={scan_layers}"])
  to_hf = run_and_sample(["MaxText.convert.maxtext_to_hf", f"load_parameters_path={ckpt}", f"output_path={back}",
                          f"max_shard_mb={max_shard_mb}"])
  return to_ours, to_hf


def report(label: str, peaks: dict, baseline: dict, largest: int, total: int) -> None:
  mib = 1024
  extra = (peaks["RssAnon"] - baseline["RssAnon"]) / mib
  print(f"{label}: peak RssAnon {peaks['RssAnon'] / mib:.0f} MiB = baseline {baseline['RssAnon'] / mib:.0f} MiB "
        f"+ {extra:.0f} MiB ({extra / (largest / 2**20):.1f}x the largest tensor, {extra / (total / 2**20):.0%} "
        f"of the model); peak RssFile (mapped, reclaimable) {peaks['RssFile'] / mib:.0f} MiB, "
        f"peak VmRSS {peaks['VmRSS'] / mib:.0f} MiB")


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
  parser.add_argument("--base_emb_dim", type=int, default=1024)
  parser.add_argument("--base_num_decoder_layers", type=int, default=8)
  parser.add_argument("--vocab_size", type=int, default=32000)
  parser.add_argument("--scan_layers", default="True", choices=("True", "False"))
  parser.add_argument("--max_shard_mb", type=int, default=200)
  parser.add_argument("--workdir", default=None)
  args = tool_args.parse_args(parser, None, renamed=RENAMED)
  for key in ("base_emb_dim", "base_num_decoder_layers", "vocab_size", "max_shard_mb"):
    bench_args.at_least(key, getattr(args, key), 1)
  if args.workdir is not None and not os.path.isdir(args.workdir):
    parser.error(f"workdir={args.workdir} is not a directory; create it or leave workdir out (a temporary one)")
  with tempfile.TemporaryDirectory(dir=args.workdir) as work:
    work_dir = Path(work)
    save_llama(work_dir / "tiny", 128, 1, 256)
    base_ours, base_hf = round_trip(work_dir, "tiny", args.scan_layers, args.max_shard_mb)
    largest, total = save_llama(work_dir / "hf", args.base_emb_dim, args.base_num_decoder_layers, args.vocab_size)
    to_ours, to_hf = round_trip(work_dir, "hf", args.scan_layers, args.max_shard_mb)
  # Stored parameters stack the layers when scanned: the MLP kernels are 4 * hidden^2 per layer.
  per_layer = 4 * args.base_emb_dim * args.base_emb_dim * 4
  stacked = max(largest, per_layer * (args.base_num_decoder_layers if args.scan_layers == "True" else 1))
  print(f"model: {total / 2**20:.0f} MiB float32, largest tensor {largest / 2**20:.0f} MiB; "
        f"scan_layers={args.scan_layers}, largest stored parameter {stacked / 2**20:.0f} MiB")
  report("hf_to_maxtext", to_ours, base_ours, largest, total)
  report(f"maxtext_to_hf (max_shard_mb={args.max_shard_mb})", to_hf, base_hf, largest, total)


if __name__ == "__main__":
  bench_args.run(main)
