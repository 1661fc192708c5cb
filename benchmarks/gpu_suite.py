"""One GPU benchmark table: training MFU and tokens/s side by side with upstream MaxText, decode and serving.

    python3 benchmarks/gpu_suite.py [budget_s=480] [upstream_site=DIR] [full=true] [rows=1b,3b]
    python3 benchmarks/gpu_suite.py dry_run=true      # tiny shapes on CPU: every code path, no figures

Prints a header (date, device, driver, JAX/CUDA/Python versions) and ONE Markdown table:
- train rows: Llama-3-style models (configs/models/llama3.2-1b, llama3.2-3b, llama3.1-8b) with
  synthetic data, attention=cudnn_flash, bf16 and (compute capability >= 8.9) quantization=fp8, at
  sequence 4096 and 8192; step time, tokens/s, TFLOP/s/device and MFU as benchmarks/gpu_train.py
  measures them (FLOPs from MaxText/training/metrics.py, peaks from MaxText/platform/accelerators.py).
  A row that runs out of device memory is printed as OOM, not raised.
- upstream rows: the same configuration run by the PyPI `maxtext` package (module
  maxtext.trainers.pre_train.train, its maxtext/configs/base.yml, attention=cudnn_flash_jax: the
  same jax.nn.dot_product_attention cuDNN call without Transformer Engine) from `upstream_site=DIR`
  (wheels installed there with `pip install --target`; see benchmarks/fetch_upstream_wheels.sh).
  It runs with PYTHONPATH=DIR from a temporary working directory, so this repository is never on
  its path and upstream is never a dependency here. Its figures are parsed from its per-step log
  lines (`completed step: N, seconds: S, TFLOP/s/device: T, Tokens/s/device: K`): the median of
  the steps after the first three. The ratio column is ours / upstream tokens/s (the same model
  and tokens per step; the two projects count FLOPs their own way, tokens are not in dispute).
- serving rows (1B, random bfloat16 weights; benchmarks/gpu_serving.py): the engine's decode step at
  1, 8 and 32 slots with 8 steps per call (8 slots also with 1, and with int8 and fp8 weights) against
  the weight-read bound; the OpenAI-compatible server's output tokens/s at 1, 8, 32 and 64 concurrent
  streaming clients; the scheduler with 4 LoRA adapters loaded (base only, one adapter, 4 mixed).
- a second table: the roofline of each training row's compiled step (MaxText/aot/step_time/gpu.py),
  by kernel category, against the measured step. `extra=` adds rows of this project alone with
  settings of their own (a remat placement, an XLA flag).

Every row runs in its own subprocess (this process never starts a JAX backend, so no child finds
the GPU memory taken), with a per-row timeout, inside one overall budget_s: a row that would
start past the budget (less the time kept for serving) is printed as skipped.

Sizing: short runs are dominated by process start-up and compilation, so a training row costs
about the same whatever its steps (getting_started/GPU.md records what a row took on an H200).
The default set is 7 training configurations (1B and 3B bf16 and fp8 at 4096, 1B and 3B bf16 at
8192, 8B bf16 at 4096, which needs 16 bytes per parameter of float32 weights and AdamW state)
times two implementations, ordered so the most informative come first, plus up to 240 s of
serving; what does not fit the budget is printed as skipped. full=true adds fp8 at 8192.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from MaxText.configuration import tool_args  # noqa: E402  (key=value arguments, the old --flags kept)
from benchmarks import bench_args  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SUITE_TAG = "SUITE_JSON "
NO_FP8 = "skipped: fp8 needs compute capability >= 8.9"
SERVE_RESERVE_S = 240  # kept from the training rows for the serving child (decode, serve and LoRA rows)
DRY_SERVE_RESERVE_S = 40

# name -> (our model_name, upstream keys for the same shapes). Upstream has no Llama 3.2 YAMLs, so
# every model is spelled out over its model_name=default; RoPE scaling does not change the speed.
_LLAMA_COMMON = dict(decoder_block="llama2", vocab_size=128256, rope_max_timescale=500000,
                     normalization_layer_epsilon=1e-5, enable_dropout=False)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "1b": ("llama3.2-1b", dict(_LLAMA_COMMON, base_emb_dim=2048, base_num_query_heads=32, base_num_kv_heads=8,
                               head_dim=64, base_mlp_dim=8192, base_num_decoder_layers=16,
                               logits_via_embedding=True)),
    "3b": ("llama3.2-3b", dict(_LLAMA_COMMON, base_emb_dim=3072, base_num_query_heads=24, base_num_kv_heads=8,
                               head_dim=128, base_mlp_dim=8192, base_num_decoder_layers=28,
                               logits_via_embedding=True)),
    "8b": ("llama3.1-8b", dict(_LLAMA_COMMON, base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=8,
                               head_dim=128, base_mlp_dim=14336, base_num_decoder_layers=32,
                               logits_via_embedding=False)),
}
# The dry run's model: llama-shaped and tiny, spelled the same way for both projects.
TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
            base_num_decoder_layers=2, vocab_size=256)
# Sequences per step: about 16K tokens for 1B, 8K for the larger models.
BATCH = {("1b", 4096): 4, ("1b", 8192): 2, ("3b", 4096): 2, ("3b", 8192): 1, ("8b", 4096): 1, ("8b", 8192): 1}
DEFAULT_CONFIGS = [("1b", "bf16", 4096), ("1b", "fp8", 4096), ("3b", "bf16", 4096), ("3b", "fp8", 4096),
                   ("1b", "bf16", 8192), ("3b", "bf16", 8192), ("8b", "bf16", 4096)]
FULL_EXTRA = [("1b", "fp8", 8192), ("3b", "fp8", 8192)]
COLUMNS = ["section", "impl", "model", "params", "quant", "batch", "seq", "step ms", "tokens/s", "TFLOP/s/dev",
           "MFU", "ours/upstream", "compile s", "step / roofline", "note"]
# The second table: where the roofline of each training row's compiled step puts its time.
ROOFLINE_COLUMNS = ["impl", "model", "quant", "seq", "setting", "roofline ms", "gemm ms", "attention ms",
                    "elementwise ms", "copy ms", "kernels", "HBM GB", "measured ms", "step / roofline"]
DRY_CHIP = "NVIDIA H200"  # a dry run's CPU has no published figures: its HLO is priced as if on this GPU


# ---- the children: each prints one SUITE_JSON line


def _emit(result: dict[str, Any]) -> None:
  print(SUITE_TAG + json.dumps(result), flush=True)


def child_probe() -> None:
  import jax
  import jaxlib

  devices = jax.devices()
  d = devices[0]
  stats = d.memory_stats() if hasattr(d, "memory_stats") else None
  _emit(dict(platform=d.platform, device_kind=d.device_kind, count=len(devices),
             compute_capability=str(getattr(d, "compute_capability", "") or ""),
             memory_gib=round((stats or {}).get("bytes_limit", 0) / 2**30, 1),
             jax=jax.__version__, jaxlib=jaxlib.__version__))


def child_train(spec: dict[str, Any]) -> None:
  sys.path.insert(0, str(REPO / "benchmarks"))
  from gpu_train import time_steps  # noqa: E402  (a sibling script, not a package)

  r = time_steps(spec["overrides"], spec["steps"])
  _emit(dict(step_s=r["step_s"], tokens_per_s=r["tokens_per_s"], tflops=r["tflops_per_s_per_device"],
             mfu=r["mfu"], params_m=r["params_m"], peak=r["peak"], compile_s=r["compile_s"]))


def child_serve(spec: dict[str, Any]) -> None:
  sys.path.insert(0, str(REPO / "benchmarks"))
  import gpu_serving  # noqa: E402  (a sibling script, not a package)

  gpu_serving.child(spec, _emit)


# ---- the parent: plans rows, runs children, prints the table


def classify(returncode: int | None, output: str, timed_out: bool, timeout_s: float) -> str:
  """A failed child's status as one short cell: OOM, timeout, or the last error line."""
  if timed_out:
    return f"timeout after {timeout_s:.0f} s"
  if re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM when allocating|Failed to allocate", output):
    return "OOM"
  lines = [line.strip() for line in output.splitlines() if line.strip()]
  errors = [line for line in lines if re.match(r"^\w*(Error|Exception)\b|^\w+\.\w*Error", line)]
  last = (errors or lines or [f"exit status {returncode}"])[-1]
  return "failed: " + last.replace("|", "/")[:140]


