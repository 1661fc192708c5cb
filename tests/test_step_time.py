"""The step-time model (MaxText/aot/step_time) on hand-built HLO whose answer is known: a lone
all-gather on a ring, a collective hidden behind a matmul and one exposed, a DCN all-reduce
across two slices, and the parsing it relies on (replica groups, loop trip counts)."""

from __future__ import annotations

import pytest

from MaxText.aot import hlo_cycles
from MaxText.aot.step_time import hlo, program, report, simulate
from MaxText.aot.step_time.network import NETWORKS, Calibration, collective_transfer
from MaxText.aot.step_time.saved import StepTarget
from MaxText.errors import UserError

V5E = NETWORKS["v5e"]
PEAK = 197e12
# Published figures only: no efficiency, no latency.
EXACT = Calibration(mxu_efficiency=1.0, kernel_efficiency=1.0, ici_efficiency=1.0, ici_hop_latency_s=0.0,
                    dcn_efficiency=1.0, dcn_latency_s=0.0, host_efficiency=1.0)


def ring(n: int = 16, slices: int = 1) -> StepTarget:
  """n chips per slice on one wrapped ring (x), `slices` slices; mesh data=slices x fsdp=n."""
  coords = tuple((x, 0, 0, s) for s in range(slices) for x in range(n))
  return StepTarget("v5e", f"v5e-{n}", (n, 1), (True, False), slices, coords, {"data": slices, "fsdp": n},
                    model_tflops_per_device=1.0)


def predict(body: str, target: StepTarget, cal: Calibration = EXACT, overlap: str = "scheduled") -> simulate.Prediction:
  text = f"HloModule m, is_scheduled=true\n\nENTRY %main (p: bf16[64,1024]) -> bf16[1024,1024] {{\n{body}\n}}\n"
  return simulate.simulate(program.build_program(text, target, overlap), cal, 1.0, PEAK / 1e12, target.num_slices)


GATHER_BYTES = 1024 * 1024 * 2
GATHER_S = 15 / 16 * GATHER_BYTES / (2 * V5E.link_one_way)  # a bidirectional ring: two links per chip
MATMUL_S = 2 * 4096**3 / PEAK
MATMUL = """  %a = bf16[4096,4096]{1,0} parameter(1)
  %b = bf16[4096,4096]{1,0} parameter(2)
  %dot = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"""


def test_a_lone_all_gather_on_a_wrapped_ring_takes_its_bytes_over_two_links_per_chip():
  pred = predict("""  %p = bf16[64,1024]{1,0} parameter(0)
  ROOT %ag = bf16[1024,1024]{1,0} all-gather(%p), channel_id=1, replica_groups=[1,16]<=[16], dimensions={0}, use_global_device_ids=true""",
                 ring())
  assert pred.step_s == pytest.approx(GATHER_S)
  assert pred.seconds == {"ici:all-gather over fsdp": pytest.approx(GATHER_S)}
  hops = predict("""  %p = bf16[64,1024]{1,0} parameter(0)
  ROOT %ag = bf16[1024,1024]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, dimensions={0}""",
                 ring(), Calibration(**{**EXACT.__dict__, "ici_hop_latency_s": 1e-6}))
  assert hops.step_s == pytest.approx(GATHER_S + 15e-6)  # one hop per ring step


def test_half_a_ring_is_a_line_and_uses_one_link_per_chip():
  target = ring()
  whole = collective_transfer("all-gather", GATHER_BYTES, list(range(16)), target, V5E)
  half = collective_transfer("all-gather", GATHER_BYTES, list(range(8)), target, V5E)
  assert whole.seconds(EXACT) == pytest.approx(GATHER_S)
  assert half.seconds(EXACT) == pytest.approx(7 / 8 * GATHER_BYTES / V5E.link_one_way)
  reduce = collective_transfer("all-reduce", GATHER_BYTES, list(range(16)), target, V5E)
  assert reduce.seconds(EXACT) == pytest.approx(2 * GATHER_S)  # reduce-scatter then all-gather


