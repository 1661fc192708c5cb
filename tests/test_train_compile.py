"""Ahead-of-time compilation: the topology table, compiling for v5e-256 without a TPU,
does-not-fit reporting, and the saved step file (save -> load -> train on CPU, refusals)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from MaxText import train, train_compile
from MaxText.aot import hlo_cycles, memory_report
from MaxText.aot.step_time import report as step_report
from MaxText.aot.step_time import saved
from MaxText.training import compiled_step
from MaxText.platform import accelerators
from MaxText.configuration.config import BASE_CONFIG_PATH, Config
from MaxText.errors import ConfigError, UserError
from MaxText.training.run_assembly import build_run

REPO = Path(__file__).resolve().parent.parent
# Small enough that a 512-device TPU compile takes seconds, not minutes.
TPU_TINY = dict(base_emb_dim=256, base_num_query_heads=2, base_num_kv_heads=2, head_dim=64, base_mlp_dim=512,
                base_num_decoder_layers=1, vocab_size=256, max_target_length=64, per_device_batch_size=1,
                print_config=False)


def argv(**overrides) -> list[str]:
  return ["train_compile", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in overrides.items()]


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
  full_env = {**os.environ, **(env or {})}
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=full_env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.parametrize("name, chips, hosts, topology", [
    ("v5e-1", 1, 1, "v5e:1x1"), ("v5e-8", 8, 2, "v5e:2x4"), ("v5e-256", 256, 64, "v5e:16x16"),
    ("v4-8", 4, 1, "v4:2x2x1"), ("v4-384", 192, 48, "v4:4x4x12"), ("v4-4096", 2048, 512, "v4:8x16x16"),
    ("v5p-8", 4, 1, "v5:2x2x1"), ("v5p-640", 320, 80, "v5:4x4x20"), ("v5p-1152", 576, 144, "v5:4x12x12"),
    ("v5p-7680", 3840, 960, "v5:12x16x20"), ("v5p-12288", 6144, 1536, "v5:16x16x24"),
    ("v6e-1", 1, 1, "v6e:1x1"), ("v6e-4", 4, 1, "v6e:2x2"), ("v6e-8", 8, 2, "v6e:2x4"), ("v6e-256", 256, 64, "v6e:16x16"),
    ("tpu7x-2", 1, 1, "tpu7x:1x1x1"), ("tpu7x-8", 4, 1, "tpu7x:2x2x1"), ("tpu7x-64", 32, 8, "tpu7x:2x4x4"),
    ("tpu7x-128", 64, 16, "tpu7x:4x4x4"), ("tpu7x-18432", 9216, 2304, "tpu7x:16x24x24"),
])
def test_topology_table_matches_published_slice_shapes(name, chips, hosts, topology):
  t = accelerators.tpu_topology(name)
  assert (t.chips, t.hosts, t.topology_name) == (chips, hosts, topology)
  per_chip = 2 if name.startswith("tpu7x") else 1  # a tpu7x chip's two TensorCores are two JAX devices
  assert t.devices == per_chip * chips and t.target(num_slices=2).num_devices == 2 * per_chip * chips


def test_v6e_and_tpu7x_figures_are_the_published_ones_per_device():
  v6e, tpu7x = accelerators.TPU_GENERATIONS["v6e"], accelerators.TPU_GENERATIONS["tpu7x"]
  assert (v6e.hbm_gib, v6e.peak_tflops, v6e.peak_fp8_tflops, v6e.devices_per_chip) == (32.0, 918.0, 918.0, 1)
  assert v6e.host_gib == pytest.approx(720e9 / 4 / 2**30)  # 720 GB per 4-chip VM
  # Per chip 192 GiB, 2307 bf16 / 4614 fp8 TFLOP/s, 960 GB per 4-chip VM: halved per TensorCore.
  assert (tpu7x.hbm_gib, tpu7x.peak_tflops, tpu7x.peak_fp8_tflops, tpu7x.devices_per_chip) == (96.0, 1153.5, 2307.0, 2)
  assert tpu7x.host_gib == pytest.approx(960e9 / 8 / 2**30) and tpu7x.device_unit == "TensorCore"
  assert accelerators.known_peak_tflops("TPU7x") == 1153.5 and accelerators.known_peak_tflops("TPU v6 lite") == 918.0


def test_topology_table_hardware_facts_and_names():
  v5e, v5p = accelerators.tpu_topology("v5e-256"), accelerators.tpu_topology("v5p-128")
  assert (v5e.generation.hbm_gib, v5e.generation.peak_tflops, v5e.chips_per_host) == (16.0, 197.0, 4)
  assert (v5p.generation.hbm_gib, v5p.generation.peak_tflops, v5p.generation.chip_config) == (95.0, 459.0, "megacore")
  assert v5e.wrap == (True, True, False) and accelerators.tpu_topology("v5e-128").wrap == (False, True, False)
  names = accelerators.known_topology_names()
  for expected in ("v4-8", "v4-4096", "v5e-1", "v5e-256", "v5p-8", "v5p-12288", "v6e-1", "v6e-256"):
    assert expected in names
  with pytest.raises(ConfigError, match=r"unknown compile_topology 'v5e-520'; valid names: v4-8, .*v5e-256.*v5p-12288"):
    accelerators.tpu_topology("v5e-520")


def test_unknown_or_missing_topology_is_a_one_line_error():
  with pytest.raises(ConfigError, match="unknown compile_topology 'v9-8'"):
    train_compile.main(argv(compile_topology="v9-8"))
  with pytest.raises(ConfigError, match="train_compile needs compile_topology=NAME"):
    train_compile.main(argv())
  with pytest.raises(ConfigError, match="compile_topology_num_slices must be >= 1"):
    train_compile.main(argv(compile_topology="v5e-256", compile_topology_num_slices=0))


def test_local_is_read_in_any_case_and_named_beside_the_slice_types():
  """"LOCAL" was an unknown slice type (where "V6E-8" is v6e-8), and the list of valid names left local out."""
  config, devices, topology = train_compile.load_target_config(argv(compile_topology=" LOCAL ", **TPU_TINY))
  assert topology is None and list(devices) == jax.devices()
  with pytest.raises(ConfigError) as refused:
    train_compile.main(argv(compile_topology="cpu"))
  message = str(refused.value)
  assert message.startswith("unknown compile_topology 'cpu'; valid names: v4-8, ") and "\n" not in message
  assert message.endswith("to tpu7x-18432; or local, for this machine's devices")


@pytest.mark.parametrize("typed, named", [("V6E-8", "v6e-8"), (" v6e-256 ", "v6e-256"), ("v6e-08", "v6e-8"),
                                          ("tpu7x-8", "tpu7x-8"), ("tpu7x-2", "tpu7x-2")])
def test_a_topology_name_is_read_as_its_one_spelling(typed, named):
  """"v6e-08" was kept as typed, so the report and a saved step's header named a slice "v6e-08"."""
  assert accelerators.tpu_topology(typed).name == named