def run_child(cmd: list[str], env: dict[str, str], cwd: str,
              timeout_s: float) -> tuple[dict[str, Any] | None, str, str]:
  """(the SUITE_JSON result or None, status, the whole output)."""
  try:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=max(1.0, timeout_s))
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return None, classify(None, out, True, timeout_s), out
  out = proc.stdout + proc.stderr
  for line in proc.stdout.splitlines():
    if line.startswith(SUITE_TAG):
      return json.loads(line[len(SUITE_TAG):]), "ok", out
  return None, classify(proc.returncode, out, False, timeout_s), out


def parse_upstream_log(text: str, skip: int = 3) -> dict[str, Any] | None:
  """Upstream's per-step log lines: median step seconds, TFLOP/s/device and tokens/s/device over the
  steps after the first `skip` (compilation and the first steps' dispatch), and its parameter count."""
  steps = [tuple(float(x) for x in m.groups()) for m in re.finditer(
      r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), Tokens/s/device: ([\d.]+)", text)]
  timed = [s for s in steps if s[0] >= skip] or steps[-1:]
  if not timed:
    return None
  params = re.search(r"number parameters: ([\d.]+) billion", text)
  first = [s[1] for s in steps if s[0] == 0]  # its step 0: compilation and the first step, as ours is timed
  return dict(step_s=statistics.median(s[1] for s in timed), tflops=statistics.median(s[2] for s in timed),
              compile_s=first[0] if first else None,
              tokens_per_s_per_device=statistics.median(s[3] for s in timed), steps=len(timed),
              # logged in billions to 3 decimals: a tiny model's reads 0
              params_m=float(params.group(1)) * 1e3 if params and float(params.group(1)) else float("nan"))


def _kv(d: dict[str, Any]) -> list[str]:
  return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()]