def test_a_collective_started_before_a_longer_matmul_is_hidden():
  pred = predict(f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %ags = (bf16[64,1024]{{1,0}}, bf16[1024,1024]{{1,0}}) all-gather-start(%p), channel_id=1, replica_groups=[1,16]<=[16], dimensions={{0}}, use_global_device_ids=true
{MATMUL}
  ROOT %agd = bf16[1024,1024]{{1,0}} all-gather-done(%ags)""", ring())
  assert MATMUL_S > GATHER_S
  assert pred.step_s == pytest.approx(MATMUL_S)
  assert pred.exposed("ici:") == 0.0
  assert pred.busy["ici"] == pytest.approx(GATHER_S)


def test_a_collective_waited_for_before_the_matmul_is_exposed_in_full():
  pred = predict(f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %ags = (bf16[64,1024]{{1,0}}, bf16[1024,1024]{{1,0}}) all-gather-start(%p), channel_id=1, replica_groups=[1,16]<=[16], dimensions={{0}}, use_global_device_ids=true
  %agd = bf16[1024,1024]{{1,0}} all-gather-done(%ags)
{MATMUL}""", ring())
  assert pred.step_s == pytest.approx(MATMUL_S + GATHER_S)
  assert pred.exposed("ici:") == pytest.approx(GATHER_S)
  assert pred.top_exposed[0][:2] == ("ici:all-gather over fsdp", "ags")


# Waited for at once, but first read after an independent matmul: a windowed matmul's permute.
WAITED_EARLY = f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %ags = (bf16[64,1024]{{1,0}}, bf16[1024,1024]{{1,0}}) all-gather-start(%p), channel_id=1, replica_groups=[1,16]<=[16], dimensions={{0}}, use_global_device_ids=true
  %agd = bf16[1024,1024]{{1,0}} all-gather-done(%ags)
  %moved = (bf16[1024,1024]{{1,0}}, bf16[1024,1024]{{1,0}}, u32[]) copy-start(%agd)
{MATMUL}
  %moved_done = bf16[1024,1024]{{1,0}} copy-done(%moved)
  ROOT %use = bf16[1024,1024]{{1,0}} add(%moved_done, %moved_done)"""


def test_dataflow_overlap_waits_where_the_result_is_first_read():
  scheduled = predict(WAITED_EARLY, ring())
  assert scheduled.exposed("ici:") == pytest.approx(GATHER_S)
  dataflow = predict(WAITED_EARLY, ring(), overlap="dataflow")
  assert dataflow.exposed("ici:") == 0.0  # the on-chip copy hands it on; the add is the first read
  assert dataflow.seconds["matmul"] == pytest.approx(MATMUL_S)
  # Read at once: nothing to hide behind, whichever reading.
  read_at_once = predict(f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %ags = (bf16[64,1024]{{1,0}}, bf16[1024,1024]{{1,0}}) all-gather-start(%p), channel_id=1, replica_groups=[1,16]<=[16], dimensions={{0}}, use_global_device_ids=true
  %agd = bf16[1024,1024]{{1,0}} all-gather-done(%ags)
  %r = bf16[1024,1024]{{1,0}} add(%agd, %agd)
{MATMUL}
  ROOT %t = (bf16[1024,1024]{{1,0}}, bf16[4096,4096]{{1,0}}) tuple(%r, %dot)""", ring(), overlap="dataflow")
  assert read_at_once.exposed("ici:") == pytest.approx(GATHER_S)
  ops = [op.name for op in program.build_program(
      f"HloModule m\n\nENTRY %main (p: bf16[64,1024]) -> bf16[1024,1024] {{\n{WAITED_EARLY}\n}}\n", ring(), "dataflow")]
  assert ops.index("agd") > ops.index("dot")  # the done moved past the independent matmul
  with pytest.raises(UserError, match="not one of scheduled, dataflow"):
    program.build_program("HloModule m\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n", ring(),
                          "eager")


def test_the_printed_breakdown_names_the_schedules_own_step_where_it_differs():
  dataflow, scheduled = (predict(WAITED_EARLY, ring(), overlap=o) for o in ("dataflow", "scheduled"))
  printed = report.lines(dataflow, PEAK / 1e12, scheduled)
  assert printed[2].startswith(f"  waiting where this compile's schedule waits: step {scheduled.step_s * 1e3:,.1f} ms")
  same = report.lines(scheduled, PEAK / 1e12, scheduled)
  assert not any("schedule waits" in line for line in same)