_WRITTEN = " (did you mean '{}'? a slice type is written <generation>-<size>)"


@pytest.mark.parametrize("typed, hint", [
    ("v7x-8", " (did you mean 'tpu7x-8'? Cloud TPU names this generation tpu7x)"),
    ("v5litepod-16", " (did you mean 'v5e-16'? Cloud TPU names this generation v5e)"),
    ("tpu7x-2x2x1", " (did you mean 'tpu7x-8'? a slice type is named by its count of TensorCores, not its 2x2x1 "
                    "shape)"),
    ("tpu7x-4x4x4", " (did you mean 'tpu7x-128'? a slice type is named by its count of TensorCores, not its 4x4x4 "
                    "shape)"),
    ("v6e:2x4", " (did you mean 'v6e-8'? a slice type is named by its count of chips, not its 2x4 shape)"),
    ("v6e_8", _WRITTEN.format("v6e-8")), ("tpu-v6e-8", _WRITTEN.format("v6e-8")), ("v6e8", _WRITTEN.format("v6e-8")),
    ("TPU_V6E_8", _WRITTEN.format("v6e-8")), ("v6e 8", _WRITTEN.format("v6e-8")), ("tpu7x_8", _WRITTEN.format("tpu7x-8")),
    ("v5litepod_16", " (did you mean 'v5e-16'? Cloud TPU names this generation v5e)"),
    ("v6e-512", " (v6e's largest slice is v6e-256: for 512 chips give compile_topology=v6e-256 "
                "compile_topology_num_slices=2)"),
    ("v5p-24576", " (v5p's largest slice is v5p-12288: for 24576 TensorCores give compile_topology=v5p-12288 "
                  "compile_topology_num_slices=2)"),
    ("v6e-7", ""), ("v6e-0", ""), ("v6e--8", ""), ("tpu7x-3", ""), ("v6e-" + "9" * 30, ""),
    ("v6e-768", " (v6e's largest slice is v6e-256: for 768 chips give compile_topology=v6e-256 "
                "compile_topology_num_slices=3)"),
    ("v6e-\u00b2", ""),  # a superscript two: str.isdigit() passes it, int() raised a ValueError traceback
])
def test_a_wrong_topology_name_is_one_line_naming_what_was_meant(typed, hint):
  """GKE's and libtpu's shape names and other spellings of a generation got only the list of every name."""
  with pytest.raises(ConfigError) as refused:
    accelerators.tpu_topology(typed)
  message = str(refused.value)
  assert message.startswith(f"unknown compile_topology {typed!r}{hint}; valid names: v4-8, ") and "\n" not in message
  # the sizes under the multiples of 128 are each named (they read "v5p-8 ... v5p-12288" before)
  assert "v5p-8, v5p-16, v5p-32, v5p-64, then every multiple of 128 from v5p-128 to v5p-12288" in message
  assert message.endswith("tpu7x-2, tpu7x-8, tpu7x-16, tpu7x-32, tpu7x-64, then every multiple of 128 from "
                          "tpu7x-128 to tpu7x-18432")


def test_a_topology_compile_writes_only_its_error_line():
  """libtpu, describing a slice off a TPU VM, printed "Failed to find host bounds for accelerator type: WARNING:
  could not determine TPU accelerator type, please set env var `TPU_ACCELERATOR_TYPE` ..." on stderr before every
  compile's report and before its one `error:` line (here a mesh that does not divide the slice)."""
  result = run_cli("MaxText.train_compile", *argv(compile_topology="v6e-8", ici_tensor_parallelism=3, **TPU_TINY)[1:],
                   timeout=300)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr == "error: ici_tensor_parallelism = 3 does not divide 8 devices per slice\n"
  # The variable is set only while libtpu describes the slice: has_tpu() reads it and must still say no.
  before = os.environ.get("TPU_ACCELERATOR_TYPE")
  from MaxText import startup
  assert len(startup.describe_topology(accelerators.tpu_topology("v6e-4"), 1)) == 4
  assert os.environ.get("TPU_ACCELERATOR_TYPE") == before


def test_a_tpu7x_that_does_not_fit_counts_per_tensorcore():
  """XLA's figure and the 96 GiB are a TensorCore's (a JAX device's); "per chip, tpu7x has 96 GiB" halved the chip."""
  with pytest.raises(UserError, match=r"^does not fit: needs 120.0 GiB per TensorCore, tpu7x has 96 GiB \(XLA: "):
    train_compile.compile_or_explain(*_raising("RESOURCE_EXHAUSTED: Used 120.0G of 96.0G hbm"),
                                     accelerators.tpu_topology("tpu7x-8"))