def upstream_command(site: str, python: str, model: dict[str, Any], quant: str, batch: int, seq: int, steps: int,
                     attention: str, hardware: str, out_dir: str) -> list[str]:
  keys = dict(model, run_name="suite", base_output_directory=out_dir, dataset_type="synthetic", steps=steps,
              per_device_batch_size=batch, max_target_length=seq, attention=attention,
              quantization="fp8" if quant == "fp8" else "", hardware=hardware, enable_checkpointing=False,
              enable_tensorboard=False, skip_jax_distributed_system=True, remat_policy="full", scan_layers=True,
              dtype="bfloat16", weight_dtype="float32", log_config=False, model_name="default")
  if not keys["quantization"]:
    del keys["quantization"]  # an empty value on upstream's command line is not read as ""
  return [python, "-m", "maxtext.trainers.pre_train.train", str(Path(site) / "maxtext" / "configs" / "base.yml"),
          *_kv(keys)]


def _dump_env(env: dict[str, str], dump_dir: str, row: str, xla_flags: str = "") -> dict[str, str]:
  """`env` with XLA dumping the train step's HLO (text, before and after optimisation) to DIR/row,
  and a row's own extra XLA flags."""
  flags = (f"--xla_dump_to={Path(dump_dir) / row} --xla_dump_hlo_as_text "
           "--xla_dump_hlo_module_re=.*train_step.*") if dump_dir else ""
  merged = " ".join(f for f in (env.get("XLA_FLAGS", ""), flags, xla_flags) if f)
  return dict(env, XLA_FLAGS=merged) if merged else env


def price_dump(dump_dir: Path, device_kind: str, measured_s: float | None) -> dict[str, float] | None:
  """The roofline of the largest optimised train-step module XLA dumped into `dump_dir`
  (MaxText/aot/step_time/gpu.py), or None where nothing was dumped or the GPU is not known."""
  from MaxText.aot.step_time import gpu  # noqa: E402  (pure text parsing; never starts a backend)
  from MaxText.errors import UserError

  dumps = sorted(dump_dir.glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size)
  if not dumps:
    return None
  try:
    return gpu.summary(gpu.estimate(dumps[-1].read_text(), device_kind), measured_s)
  except UserError:
    return None