def test_a_done_read_only_by_the_root_waits_at_the_end():
  pred = predict(f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %ags = (bf16[64,1024]{{1,0}}, bf16[1024,1024]{{1,0}}) all-gather-start(%p), channel_id=1, replica_groups=[1,16]<=[16], dimensions={{0}}, use_global_device_ids=true
  %agd = bf16[1024,1024]{{1,0}} all-gather-done(%ags)
{MATMUL}
  ROOT %t = (bf16[1024,1024]{{1,0}}, bf16[4096,4096]{{1,0}}) tuple(%agd, %dot)""", ring(), overlap="dataflow")
  assert pred.step_s == pytest.approx(MATMUL_S)  # a loop's carried result: hidden behind the body's work
  assert pred.exposed("ici:") == 0.0


def test_slices_wait_for_the_slowest_a_share_of_the_step_per_doubling():
  cal = Calibration(**{**EXACT.__dict__, "slice_sync_share": 0.01})
  one = predict(MATMUL, ring(slices=1), cal)
  four = predict(MATMUL, ring(slices=4), cal)
  assert one.step_s == pytest.approx(MATMUL_S)
  assert four.step_s == pytest.approx(MATMUL_S * 1.02)  # two doublings
  assert four.seconds[simulate.SLICE_SYNC] == pytest.approx(MATMUL_S * 0.02)
  assert four.top_exposed[0][0] == simulate.SLICE_SYNC
  printed = "\n".join(report.lines(four, PEAK / 1e12))
  assert "exposed DCN 0.0 ms" in printed and f"slice synchronisation {MATMUL_S * 0.02 * 1e3:,.1f} ms" in printed
  assert "exposed: " + f"{MATMUL_S * 0.02 * 1e3:,.1f} ms slice synchronisation (every step waits" in printed


def test_a_dcn_all_reduce_across_two_slices_moves_half_the_array_each_way():
  send_attrs = ('is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}')
  pred = predict(f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %aa = token[] after-all()
  %send = (bf16[1024,1024]{{1,0}}, u32[], token[]) send(%p, %aa), channel_id=3, {send_attrs}
  %recv = (bf16[1024,1024]{{1,0}}, u32[], token[]) recv(%aa), channel_id=2, {send_attrs}
  %sd = token[] send-done(%send), channel_id=3
  ROOT %rd = (bf16[1024,1024]{{1,0}}, token[]) recv-done(%recv), channel_id=2""", ring(slices=2))
  expected = 2 * GATHER_BYTES * (1 / 2) / V5E.dcn_per_chip
  assert pred.step_s == pytest.approx(expected)
  assert pred.exposed("dcn:") == pytest.approx(expected)
  slower = predict(f"""  %p = bf16[64,1024]{{1,0}} parameter(0)
  %aa = token[] after-all()
  %recv = (bf16[1024,1024]{{1,0}}, u32[], token[]) recv(%aa), channel_id=2, {send_attrs}
  ROOT %rd = (bf16[1024,1024]{{1,0}}, token[]) recv-done(%recv), channel_id=2""", ring(slices=2),
                   Calibration(**{**EXACT.__dict__, "dcn_efficiency": 0.5, "dcn_latency_s": 1e-3}))
  assert slower.step_s == pytest.approx(2 * expected + 2 * 1e-3)  # a ring over 2 slices: 2 steps


def test_an_hlo_all_reduce_whose_group_spans_two_slices_goes_over_dcn():
  target = ring(n=4, slices=2)
  work = collective_transfer("all-reduce", GATHER_BYTES, [0, 4], target, V5E)
  assert work.resource == "dcn" and work.axis == "data"
  assert work.seconds(EXACT) == pytest.approx(2 * GATHER_BYTES / 2 / V5E.dcn_per_chip)