def test_a_tpu7x_that_does_not_fit_names_its_state_per_tensorcore():
  """The state's parts are a device's shard, as XLA's figure is: the line read "needs 241.9 GiB per TensorCore, tpu7x
  has 96 GiB (...; train state per chip: parameters 64.266 GiB, ...)" for a 34B model on tpu7x-2, half a chip's."""
  @dataclasses.dataclass
  class State:
    params: object
    opt_state: object
  state = State(jax.ShapeDtypeStruct((1024, 256), jax.numpy.float32), jax.ShapeDtypeStruct((2048, 256), jax.numpy.float32))

  with pytest.raises(UserError) as refused:
    train_compile.compile_or_explain(*_raising("RESOURCE_EXHAUSTED: Used 120.0G of 96.0G hbm", state),
                                     accelerators.tpu_topology("tpu7x-2"))
  assert str(refused.value).endswith("; train state per TensorCore: parameters 1.0 MiB, optimizer state 2.0 MiB)")
  with pytest.raises(UserError) as refused:
    train_compile.compile_or_explain(*_raising("RESOURCE_EXHAUSTED: Used 20.0G of 16.0G hbm", state),
                                     accelerators.tpu_topology("v5e-4"))
  assert "GiB per chip, v5e has 16 GiB" in str(refused.value) and "; train state per chip: " in str(refused.value)


def test_a_tpu7x_host_memory_line_counts_per_tensorcore():
  """XLA's host figures and a tpu7x host's 111.8 GiB are a TensorCore's: the line said "need 120.0 GiB per chip, XLA
  allows 128 GiB of offloaded buffers per chip and a tpu7x host has 111.8 GiB per TensorCore"."""
  gib, tpu7x = memory_report.GIB, accelerators.TPU_GENERATIONS["tpu7x"]
  message = memory_report.host_memory_message(120 * gib, tpu7x, memory_report.Offload("minimal_offloaded", 1, 1, False),
                                              "x", xla_limit=128 * gib)
  assert message.startswith("does not fit: host memory, not HBM: the activations remat_policy=minimal_offloaded "
                            "offloads to the host's pinned memory need 120.0 GiB per TensorCore, XLA allows 128 GiB of "
                            "offloaded buffers per TensorCore and a tpu7x host has 111.8 GiB per TensorCore; "), message
  assert ("fewer sequences per TensorCore at a time (1.1x fewer: under one sequence per TensorCore, so "
          "per_device_batch_size=0.5 with each sequence split over 2 TensorCores (ici_tensor_parallelism=2 or "
          "ici_sequence_parallelism=2))") in message, message
  assert "per chip" not in message


def test_a_compile_whose_cycle_estimates_add_up_to_0_reports_no_step_time(capsys):
  """A step whose instructions carry estimated_cycles that sum to 0 for one execution (or sit outside its
  ENTRY) was a ZeroDivisionError after the memory report; now a line that says there is no estimate."""
  import types

  analysis = types.SimpleNamespace(argument_size_in_bytes=1, output_size_in_bytes=1, alias_size_in_bytes=0,
                                   temp_size_in_bytes=1, generated_code_size_in_bytes=1)
  config = Config.for_testing(**TPU_TINY)
  for text in ('ENTRY %main {\n  ROOT %x = f32[] constant(0), backend_config={"estimated_cycles":"0"}\n}',
               'HloModule m, backend_config={"estimated_cycles":"7"}'):
    compiled = types.SimpleNamespace(memory_analysis=lambda: analysis, as_text=lambda text=text: text)
    train_compile.report(config, accelerators.tpu_topology("v5e-4"), compiled)
    out = capsys.readouterr().out
    assert "compiler estimate of step time: not available (the compiled step's cycle estimates add up to 0)" in out
    assert "implied MFU" not in out


def test_compiles_for_one_v5e_256_slice(capsys):
  assert train_compile.main(argv(compile_topology="v5e-256", **TPU_TINY)) == 0
  out = capsys.readouterr().out
  assert "1 x v5e-256 (v5e:16x16, 64 hosts of 4 chips per slice): 256 devices, TPU v5 lite" in out
  assert "mesh: fsdp=256" in out
  assert "generated code" in out and "fits:" in out and "of 16 GiB per v5e chip" in out
  # The buffer report is asked for per compile, so every in-process compile gets one.
  assert "from the XLA buffer assignment" in out
  assert "--xla_dump_to" not in os.environ.get("XLA_FLAGS", "")  # the report options did not leak
  assert "compiler estimate (not a measurement)" in out and "implied MFU" in out
  assert "step-time model (not a measurement): step" in out and "exposed ICI" in out


def test_compiles_for_v6e_4_with_the_step_time_model(capsys):
  assert train_compile.main(argv(compile_topology="v6e-4", **TPU_TINY)) == 0
  out = capsys.readouterr().out
  assert "1 x v6e-4 (v6e:2x2, 1 hosts of 4 chips per slice): 4 devices, TPU v6 lite" in out
  assert "step-time model (not a measurement): step" in out and "of 918 TFLOP/s" in out
  assert "no network figures" not in out and "fits:" in out and "of 32 GiB per v6e chip" in out


@pytest.mark.slow
def test_compiles_for_tpu7x_8_with_two_devices_per_chip(capsys):
  assert train_compile.main(argv(compile_topology="tpu7x-8", **TPU_TINY)) == 0
  out = capsys.readouterr().out
  assert "1 x tpu7x-8 (tpu7x:2x2x1, 1 hosts of 4 chips per slice, 2 devices per chip): 8 devices, TPU7x" in out
  assert "mesh: fsdp=8" in out and "step-time model (not a measurement): step" in out and "of 1153.5 TFLOP/s" in out
  assert "fits:" in out and "of 96 GiB per tpu7x TensorCore" in out
  assert "(device memory per TensorCore, from the" in out and "per chip, from the" not in out