def _ms(value: float) -> str:
  """One decimal for a real step; three significant digits for a dry run's microseconds."""
  return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def roofline_row(row: dict[str, str], setting: str, roofline: dict[str, float] | None,
                 measured_s: float | None) -> dict[str, str]:
  out = dict(impl=row["impl"], model=row["model"], quant=row["quant"], seq=row["seq"], setting=setting)
  if roofline:
    out.update({"roofline ms": _ms(roofline["model_ms"]), "gemm ms": _ms(roofline["gemm_ms"]),
                "attention ms": _ms(roofline["attention_ms"]), "elementwise ms": _ms(roofline["elementwise_ms"]),
                "copy ms": _ms(roofline["copy_ms"]), "kernels": f"{roofline['kernels']:.0f}",
                "HBM GB": f"{roofline['hbm_gb']:.3g}"})
    if measured_s:
      out.update({"measured ms": f"{measured_s * 1e3:.1f}", "step / roofline": f"{roofline['measured_over_model']:.2f}"})
  return out


def _env(dry: bool, pythonpath: str) -> dict[str, str]:
  env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
  if dry:  # one CPU device: the dry run checks code paths, not sharding
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=(flags + " --xla_force_host_platform_device_count=1").strip())
  else:  # both projects get the same memory share; no other flag differs between them
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  return env


def _command_output(cmd: list[str]) -> str:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def header_lines(probe: dict[str, Any] | None, probe_status: str) -> list[str]:
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  if probe:
    cc = f", compute capability {probe['compute_capability']}" if probe["compute_capability"] else ""
    mem = f", {probe['memory_gib']} GiB" if probe["memory_gib"] else ""
    device = f"{probe['count']} x {probe['device_kind']} ({probe['platform']}{cc}{mem})"
  else:
    device = f"unknown ({probe_status})"
  driver, cuda = "n/a (no nvidia-smi)", "n/a"
  if shutil.which("nvidia-smi"):
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0]
    found = re.search(r"CUDA Version:\s*([\d.]+)", _command_output(["nvidia-smi"]))
    cuda = f"{found.group(1)} (driver's)" if found else "n/a"
  plugins = [f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
             if re.match(r"jax[-_]cuda\d+[-_]plugin", d.metadata["Name"] or "")]
  if plugins:
    cuda += "; " + ", ".join(sorted(set(plugins)))

  def version(name: str) -> str:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return "n/a"

  return [f"date: {now}", f"device: {device}", f"driver: {driver or 'n/a'}", f"CUDA: {cuda}",
          f"jax {version('jax')}, jaxlib {version('jaxlib')}, flax {version('flax')}; "
          f"python {platform.python_version()}"]


def _params(millions: float) -> str:
  if millions != millions:
    return "n/a"
  return f"{millions / 1e3:.2f}B" if millions >= 1e3 else f"{millions:.2f}M"


def _fmt(value: Any, spec: str) -> str:
  return "" if value is None else format(value, spec)


def train_row(impl: str, model: str, quant: str, batch: int, seq: int, r: dict[str, Any] | None, status: str,
              peak: float | None = None) -> dict[str, str]:
  row = dict(section="train", impl=impl, model=model, quant=quant, batch=str(batch), seq=str(seq), note=status)
  if r:
    tflops = r["tflops"]
    mfu = r.get("mfu", tflops / peak if peak else None)
    row.update({"params": _params(r["params_m"]), "step ms": _fmt(r["step_s"] * 1e3, ".1f"),
                "tokens/s": _fmt(r["tokens_per_s"], ".0f"), "TFLOP/s/dev": _fmt(tflops, ".1f"),
                "MFU": f"{100 * mfu:.1f}%" if mfu is not None and mfu == mfu else "",
                "compile s": _fmt(r.get("compile_s"), ".1f"),
                "note": "ok" if status == "ok" else status})
  return row


def print_table(header: list[str], rows: list[dict[str, str]], columns: list[str] = COLUMNS) -> None:
  for line in header:
    print(line)
  print()
  print("| " + " | ".join(columns) + " |")
  text_columns = ("section", "impl", "model", "quant", "note", "setting")
  print("| " + " | ".join("---" if c in text_columns else "---:" for c in columns) + " |")
  for row in rows:
    print("| " + " | ".join(row.get(c, "") for c in columns) + " |")
  sys.stdout.flush()


