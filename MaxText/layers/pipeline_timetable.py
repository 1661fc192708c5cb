"""The static timetable of the 1F1B pipeline schedule (plain and interleaved), as numpy tables.

P stages, M microbatches, R passes through the stages (`num_pipeline_repeats`), T iterations.
An *item* is one (microbatch, pass) visit of the stage ring. Items are numbered in Megatron's
interleaved order: microbatches go in groups of P, and a group makes all R passes before the
next group starts (item k: group k // PR, pass (k mod PR) // P, microbatch group·P + k mod P).
With R = 1 item k is simply microbatch k.

Forward: stage s runs item t - s at iteration t. An item leaving stage P-1 at t is the item
stage 0 runs at t + 1 (the same microbatch's next pass, P items later), so passes chain through
the activation rotation with no waiting buffer. That is why R > 1 needs M divisible by P.

Backward: items are numbered the same way over backward passes q = R-1-pass; stage P-1 runs
backward item j at iteration D + j and stage s at D + j + P-1-s, so gradients rotate down the
stages and wrap from stage 0 of one pass to stage P-1 of the previous, again without waiting.
D = R·P - 1 is the first iteration at which a microbatch's last pass leaves stage P-1: its loss
is computed then and its backward starts at once (the head and stage P-1 meet in the same
iteration for every microbatch).

Iterations [0, D) only run forwards, [M·R + P - 1, T) only backwards, T = D + M·R + P - 1, so the
time is (M·R + P - 1)·(F + B) with F, B one stage-pass: the interleaved bubble (P-1)/(M·R + P-1).
Each stage keeps an item's input from its forward to its backward; slots of that ring are
assigned here (greedy interval colouring, which is optimal), so the ring holds the most inputs
ever alive at once on any stage: min(M, 2P - 1) for R = 1, about (R + 1)·P - 1 when M >= 2P.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
  import jax

# An iteration or item number: a Python int when the table is built, a traced array in the loop.
Index = TypeVar("Index", int, "jax.Array")


@dataclasses.dataclass(frozen=True)
class Timetable:
  """Per-iteration tables; [T, P] arrays are indexed by (iteration, stage)."""
  num_stages: int
  num_micro: int
  num_repeats: int
  num_slots: int  # ring slots per stage
  warmup_end: int  # forwards only before this iteration (= D)
  steady_end: int  # forwards and backwards before this, backwards only from here to T
  fwd_valid: np.ndarray  # [T, P] bool
  fwd_micro: np.ndarray  # [T, P] int32
  fwd_pass: np.ndarray  # [T, P] int32
  fwd_slot: np.ndarray  # [T, P] int32: ring slot the stage's input is stored in
  feed_from_inputs: np.ndarray  # [T] bool: stage 0 starts a microbatch's first pass
  head_valid: np.ndarray  # [T] bool: a microbatch's last pass leaves stage P-1 (loss, then backward)
  head_micro: np.ndarray  # [T] int32
  bwd_valid: np.ndarray  # [T, P] bool
  bwd_micro: np.ndarray  # [T, P] int32
  bwd_pass: np.ndarray  # [T, P] int32
  bwd_slot: np.ndarray  # [T, P] int32: ring slot holding the input of the item being differentiated

  @property
  def num_iterations(self) -> int:
    return self.fwd_valid.shape[0]

  def rows(self) -> dict[str, np.ndarray]:
    """The per-iteration tables, for `lax.scan`'s xs."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)}


def item(k: int, num_stages: int, num_repeats: int) -> tuple[int, int]:
  """Item number -> (microbatch, pass) in the grouped order."""
  group, within = divmod(k, num_stages * num_repeats)
  pass_, lane = divmod(within, num_stages)
  return group * num_stages + lane, pass_


def item_number(micro: int, pass_: int, num_stages: int, num_repeats: int) -> int:
  group, lane = divmod(micro, num_stages)
  return group * num_stages * num_repeats + pass_ * num_stages + lane


def first_pass_micro(t: Index, num_stages: int, num_repeats: int) -> Index:
  """The microbatch of item t (int or array): stage 0 feeds it from the inputs when its pass is 0."""
  return t // (num_stages * num_repeats) * num_stages + t % num_stages


@functools.lru_cache(maxsize=32)  # the start-up log line and the traced loop ask for the same table
def build(num_stages: int, num_micro: int, num_repeats: int = 1) -> Timetable:
  s_count, m_count, r_count = num_stages, num_micro, num_repeats
  if r_count > 1 and m_count % s_count:
    raise ValueError(f"interleaved 1F1B needs the microbatches ({m_count}) to be a multiple of the stages ({s_count})")
  items = m_count * r_count
  first_backward = r_count * s_count - 1
  total = first_backward + items + s_count - 1
  shape = (total, s_count)
  t = {name: np.zeros(shape, np.int32) for name in ("fwd_micro", "fwd_pass", "fwd_slot", "bwd_micro", "bwd_pass",
                                                    "bwd_slot")}
  fwd_valid, bwd_valid = np.zeros(shape, bool), np.zeros(shape, bool)
  feed, head_valid, head_micro = np.zeros(total, bool), np.zeros(total, bool), np.zeros(total, np.int32)

  def backward_iteration(k: int, stage: int) -> int:
    micro, pass_ = item(k, s_count, r_count)
    j = item_number(micro, r_count - 1 - pass_, s_count, r_count)
    return first_backward + j + s_count - 1 - stage

  num_slots = 0
  for stage in range(s_count):
    # Items reach a stage in order k = 0, 1, ...; a slot frees after the item's backward read.
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (iteration of the backward read, slot)
    used = 0
    for k in range(items):
      start = k + stage
      while busy and busy[0][0] < start:  # the forward write comes before the backward read in an iteration
        heapq.heappush(free, heapq.heappop(busy)[1])
      if free:
        slot = heapq.heappop(free)
      else:
        slot, used = used, used + 1
      end = backward_iteration(k, stage)
      heapq.heappush(busy, (end, slot))
      micro, pass_ = item(k, s_count, r_count)
      fwd_valid[start, stage] = True
      t["fwd_micro"][start, stage], t["fwd_pass"][start, stage], t["fwd_slot"][start, stage] = micro, pass_, slot
      bwd_valid[end, stage] = True
      t["bwd_micro"][end, stage], t["bwd_pass"][end, stage], t["bwd_slot"][end, stage] = micro, pass_, slot
      if stage == 0 and pass_ == 0:
        feed[start] = True
      if stage == s_count - 1 and pass_ == r_count - 1:
        head_valid[start], head_micro[start] = True, micro
    num_slots = max(num_slots, used)
  return Timetable(num_stages=s_count, num_micro=m_count, num_repeats=r_count, num_slots=num_slots,
                   warmup_end=first_backward, steady_end=items + s_count - 1, fwd_valid=fwd_valid,
                   feed_from_inputs=feed, head_valid=head_valid, head_micro=head_micro, bwd_valid=bwd_valid, **t)