def test_a_topology_libtpu_cannot_describe_is_one_line(monkeypatch):
  # The installed libtpu has no "megacore" chip config for tpu7x: its refusal, as an older libtpu refuses tpu7x.
  tpu7x = accelerators.TPU_GENERATIONS["tpu7x"]
  monkeypatch.setitem(accelerators.TPU_GENERATIONS, "tpu7x", dataclasses.replace(tpu7x, chip_config="megacore"))
  with pytest.raises(ConfigError) as refused:
    train_compile.main(argv(compile_topology="tpu7x-8", **TPU_TINY))
  message = str(refused.value)
  assert message.startswith(f"the installed libtpu ({accelerators.libtpu_version()}) cannot describe "
                            "compile_topology=tpu7x-8 (tpu7x:2x2x1): NOT_FOUND")
  assert message.endswith("install a libtpu that knows tpu7x (pip install -U libtpu) or compile for another topology")
  assert "\n" not in message


def test_cli_reports_the_device_heap_from_xla_buffer_assignment():
  result = run_cli("MaxText.train_compile", *argv(compile_topology="v5e-4", **TPU_TINY)[1:], timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "device heap" in result.stdout and "from the XLA buffer assignment" in result.stdout
  assert "xla_dump_to" not in result.stdout  # train_compile's own flags are not shown as the user's


@pytest.mark.slow
def test_compiles_and_saves_for_two_v5e_256_slices(tmp_path, capsys, monkeypatch):
  path = tmp_path / "step.aot"
  monkeypatch.setenv(saved.SAVE_ENV, str(tmp_path / "hlo"))  # the step-time model's copy of the compiled step
  assert train_compile.main(argv(compile_topology="v5e-256", compile_topology_num_slices=2, dcn_data_parallelism=2,
                                 compiled_trainstep_file=path, **TPU_TINY)) == 0
  out = capsys.readouterr().out
  assert "2 x v5e-256" in out and "512 devices" in out and "mesh: data=2, fsdp=256" in out
  hlo_text, target, _ = saved.load_step(str(tmp_path / "hlo"))
  assert target.num_slices == 2 and len(target.coords) == 512 and {c[3] for c in target.coords} == {0, 1}
  assert step_report.predict(hlo_text, target).busy.get("dcn", 0.0) > 0  # the gradients cross the DCN
  header, _ = compiled_step.read_header(str(path))
  assert "--xla_dump_to" not in header["flags"]["XLA_FLAGS"]  # train_compile's own report flags stay out
  assert header["topology"] == "v5e-256"
  assert header["target"] == {"platform": "tpu", "device_kind": "TPU v5 lite", "num_devices": 512, "num_slices": 2}
  assert header["batch"]["global_batch_size"] == 512
  assert header["versions"]["libtpu"] is not None


def test_does_not_fit_is_one_line_and_non_zero():
  big = dict(TPU_TINY, base_emb_dim=4096, base_num_query_heads=32, base_num_kv_heads=32, head_dim=128,
             base_mlp_dim=16384, base_num_decoder_layers=4, vocab_size=32000)
  result = run_cli("MaxText.train_compile", *argv(compile_topology="v5e-1", **big)[1:])
  assert result.returncode == 2, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: does not fit: needs ") and "GiB per chip, v5e has 16 GiB" in last
  needed = float(last.split("needs ")[1].split(" GiB")[0])
  assert needed > 16  # 1.3B parameters with AdamW state are ~16 GiB before any activation
  assert "Traceback" not in result.stderr


def test_uncosted_pallas_kernels_are_counted_per_execution():
  hlo = "\n".join([
      "%body (p: (s32[])) -> (s32[]) {",
      '  %s = f32[] custom-call(%p), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={}}',
      '  %f = f32[] fusion(%p), kind=kOutput, backend_config={"estimated_cycles":"100"}',
      "}",
      "%cond (p: (s32[])) -> pred[] {",
      "  %c = s32[] constant(16)",
      "}",
      "ENTRY %main (a: f32[]) -> f32[] {",
      '  %d = f32[] custom-call(%a), custom_call_target="tpu_custom_call"',
      "  %w = (s32[]) while(%t), condition=%cond, body=%body",
      "}",
  ])
  assert hlo_cycles.uncosted_kernel_calls(hlo) == 17
  assert hlo_cycles.estimated_cycles(hlo) == 1600


def test_report_says_splash_attention_is_not_in_the_estimate(capsys):
  """The TPU compiler prices no Pallas kernel: the report names them and bounds what they add."""
  splash = {f"sa_block_{b}": 128 for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq",
                                           "kv_dq")}
  assert train_compile.main(argv(compile_topology="v5e-4", **dict(TPU_TINY, max_target_length=256), attention="flash",
                                 **splash)) == 0
  out = capsys.readouterr().out
  line = next(line for line in out.splitlines() if "Pallas kernel calls per step" in line)
  assert "attention's" in line and "MFU at most" in line


def test_pallas_calls_beside_dot_product_attention_are_not_called_splash():
  """attention=autoselected runs dot_product below 128 tokens; a MoE's grouped matmuls (sparse_matmul) are Pallas calls
  there, and the line put "with splash attention that is attention's ... TFLOP" beside them (a tiny mixtral on tpu7x-8)."""
  short = Config.for_testing(target=accelerators.tpu_topology("v6e-4").target(), **dict(TPU_TINY, attention="autoselected"))
  assert train_compile._kernel_floor(short, 1e-6, 1e-3, 1e-3, 918.0) == ""
  tiled = Config.for_testing(target=accelerators.tpu_topology("v6e-4").target(),
                             **dict(TPU_TINY, attention="autoselected", max_target_length=512))
  assert train_compile._kernel_floor(tiled, 1e-6, 1e-3, 1e-3, 918.0).startswith("; with splash attention")