def plan_configs(args: argparse.Namespace, fp8: bool) -> list[tuple[str, str, int, str, dict[str, Any]]]:
  """(model, quant, seq, why skipped or '', no extra settings) in the order they run."""
  if args.dry_run:
    return [("tiny", "bf16", 64, "", {}), ("tiny", "fp8", 64, "" if fp8 else NO_FP8, {})]
  # rows=none: no training rows, only the serving ones
  wanted = set(bench_args.names("rows", args.rows, [*MODELS, "none"])) if args.rows else set(MODELS)
  quants = set(bench_args.names("quants", args.quants, ("bf16", "fp8"))) if args.quants else {"bf16", "fp8"}
  out: list[tuple[str, str, int, str, dict[str, Any]]] = []
  for model, quant, seq in DEFAULT_CONFIGS + FULL_EXTRA:
    if model not in wanted or quant not in quants:
      continue
    why = ""
    if quant == "fp8" and not fp8:
      why = NO_FP8
    elif (model, quant, seq) in FULL_EXTRA and not args.full:
      why = "skipped: only with full=true"
    out.append((model, quant, seq, why, {}))
  return out


def plan_extra(spec: str, dry: bool) -> list[tuple[str, str, int, str, dict[str, Any]]]:
  """`extra=MODEL,QUANT,SEQ[,KEY=VALUE...][;...]`: rows of this project alone with its own settings
  (config keys, or `xla_flags=...` added to XLA_FLAGS), e.g. a remat placement or a compiler flag."""
  planned = []
  for item in filter(None, (part.strip() for part in spec.split(";"))):
    fields = [f.strip() for f in item.split(",")]
    if len(fields) < 3 or fields[0] not in MODELS or fields[1] not in ("bf16", "fp8") or not fields[2].isdigit():
      raise SystemExit(f"error: extra row {item!r}: expected MODEL,QUANT,SEQ[,KEY=VALUE...] with MODEL one of "
                       f"{', '.join(MODELS)}, QUANT bf16 or fp8, SEQ a number")
    settings: dict[str, Any] = {}
    for field in fields[3:]:
      key, eq, value = field.partition("=")
      if not eq:
        raise SystemExit(f"error: extra row {item!r}: {field!r} is not KEY=VALUE")
      settings[key] = value
    model, quant, seq = fields[0], fields[1], int(fields[2])
    if dry:
      model, seq = "tiny", 64
    elif (model, seq) not in BATCH:
      raise SystemExit(f"error: extra row {item!r}: no batch size for {model} at {seq} (known: "
                       f"{', '.join(f'{m} at {s}' for m, s in BATCH)})")
    planned.append((model, quant, seq, "", settings))
  return planned


def _supports_fp8(probe: dict[str, Any] | None) -> bool:
  if not probe or probe.get("platform") != "gpu":
    return False
  try:
    major, minor = (int(x) for x in probe["compute_capability"].split(".")[:2])
  except ValueError:
    return False
  return (major, minor) >= (8, 9)