def test_replica_groups_in_every_form():
  def groups(attrs: str, n: int = 8) -> list[list[int]]:
    inst = hlo.parse_instruction(f"  %x = f32[8]{{0}} all-reduce(%y), {attrs}, to_apply=%add")
    assert inst is not None
    return hlo.replica_groups(inst, n)

  assert groups("replica_groups={{0,1},{2,3}}") == [[0, 1], [2, 3]]
  assert groups("replica_groups=[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert groups("replica_groups=[2,4]<=[4,2]T(1,0)") == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert groups("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}") == [
      [0, 2, 4, 6], [1, 3, 5, 7]]
  assert groups("replica_groups={}") == [list(range(8))]


UNROLLED_LOOP = """HloModule m, is_scheduled=true

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i, %two)
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %y = f32[8]{0} exponential(%x), backend_config={"estimated_cycles":"1500"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %y)
}

ENTRY %main (p: f32[8]) -> (s32[], f32[8]) {
  %p = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %p)
  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_batched_matmul_laid_along_a_dilated_window_counts_one_tap_per_batch_element():
  """The TPU compiler writes a matmul batched over [32, 64] as a convolution whose two spatial
  dimensions carry the batch: a window as wide as each, over an input dilated by as much, so one tap
  in each window lands on an element and the rest on the dilation's holes (a DeltaNet chunk's
  einsum, as compiled for v5p). Its work is the batched matmul's, not the window's taps."""
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[32,64,64,128], b: f32[32,64,64,128]) -> f32[32,64,64,64] {
  %a = f32[32,64,64,128]{3,2,1,0} parameter(0)
  %b = f32[32,64,64,128]{3,2,1,0} parameter(1)
  ROOT %c = f32[32,64,64,64]{3,2,1,0} convolution(%a, %b), window={size=32x64 stride=31x63 lhs_dilate=32x64}, dim_labels=01bf_01oi->01bf
}
"""
  module = hlo.parse_module(text)
  conv = module.by_name["c"]
  assert hlo.matmul_flops(conv, module.by_name) == 2.0 * 32 * 64 * 64 * 64 * 128
  plain = hlo.parse_instruction(conv.text.replace(" lhs_dilate=32x64", "").replace("stride=31x63", "stride=1x1"))
  assert plain is not None  # without the dilation every tap is on the input: 32 x 64 of them
  assert hlo.matmul_flops(plain, module.by_name) == 2.0 * 32 * 64 * 64 * 64 * 128 * 32 * 64


def test_megablox_grouped_matmuls_are_priced_from_their_flops():
  body = """  %x = bf16[4096,2048]{1,0} parameter(1)
  %w = bf16[8,2048,512]{2,1,0} parameter(2)
  %sizes = s32[8]{0} parameter(3)
  %gmm.1 = bf16[4096,512]{1,0} custom-call(%sizes, %x, %w), custom_call_target="tpu_custom_call"
  ROOT %tgmm.1 = bf16[8,2048,512]{2,1,0} custom-call(%sizes, %x, %gmm.1), custom_call_target="tpu_custom_call"
"""
  pred = predict(body, ring())
  assert pred.seconds["kernel"] == pytest.approx(2 * 2 * 4096 * 2048 * 512 / PEAK)  # forward rows, weight gradient
  slower = predict(body, ring(), Calibration(**{**EXACT.__dict__, "mxu_efficiency": 0.5}))
  assert slower.seconds["kernel"] == pytest.approx(2 * pred.seconds["kernel"])