def test_a_kernel_scalar_memory_overflow_is_named_as_such():
  """XLA's SMEM overflow (splash's block-mask metadata at 512k tokens) is not an HBM shortfall."""
  class Step:
    def lower(self, *args):
      return self

    def compile(self, compiler_options=None):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem. "
          "Allocation (size=2097152) would exceed memory (size=1048576) :: #allocation3 [shape = 'u8[2097152]{0}', "
          "space=smem, size = 0x200000, scoped] :: splash_mha_fwd_segmented_residuals.3)")

  class Inputs:
    def as_args(self):
      return ()

  with pytest.raises(UserError, match=r"scalar memory \(SMEM\) overflows, not HBM.*sa_block_\* sizes"):
    train_compile.compile_or_explain(Step(), Inputs(), accelerators.tpu_topology("v5p-8"))

  class VmemStep(Step):
    def compile(self, compiler_options=None):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:")

  with pytest.raises(UserError, match=r"vector memory \(VMEM\), not HBM; raise the limit with libtpu_init_args="
                                     r"--xla_tpu_scoped_vmem_limit_kib=98304 .*sa_block_\* sizes"):
    train_compile.compile_or_explain(VmemStep(), Inputs(), accelerators.tpu_topology("v5p-8"))


# libtpu 0.0.42.1's whole message for upstream's v6e llama3_1-8b-8192 block without its flags (4 sequences of 8192
# tokens per chip; operand lists shortened): the kernel, its block sizes and the figures come after the first line.
XLA_SPLASH_VMEM = (
    "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\n"
    "Ran out of memory in memory space vmem while allocating on stack for %splash_mha_dkv_segmented_no_residuals.1 = "
    "(f32[4,2048,128]{2,1,0:T(8,128)}, f32[4,2048,128]{2,1,0:T(8,128)}, "
    "bf16[4,4,32,8192,128]{4,3,2,1,0:T(8,128)(2,1)}, ...) custom-call(%copy-done.133, ...), "
    "custom_call_target=\"tpu_custom_call\", frontend_attributes={kernel_metadata={\n"
    '"xprof_metadata":"{\\"block_q_dkv\\": 2048, \\"block_kv_dkv\\": 2048, \\"block_kv_dkv_compute\\": 2048, '
    '\\"q_layout\\": 1, \\"k_layout\\": 1, \\"v_layout\\": 1}"\n'
    "}}, metadata={op_name=\"jit(train_step)/transpose(jvp())/while/body/closed_call/checkpoint/shard_map/"
    "vmap(static_sparsity_splash)/jit(_splash_attention)/splash_mha_dkv_segmented_no_residuals/pallas_call\"}. "
    "Scoped allocation with size 36.09M and limit 32.00M exceeded scoped vmem limit by 4.09M. It should not be "
    "possible to run out of scoped vmem - \nSee https://openxla.org/xla/errors/error_1001 for more details.")


def test_a_splash_vmem_overflow_names_its_kernel_its_blocks_and_the_flag():
  """XLA's first line says only `CompileTimeScopedVmemOom`; the line names the splash pass, the sa_block_* keys that
  size it, the need against XLA's scoped limit, and the libtpu flag upstream's recipe passes for it."""
  line = ("does not fit: splash attention's dK/dV backward kernel splash_mha_dkv_segmented_no_residuals "
          "(sa_block_q_dkv=2048, sa_block_kv_dkv=2048, sa_block_kv_dkv_compute=2048) needs 36.09 MiB of vector memory "
          "(VMEM), over XLA's scoped VMEM limit of 32.00 MiB, not HBM; raise the limit with "
          "libtpu_init_args=--xla_tpu_scoped_vmem_limit_kib=98304 (what upstream's v6e recipes pass; this kernel needs "
          "at least 37888) or use smaller sa_block_q_dkv/sa_block_kv_dkv/sa_block_kv_dkv_compute (XLA: "
          "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Scoped allocation with size 36.09M and limit 32.00M)")
  assert memory_report.vmem_overflow_message(XLA_SPLASH_VMEM) == line

  with pytest.raises(UserError) as raised:
    train_compile.compile_or_explain(*_raising(XLA_SPLASH_VMEM), accelerators.tpu_topology("v6e-8"))
  assert str(raised.value) == line
  # Past upstream's 96 MiB (the flag already set) the line asks for the kernel's own need instead.
  bigger = memory_report.vmem_overflow_message(XLA_SPLASH_VMEM.replace("36.09M and limit 32.00M",
                                                                       "100.50M and limit 96.00M"))
  assert "--xla_tpu_scoped_vmem_limit_kib=103424 (this kernel's need, if the chip's VMEM holds it)" in bigger
  forward = memory_report.vmem_overflow_message(XLA_SPLASH_VMEM.replace("_dkv_segmented_no_residuals.1",
                                                                        "_fwd_segmented_residuals.3"))
  assert "forward kernel splash_mha_fwd_segmented_residuals" in forward and "smaller sa_block_q/sa_block_kv/" in forward


@pytest.mark.slow  # a v6e compile; the message itself is checked by the default run
def test_the_libtpu_init_args_key_reaches_libtpus_vmem_limit():
  """A recipe's libtpu flag given as the config key reaches the compiler: a 2 MiB scoped VMEM limit (not the
  default 32) stops the tiny step's splash forward kernel, with the one line naming it and the flag."""
  result = run_cli("MaxText.train_compile", *argv(compile_topology="v6e-4", **dict(TPU_TINY, head_dim=128,
                                                                                   max_target_length=1024),
                                                  attention="flash",
                                                  libtpu_init_args="--xla_tpu_scoped_vmem_limit_kib=2048")[1:],
                   timeout=300)
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert errors[0].startswith("error: does not fit: splash attention's forward kernel splash_mha_fwd_segmented_")
  assert "over XLA's scoped VMEM limit of 2.00 MiB" in errors[0]
  assert "libtpu_init_args=--xla_tpu_scoped_vmem_limit_kib=98304" in errors[0] and "smaller sa_block_q/" in errors[0]