def run_suite(args: argparse.Namespace, runner: Callable[..., tuple[dict[str, Any] | None, str, str]] = run_child
              ) -> list[dict[str, str]]:
  start = time.monotonic()
  dry = args.dry_run
  me = [sys.executable, str(Path(__file__).resolve())]
  env = _env(dry, str(REPO))
  probe, probe_status, _ = runner(me + ["_child=probe"], env, str(REPO), 120)
  header = header_lines(probe, probe_status)
  upstream_env = _env(dry, args.upstream_site or "")
  missing = ""
  if args.upstream_site and not (Path(args.upstream_site) / "maxtext").is_dir():
    missing = f"no maxtext package in {args.upstream_site}"
    args.upstream_site = ""
  if args.upstream_site:
    header.append(f"upstream: maxtext {_site_version(args.upstream_site)} from {args.upstream_site} "
                  f"(python {args.upstream_python or sys.executable})")
  else:
    header.append(f"upstream: not available ({missing or 'no upstream_site given'})")
  rows: list[dict[str, str]] = []
  roofline_rows: list[dict[str, str]] = []
  gpu = bool(probe and probe.get("platform") == "gpu")
  chip = probe["device_kind"] if gpu and probe else DRY_CHIP
  dump_root = args.dump_hlo or tempfile.mkdtemp(prefix="suite-hlo-")
  reserve = DRY_SERVE_RESERVE_S if dry else SERVE_RESERVE_S
  peak = None
  for model, quant, seq, why, extra in plan_configs(args, _supports_fp8(probe)) + plan_extra(args.extra, dry):
    batch = 1 if dry else BATCH[(model, seq)]
    setting = ", ".join(f"{k}={v}" for k, v in extra.items()) or "suite default"
    if why:
      rows.append(train_row("ours", model, quant, batch, seq, None, why))
      continue
    # Upstream runs beside the plain rows; an extra row's setting is this project's own.
    impls = ["ours"] + (["upstream"] if args.upstream_site and not extra else [])
    results: dict[str, dict[str, Any] | None] = {}
    for impl in impls:
      row_id = f"{impl}-{model}-{quant}-{seq}" + (f"-x{len(rows)}" if extra else "")
      left = args.budget_s - reserve - (time.monotonic() - start)
      if left < 10:
        rows.append(train_row(impl, model, quant, batch, seq, None, f"skipped: budget ({args.budget_s:.0f} s) spent"))
        results[impl] = None
        continue
      timeout = min(args.row_timeout_s, left)
      if impl == "ours":
        overrides = _our_train_overrides(model, quant, seq, batch, dry, gpu)
        overrides.update({k: v for k, v in extra.items() if k != "xla_flags"})
        spec = json.dumps(dict(overrides=overrides, steps=2 if dry else args.steps))
        r, status, _ = runner(me + ["_child=train", spec],
                              _dump_env(env, dump_root, row_id, str(extra.get("xla_flags", ""))), str(REPO), timeout)
        if r:
          peak = r["peak"]
      else:
        shapes = dict(TINY) if dry else dict(MODELS[model][1])
        with tempfile.TemporaryDirectory(prefix="upstream-") as cwd:  # outside the repository
          cmd = upstream_command(args.upstream_site, args.upstream_python or sys.executable, shapes, quant, batch,
                                 seq, 4 if dry else args.steps + 3, "cudnn_flash_jax" if gpu else "dot_product",
                                 "gpu" if gpu else "cpu", cwd)
          _, status, out = runner(cmd, _dump_env(upstream_env, dump_root, row_id), cwd, timeout)
        r = parse_upstream_log(out, skip=2 if dry else 3)
        if r:
          devices = probe["count"] if probe else 1
          r["tokens_per_s"] = r["tokens_per_s_per_device"] * devices
          status = "ok"
      results[impl] = r
      row = train_row(impl, model, quant, batch, seq, r, status, peak)
      measured = r["step_s"] if r else None
      roofline = price_dump(Path(dump_root) / row_id, chip, measured)
      if roofline and measured:
        row["step / roofline"] = f"{roofline['measured_over_model']:.2f}"
      if extra:
        row["note"] = f"{row['note']}; {setting}"
      rows.append(row)
      roofline_rows.append(roofline_row(row, setting if impl == "ours" else "upstream's", roofline, measured))
    ours, theirs = results.get("ours"), results.get("upstream")
    if ours and theirs and theirs["tokens_per_s"] > 0:
      rows[-2]["ours/upstream"] = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}"
  if not args.upstream_site:
    rows.append(dict(section="train", impl="upstream",
                     note=f"upstream: not available ({missing or 'no upstream_site given'})"))
  rows.extend(_serving_rows(args, me, env, start, dry, chip))
  print_table(header, rows)
  print()
  print(f"Roofline of each compiled train step on {chip} (MaxText/aot/step_time/gpu.py: every kernel at the "
        "longer of its FLOPs at the dense peak and its bytes at the HBM bandwidth):")
  print_table([], roofline_rows, ROOFLINE_COLUMNS)
  return rows