def test_a_ragged_all_to_all_moves_the_rows_it_sends_not_its_worst_case_receive_buffer():
  """Expert parallelism's ragged exchanges: the dispatch's result is a receive buffer for every peer's rows (here 16
  times the sender's), and the combine sends from that buffer; the links carry the rows that fit the smaller
  buffer. A fixed all-to-all of the worst-case buffer moves all of it."""
  rows, width = 4096, 2048
  body = f"""  %rows = bf16[{rows},{width}]{{1,0}} parameter(1)
  %buffer = bf16[{16 * rows},{width}]{{1,0}} parameter(2)
  %in_off = s64[16]{{0}} parameter(3)
  %send = s64[16]{{0}} parameter(4)
  %out_off = s64[16]{{0}} parameter(5)
  %recv = s64[16]{{0}} parameter(6)
  ROOT %r = bf16[{16 * rows},{width}]{{1,0}} ragged-all-to-all(%rows, %buffer, %in_off, %send, %out_off, %recv), channel_id=1, replica_groups=[1,16]<=[16]"""
  pred = predict(body, ring())
  sent = collective_transfer("ragged-all-to-all", rows * width * 2, list(range(16)), ring(), V5E).seconds(EXACT)
  assert pred.seconds == {"ici:ragged-all-to-all over fsdp": pytest.approx(sent)}
  # The combine: the worst-case buffer is the operand, the rows coming home fit the result.
  combine = f"""  %buffer = bf16[{16 * rows},{width}]{{1,0}} parameter(1)
  %home = bf16[{rows},{width}]{{1,0}} parameter(2)
  %in_off = s64[16]{{0}} parameter(3)
  %send = s64[16]{{0}} parameter(4)
  %out_off = s64[16]{{0}} parameter(5)
  %recv = s64[16]{{0}} parameter(6)
  ROOT %r = bf16[{rows},{width}]{{1,0}} ragged-all-to-all(%buffer, %home, %in_off, %send, %out_off, %recv), channel_id=1, replica_groups=[1,16]<=[16]"""
  assert predict(combine, ring()).seconds == {"ici:ragged-all-to-all over fsdp": pytest.approx(sent)}
  fixed = collective_transfer("all-to-all", 16 * rows * width * 2, list(range(16)), ring(), V5E).seconds(EXACT)
  assert fixed == pytest.approx(16 * sent)


@pytest.mark.parametrize("batch", [None, 2])
def test_splash_attention_is_priced_from_its_causal_matmuls_with_or_without_a_batch_dimension(batch):
  """A splash kernel's q and k are [batch, heads, length, head dim], or [heads, length, head dim] where a chip holds
  one sequence; its integer block masks are not q or k. Forward: QK^T and AV over the causal half."""
  heads, kv_heads, length, width = 16, 2, 4096, 256
  lead, layout = (f"{batch},", "{3,2,1,0}") if batch else ("", "{2,1,0}")
  body = "\n".join([
      "  %mask = s8[1,32,32]{2,1,0} parameter(1)",
      "  %mask.1 = s8[1,32,32]{2,1,0} parameter(2)",
      f"  %q = bf16[{lead}{heads},{length},{width}]{layout} parameter(3)",
      f"  %k = bf16[{lead}{kv_heads},{length},{width}]{layout} parameter(4)",
      f"  ROOT %splash_mha_fwd.1 = bf16[{lead}{heads},{length},{width}]{layout} custom-call(%mask, %mask.1, %q, %k), "
      'custom_call_target="tpu_custom_call"'])
  flops = 2 * 2 * (batch or 1) * heads * length * length * width * 0.5
  assert predict(body, ring()).seconds["kernel"] == pytest.approx(flops / PEAK)


@pytest.mark.parametrize("batch", [None, 2])
def test_the_fused_splash_backward_is_priced_two_matmuls_under_the_separate_dq_and_dkv_kernels(batch):
  """Splash's backward: the dK/dV kernel runs 4 matmuls per pair, the dQ kernel 3 (both re-run QK^T, dQ also
  dO·V^T); the fused kernel (sa_use_fused_bwd_kernel) 5, told apart by its result dQ's partial sums per key block."""
  heads, length, width, blocks = 8, 4096, 128, 2
  lead, layout = (f"{batch},", "{3,2,1,0}") if batch else ("", "{2,1,0}")
  qkv = f"bf16[{lead}{heads},{length},{width}]{layout}"
  operands = "\n".join(["  %mask = s8[1,32,32]{2,1,0} parameter(1)"] + [
      f"  %{name} = {qkv} parameter({k})" for k, name in enumerate(("q", "k", "v", "do"), start=2)])

  def kernel(name: str, results: list[str]) -> str:
    return (f"  %{name} = ({', '.join(results)}) custom-call(%mask, %q, %k, %v, %do), "
            'custom_call_target="tpu_custom_call"')

  scratch = "f32[128,128]{1,0}"
  dq_partial = f"bf16[{lead}{blocks},{heads},{length},{width}]" + ("{4,3,2,1,0}" if batch else "{3,2,1,0}")
  separate = "\n".join([operands, kernel("splash_mha_dkv_no_residuals.1", [scratch, qkv, qkv]),
                        kernel("splash_mha_dq_no_residuals.1", [scratch, qkv]),
                        "  ROOT %t = () tuple()"])
  fused = "\n".join([operands, kernel("splash_mha_dkv_no_residuals.1", [scratch, dq_partial, qkv, qkv]),
                     "  ROOT %t = () tuple()"])
  matmul = 2 * (batch or 1) * heads * length * length * width * 0.5 / PEAK  # one causal [L, L] x [L, width]
  assert predict(separate, ring()).seconds["kernel"] == pytest.approx((4 + 3) * matmul)
  assert predict(fused, ring()).seconds["kernel"] == pytest.approx(5 * matmul)