def test_aot_compile_honours_libtpu_flags():
  """libtpu parses LIBTPU_INIT_ARGS when it describes the topology: an unknown flag stops the compile."""
  result = run_cli("MaxText.train_compile", *argv(compile_topology="v5e-4", **TPU_TINY)[1:],
                   env={"LIBTPU_INIT_ARGS": "--xla_flag_that_does_not_exist_for_test=1"}, timeout=300)
  assert result.returncode != 0
  assert "xla_flag_that_does_not_exist_for_test" in result.stderr


# ---------------------------------------------------------------- saved step: CPU round trip

# The conftest tiny model, plus the schedule length (part of the compiled step).
CPU_TINY = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=16, base_mlp_dim=128,
                base_num_decoder_layers=2, vocab_size=128, max_target_length=32, per_device_batch_size=1,
                print_config=False, steps=3)


@pytest.fixture(scope="module")
def cpu_step_file(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("aot") / "cpu_step.aot"
  assert train_compile.main(argv(compile_topology="local", compiled_trainstep_file=path, **CPU_TINY)) == 0
  return path


def _train(tmp_path: Path, run_name: str, **extra) -> list[float]:
  args = {**CPU_TINY, "run_name": run_name, "base_output_directory": tmp_path, "enable_checkpointing": False,
          "enable_tensorboard": False, "cpu_peak_tflops": 1.0, **extra}
  assert train.main(["train", str(BASE_CONFIG_PATH)] + [f"{k}={v}" for k, v in args.items()]) == 0
  lines = (tmp_path / run_name / "metrics.jsonl").read_text().splitlines()
  return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_saved_step_trains_like_a_jitted_one_on_cpu(tmp_path, cpu_step_file, capsys):
  loaded = _train(tmp_path, "loaded", compiled_trainstep_file=cpu_step_file)
  assert "loaded the compiled executable" in capsys.readouterr().out
  jitted = _train(tmp_path, "jitted")
  assert len(loaded) == 3 and loaded == jitted  # the same program on the same inputs: bitwise equal


@pytest.mark.slow
def test_a_step_with_loss_spike_detection_saves_loads_and_trains_like_a_jitted_one(tmp_path, capsys):
  path = tmp_path / "spike_step.aot"
  spiky = dict(CPU_TINY, loss_spike_threshold=4.0, loss_spike_window=2)
  assert train_compile.main(argv(compile_topology="local", compiled_trainstep_file=path, **spiky)) == 0
  loaded = _train(tmp_path, "loaded", compiled_trainstep_file=path, loss_spike_threshold=4.0, loss_spike_window=2)
  assert "loaded the compiled executable" in capsys.readouterr().out
  assert loaded == _train(tmp_path, "jitted", loss_spike_threshold=4.0, loss_spike_window=2)


def _load_for(path: Path, **overrides) -> None:
  """What train.py does with compiled_trainstep_file, without initialising or training."""
  build_run(Config.for_testing(**{**CPU_TINY, **overrides, "compiled_trainstep_file": str(path)}))


def test_mismatched_step_file_is_refused(tmp_path, cpu_step_file):
  _load_for(cpu_step_file)  # the matching run loads it
  with pytest.raises(UserError, match=r"compiled for a different run \(topology local\): .*model.emb_dim: file 64, "
                                      r"this run 128"):
    _load_for(cpu_step_file, base_emb_dim=128)
  with pytest.raises(UserError, match=r"optim.learning_rate: file 0.003, this run 0.01"):
    _load_for(cpu_step_file, learning_rate=0.01)
  with pytest.raises(UserError, match=r"batch.global_batch_size: file 8, this run 16"):
    _load_for(cpu_step_file, per_device_batch_size=2)
  with pytest.raises(UserError, match=r"guards.loss_spike_threshold: file False, this run True"):
    _load_for(cpu_step_file, loss_spike_threshold=5.0)  # that step takes a loss limit: another program
  with pytest.raises(UserError, match=r"guards.skip_nonfinite_steps: file True, this run False"):
    _load_for(cpu_step_file, skip_nonfinite_steps=False)

  header, offset = compiled_step.read_header(str(cpu_step_file))
  header["versions"]["jax"] = "0.0.1"  # as if compiled by another JAX: rebuild the file by hand
  data = json.dumps(header).encode()
  stale = tmp_path / "stale.aot"
  stale.write_bytes(b"MAXTEXT-COMPILED-TRAIN-STEP\n" + len(data).to_bytes(8, "big") + data +
                    cpu_step_file.read_bytes()[offset:])
  with pytest.raises(UserError, match=r"versions.jax: file '0.0.1', this run '"):
    _load_for(stale)


def test_files_that_are_not_saved_steps_are_refused(tmp_path):
  junk = tmp_path / "junk.bin"
  junk.write_bytes(b"\x80\x04not a step")
  with pytest.raises(UserError, match="is not a compiled train step written by train_compile"):
    compiled_step.read_header(str(junk))
  with pytest.raises(UserError, match="cannot read compiled_trainstep_file"):
    compiled_step.read_header(str(tmp_path / "missing.aot"))


# ---------------------------------------------------------------- pure helpers


def test_oom_message_parsing_and_wording():
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
             "(19.70G) exceeds available HBM (15.75G).")
  assert memory_report.oom_bytes_from_xla(message) == int(19.70 * memory_report.GIB)
  assert memory_report.oom_bytes_from_xla("Used 20.5G of 15.75G hbm") == int(20.5 * memory_report.GIB)
  assert memory_report.oom_bytes_from_xla("no sizes here") is None
  assert memory_report.does_not_fit_message(21.4 * memory_report.GIB, "v5e", 16.0, "x") == \
      "does not fit: needs 21.4 GiB per chip, v5e has 16 GiB (x)"


# XLA's out-of-memory messages, first lines as this libtpu wrote them compiling for v5p on a CPU:
# llama3.1-405b on v5p-1024, per_device_batch_size=2, max_target_length=8192, ici_fsdp_parallelism=-1,
# with remat_policy=save_dot_except_mlp_offloaded (the sum) and =minimal_offloaded (one buffer).
XLA_HOST_SUM = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space host. "
                "Used 133.88G of 128.00G host. Exceeded host capacity by 5.88G.")