def _site_version(site: str) -> str:
  found = sorted(Path(site).glob("maxtext-*.dist-info"))
  return found[-1].name.removesuffix(".dist-info").split("-")[1] if found else "(version unknown)"


def _our_train_overrides(model: str, quant: str, seq: int, batch: int, dry: bool, gpu: bool) -> dict[str, Any]:
  common = dict(quantization="fp8" if quant == "fp8" else "", per_device_batch_size=batch, max_target_length=seq,
                remat_policy="full", dtype="bfloat16", enable_checkpointing=False, print_config=False,
                dataset_type="synthetic", scan_layers=True)
  if dry:  # the CPU's matmul peak is not measured: MFU means nothing there
    return dict(TINY, **common, attention="dot_product", steps=3, cpu_peak_tflops=1.0)
  return dict(common, model_name=MODELS[model][0], attention="cudnn_flash" if gpu else "autoselected",
              hardware="gpu" if gpu else "auto")


def _serving_rows(args: argparse.Namespace, me: list[str], env: dict[str, str], start: float, dry: bool,
                  chip: str) -> list[dict[str, str]]:
  sys.path.insert(0, str(REPO / "benchmarks"))
  import gpu_serving  # noqa: E402  (a sibling script, not a package)
  from MaxText.aot.step_time import gpu  # noqa: E402  (published figures only; never starts a backend)

  spec, label = gpu_serving.spec_for(dry, MODELS["1b"][0])
  left = args.budget_s - (time.monotonic() - start)
  if left < 10:
    return gpu_serving.table_rows(spec, label, None, f"skipped: budget ({args.budget_s:.0f} s) spent", None, dry)
  r, status, _ = run_child(me + ["_child=serve", json.dumps(spec)], env, str(REPO), left) \
      if args.serve else (None, "skipped: serve=false", "")
  return gpu_serving.table_rows(spec, label, r, status, gpu.chip_for(chip).hbm, dry)


def main(argv: list[str] | None = None) -> list[dict[str, str]] | None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--budget_s", type=float, default=480.0, help="overall time; later rows are skipped")
  parser.add_argument("--row_timeout_s", type=float, default=180.0, help="one training child's limit")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per training row")
  parser.add_argument("--upstream_site", default="", help="a folder holding `pip install --target` of maxtext")
  parser.add_argument("--upstream_python", default="", help="the interpreter for upstream (default: this one)")
  parser.add_argument("--rows", default="", help="comma-separated models to train (1b,3b,8b; default all)")
  parser.add_argument("--quants", default="", help="comma-separated training modes (bf16,fp8; default both)")
  parser.add_argument("--dump_hlo", default="", help="a folder: each training child dumps its train step's HLO "
                      "to FOLDER/<impl>-<model>-<quant>-<seq> (to compare the two projects' compiled steps)")
  parser.add_argument("--full", action="store_true", help="also fp8 at 8192 (past the default budget)")
  parser.add_argument("--extra", default="", help="rows of this project alone with settings of their own: "
                      "MODEL,QUANT,SEQ[,KEY=VALUE...][;...], e.g. 8b,bf16,4096,remat_policy=save_dot_except_mlp or "
                      "1b,fp8,4096,xla_flags=--xla_gpu_enable_triton_gemm=false")
  parser.add_argument("--serve", action="store_false", help="false: leave out the serving rows")
  parser.add_argument("--dry_run", action="store_true", help="tiny shapes on CPU: checks every code path")
  parser.add_argument("--_child", default="", help=argparse.SUPPRESS)
  args, rest = tool_args.parse_known_args(parser, argv, renamed={"no_serve": "serve"})
  if args._child:
    spec = json.loads(rest[0]) if rest else {}
    children = {"probe": child_probe, "train": lambda: child_train(spec), "serve": lambda: child_serve(spec)}
    children[args._child]()
    return None
  # every row's arguments read before the probe child starts: a bad one is refused before anything runs
  plan_configs(args, fp8=False)
  plan_extra(args.extra, args.dry_run)
  for key in ("budget_s", "row_timeout_s", "steps"):
    bench_args.at_least(key, getattr(args, key), 1)
  return run_suite(args)


if __name__ == "__main__":
  bench_args.run(main)