def test_an_unrolled_loop_counts_its_counter_step():
  text = UNROLLED_LOOP
  ops = program.build_program(text, ring())
  assert [(op.kind, op.trips) for op in ops] == [("loop", 4)]
  pred = simulate.simulate(ops, EXACT, 1.0, PEAK / 1e12)
  assert pred.step_s == pytest.approx(4 * 1500 / 1.5e9, rel=1e-3)
  assert hlo_cycles.estimated_cycles(text) == 4 * 1500  # the compiler estimate reads the same trip count  # v5e's clock (the scalar counter ops: HBM time)


def test_a_generation_without_network_figures_is_named():
  target = StepTarget("v4", "v4-8", (2, 2, 1), (False,) * 3, 1, ((0, 0, 0, 0),), {"fsdp": 1}, 1.0)
  with pytest.raises(UserError, match="no network figures for TPU v4"):
    report.predict("HloModule m\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n", target)


def test_v6e_and_tpu7x_have_the_published_network_figures():
  v6e, tpu7x = NETWORKS["v6e"], NETWORKS["tpu7x"]
  assert (v6e.ici_bidirectional, v6e.ici_links, v6e.hbm, v6e.dcn_per_chip) == (800e9, 4, 1638e9, 12.5e9)
  assert v6e.link_one_way == 100e9
  assert (tpu7x.ici_bidirectional, tpu7x.ici_links, tpu7x.hbm, tpu7x.dcn_per_chip) == (1200e9, 6, 7380e9, 12.5e9)
  # Two TensorCores (JAX devices) per tpu7x chip share its HBM and DCN.
  assert (tpu7x.hbm_per_device, tpu7x.dcn_per_device) == (3690e9, 6.25e9)


def tpu7x_line(chips: int = 4) -> StepTarget:
  """`chips` tpu7x chips on an unwrapped line (x), two devices (TensorCores) each, in device order."""
  coords = tuple((x, 0, 0, 0) for x in range(chips) for _ in range(2))
  return StepTarget("tpu7x", f"tpu7x-{2 * chips}", (chips, 1, 1), (False,) * 3, 1, coords, {"fsdp": 2 * chips},
                    model_tflops_per_device=1.0)


def test_a_chips_two_devices_share_its_links_and_talk_on_chip_at_hbm_speed():
  net, target = NETWORKS["tpu7x"], tpu7x_line()
  # 8 devices on 4 chips: each chip's links carry both of its devices' parts of the ring.
  gather = collective_transfer("all-gather", GATHER_BYTES, list(range(8)), target, net)
  assert gather.seconds(EXACT) == pytest.approx(2 * 7 / 8 * GATHER_BYTES / net.link_one_way)
  assert gather.link == "x"
  # One device per chip (the even ids): the ring v5p would run.
  spread = collective_transfer("all-gather", GATHER_BYTES, [0, 2, 4, 6], target, net)
  assert spread.seconds(EXACT) == pytest.approx(3 / 4 * GATHER_BYTES / net.link_one_way)
  # The two TensorCores of one chip: no ICI link between them.
  on_chip = collective_transfer("all-reduce", GATHER_BYTES, [0, 1], target, net)
  assert (on_chip.link, on_chip.seconds(EXACT)) == ("on-chip", pytest.approx(2 * GATHER_BYTES / 2 / net.hbm_per_device))
  assert collective_transfer("collective-permute", GATHER_BYTES, [0, 1], target, net).link == "on-chip"