XLA_HOST_BUFFER = ("RESOURCE_EXHAUSTED: Allocation (size=219848638464) would exceed memory (size=137438953472) :: "
                   "%s0 = inlined_call_operand.host [shape: bf16[126,2,8192,53248], index: 0, kind: output, shape "
                   "index: {}] /* operand 0 */ :: custom-call.226")


def test_xla_out_of_memory_messages_name_the_memory_and_the_sizes():
  gib = memory_report.GIB
  assert memory_report.parse_xla_oom(XLA_HOST_SUM + "\n\nProgram host requirement 133.88G:") == \
      memory_report.XlaOom("host", int(133.88 * gib), 128 * gib)
  assert memory_report.parse_xla_oom(XLA_HOST_BUFFER) == \
      memory_report.XlaOom("host", 219848638464, 128 * gib, "bf16[126,2,8192,53248]")
  assert memory_report.parse_xla_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                                     "HLO temporaries (19.70G) exceeds available HBM (15.75G).") == \
      memory_report.XlaOom("hbm", int(19.70 * gib), int(15.75 * gib))
  assert memory_report.parse_xla_oom("Used 20.5G of 15.75G hbm").space == "hbm"
  smem = memory_report.parse_xla_oom(
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem. Allocation "
      "(size=2097152) would exceed memory (size=1048576) :: #allocation3 [shape = 'u8[2097152]{0}', space=smem]")
  assert smem == memory_report.XlaOom("smem", 2097152, 1048576, "u8[2097152]")
  assert memory_report.parse_xla_oom("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:").space == "vmem"


def _raising(message: str, state: object = None):
  class Step:
    def lower(self, *args):
      return self

    def compile(self, compiler_options=None):
      raise jax.errors.JaxRuntimeError(message)

  class Inputs:
    def as_args(self):
      return ()
  inputs = Inputs()
  inputs.state = state  # None: no train state, the message names no parts
  return Step(), inputs


def test_host_memory_running_out_is_named_with_its_sizes_and_what_to_change():
  """XLA's host memory space (offloaded activations) ran out: said so, not 'needs 0.0 GiB' of HBM."""
  gib, v5p = memory_report.GIB, accelerators.tpu_topology("v5p-1024")
  offload = memory_report.Offload("save_dot_except_mlp_offloaded", 2, 1, False, 133.875 * gib)
  with pytest.raises(UserError) as raised:
    train_compile.compile_or_explain(*_raising(XLA_HOST_SUM), v5p, None, offload)
  message = str(raised.value)
  assert message.startswith("does not fit: host memory, not HBM: the activations "
                            "remat_policy=save_dot_except_mlp_offloaded offloads to the host's pinned memory need "
                            "133.9 GiB per chip, XLA allows 128 GiB of offloaded buffers per chip and a v5p host has "
                            "104.3 GiB per chip; offload less (remat_policy=full), fewer sequences per chip at a time "
                            "(1.3x fewer: per_device_batch_size=1 or gradient_accumulation_steps=2), or the same "
                            "global batch on 1.3x the chips (XLA: RESOURCE_EXHAUSTED: "), message
  offload = memory_report.Offload("minimal_offloaded", 2, 1, False, 606 * gib)
  with pytest.raises(UserError) as raised:
    train_compile.compile_or_explain(*_raising(XLA_HOST_BUFFER), v5p, None, offload)
  message = str(raised.value)
  assert "its largest buffer bf16[126,2,8192,53248] alone needs 204.8 GiB per chip (all of them about 606.0 GiB" \
         in message and "offload less (remat_policy=save_dot_except_mlp_offloaded or full)" in message, message
  assert ("(5.8x fewer: under one sequence per chip, so per_device_batch_size=0.25 with each sequence split over 4 "
          "chips (ici_tensor_parallelism=4 or ici_sequence_parallelism=4)), or the same global batch on 5.8x the "
          "chips") in message and "needs 0.0" not in message, message
  # Device memory keeps its line (plan.py reads its figure).
  with pytest.raises(UserError, match=r"^does not fit: needs 19.7 GiB per chip, v5p has 95 GiB \(XLA: "):
    train_compile.compile_or_explain(*_raising("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                                               "required for HLO temporaries (19.70G) exceeds available HBM (15.75G)."),
                                     v5p)


@pytest.mark.slow
def test_offloaded_activations_over_the_host_limit_are_reported_as_host_memory():
  """A real compile (about 2 minutes on a CPU): a small model whose offloaded activations exceed
  the host memory XLA gives each v5p chip."""
  model = dict(TPU_TINY, base_emb_dim=512, base_num_query_heads=4, base_num_kv_heads=4, head_dim=128,
               base_mlp_dim=2048, base_num_decoder_layers=64, max_target_length=2048, per_device_batch_size=96,
               remat_policy="minimal_offloaded", dataset_type="synthetic")
  result = run_cli("MaxText.train_compile", *argv(compile_topology="v5p-8", **model)[1:])
  assert result.returncode == 2, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: does not fit: host memory, not HBM: the activations remat_policy=minimal_offloaded "
                         "offloads to the host's pinned memory need 144.0 GiB per chip, XLA allows 128 GiB"), last
  assert "Used 144.00G of 128.00G host" in last and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_step_xla_accepts_is_refused_when_the_host_vm_has_less(monkeypatch):
  """XLA allows 128 GiB of offloaded buffers per chip; a v5e host VM has 44.7. The compiled
  step's host memory space is held to the host's figure too."""
  v5e = accelerators.TPU_GENERATIONS["v5e"]
  assert v5e.host_gib == pytest.approx(44.70, abs=0.01)
  monkeypatch.setitem(accelerators.TPU_GENERATIONS, "v5e", dataclasses.replace(v5e, host_gib=2**-20))
  with pytest.raises(UserError, match=r"^does not fit: host memory, not HBM: the activations "
                                      r"remat_policy=minimal_offloaded offloads to the host's pinned memory need "
                                      r"[\d.]+ GiB per chip, a v5e host has 0.0 GiB per chip; offload less"):
    # Eight scanned layers: over a MiB offloaded, the least the report counts as a memory space.
    train_compile.main(argv(compile_topology="v5e-4", **dict(TPU_TINY, remat_policy="minimal_offloaded",
                                                             base_num_decoder_layers=8)))


def test_memory_total_is_xla_peak_when_reported_else_the_upper_bound():
  gib = memory_report.GIB
  # v5e/32b as compiled: 16.1 GiB of temporaries in all, but XLA's peak of live buffers is 11.6 GiB.
  tpu = memory_report.MemoryReport(arguments=int(1.39 * gib), outputs=int(1.39 * gib), aliased=int(1.39 * gib),
                         temporaries=int(16.07 * gib), generated_code=44 * 2**20, peak=int(11.6 * gib))
  assert tpu.total == int(11.6 * gib) + 44 * 2**20 and tpu.source == "XLA peak"
  assert tpu.upper_bound > 17 * gib
  assert any(line.strip().startswith("peak live") for line in tpu.lines())
  cpu = memory_report.MemoryReport(arguments=100, outputs=40, aliased=30, temporaries=7, generated_code=0)
  assert cpu.total == cpu.upper_bound == 117
  assert "upper bound" in cpu.lines()[-1] and "per chip," in cpu.lines()[-1]
  assert "(device memory per TensorCore, from the" in cpu.lines("TensorCore")[-1]
  # A peak that counts host-offloaded buffers (v5e/128b: 47.5 GiB) is capped by the upper bound.
  offloaded = dataclasses.replace(tpu, peak=int(47.5 * gib), temporaries=int(12.1 * gib))
  assert offloaded.total == offloaded.upper_bound < int(47.5 * gib)


def test_buffer_assignment_report_is_read_per_memory_space(tmp_path):
  (tmp_path / "module_0001.jit_train_step.cl_1.after_optimizations-memory-usage-report.txt").write_text(
      "Memory Space: default (color=0)\nTotal bytes: 14541765120 (13.54GiB)\n  cumulative_size; ...\n\n"
      "Memory Space: vmem (color=1)\nTotal bytes: 117440512 (112.00MiB)\n\n"
      "Memory Space: cmem (color=5)\nTotal bytes: 45097156608 (42.00GiB)\n")
  heap, others = memory_report.read_buffer_assignment(str(tmp_path))
  assert heap == 14541765120 and others == (("host", 45097156608),)  # colour 5 is the host's pinned memory
  report = memory_report.MemoryReport(1, 1, 1, 20 * memory_report.GIB, 100, peak=47 * memory_report.GIB, device_heap=heap, other_spaces=others)
  assert report.total == heap + 100 and report.source == "XLA buffer assignment"
  assert memory_report.read_buffer_assignment(str(tmp_path / "empty")) is None and memory_report.read_buffer_assignment(None) is None


def test_estimated_cycles_counts_loop_bodies_per_iteration():
  hlo = "\n".join([
      "%body (p: (s32[])) -> (s32[]) {",
      '  %f = f32[] fusion(%p), kind=kOutput, backend_config={"estimated_cycles":"100"}',
      "}",
      "%cond (p: (s32[])) -> pred[] {",
      "  %c = s32[] constant(16)",
      "  ROOT %lt = pred[] compare(%x, %c), direction=LT",
      "}",
      "ENTRY %main (a: f32[]) -> f32[] {",
      '  %g = f32[] fusion(%a), kind=kLoop, backend_config={"estimated_cycles":"7"}',
      "  %w = (s32[]) while(%t), condition=%cond, body=%body",
      "}",
  ])
  assert hlo_cycles.estimated_cycles(hlo) == 7 + 16 * 100


def test_estimated_cycles_counts_a_conditional_as_its_costliest_branch():
  """One branch runs (the ring's per-pair kernel switch: skipped, causal or full), so the estimate
  takes the costliest, not their sum."""
  hlo = "\n".join([
      "%skip (p: s32[]) -> f32[] {",
      '  %z = f32[] fusion(%p), kind=kLoop, backend_config={"estimated_cycles":"1"}',
      "}",
      "%full (p: s32[]) -> f32[] {",
      '  %f = f32[] custom-call(%p), custom_call_target="tpu_custom_call", backend_config={"estimated_cycles":"90"}',
      "}",
      "%causal (p: s32[]) -> f32[] {",
      '  %c = f32[] custom-call(%p), custom_call_target="tpu_custom_call", backend_config={"estimated_cycles":"50"}',
      "}",
      "ENTRY %main (i: s32[]) -> f32[] {",
      "  %k = f32[] conditional(%i, %i, %i, %i), branch_computations={%skip, %causal, %full}",
      "  %b = f32[] conditional(%q, %i, %i), true_computation=%causal, false_computation=%skip",
      "}",
  ])
  assert hlo_cycles.estimated_cycles(hlo) == 90 + 50
  assert hlo_cycles.estimated_cycles("ENTRY %main () -> f32[] {\n  %a = f32[] add(%x, %y)\n}") is None


def test_a_topology_name_of_thousands_of_digits_is_one_line():
  """Python refuses to read an integer past 4300 digits: a guess at `v6e_999...` must not try."""
  for typed in ("v6e_" + "9" * 5000, "v6e-" + "256" * 2000):
    with pytest.raises(ConfigError, match=r"^unknown compile_topology .*; valid names: v4-8, "):
      accelerators.tpu_topology(typed)
  with pytest.raises(ConfigError, match=r"^unknown compile_topology 'v6e:2x9999"):
    accelerators.tpu_topology("v6e:2x" + "9" * 5000)
