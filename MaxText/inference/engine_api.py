"""What a decode engine offers the code that drives it: the server's scheduler, `decode.py`, GRPO's
rollouts and the benchmarks call an engine through `DecodeEngine` and nothing else.

Shape legend: T slots of the decode state, K tokens a step may emit per slot (1; k + 1 for a
speculative round; decode_steps_per_call for a call of several steps on the device), top the
alternatives reported per token.

A request's life: `prefill` + `insert` put a prompt into a free slot (or, where the engine
`prefills_into_pages`, `begin_prompt` then `prefill_chunk` until it returns the first token);
every `decode_step` gives each slot 0..K tokens (`Emitted`); `release` frees the slot. Several
prompts go in together as `prefill`'s rows (then an `insert` per row, or one `InsertsRowsTogether.insert_rows`
for them all where the engine offers it; or prefill and insert in one `PrefillsIntoSlots.prefill_insert` call,
which `prefill_into_slots` picks where offered) or, into pages, as the rows of
`PrefillsRestsTogether.prefill_rests` (unchunked) or `PrefillsChunksTogether.prefill_chunks` (one
chunk budget shared by several prompts) where the engine offers them. The
decode state is the engine's own and opaque to callers: they pass it back as they got it.
Constrained decoding: `prefill`'s `masks`, `prefill_chunk`'s and `decode_step`'s `mask` are int32 token
bitmasks per row / slot ([B or T, W], sampling.apply_token_mask), computed on the host from the
requests' grammars (inference/grammar.py) and applied to the logits on the device; None (the
default) samples as without them, in the same compiled program as before.
Implementations: engine.Engine (dense or paged KV cache), speculative_engine.SpeculativeEngine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np
from flax import struct

from MaxText.inference import image_prompts, sampling

if TYPE_CHECKING:
  from MaxText.configuration.model_config import ModelConfig

# What a caller holds for an engine without looking inside: its parameters (a model's tree, or a
# speculative engine's (target's, draft's)) and its decode state. Each implementation names its own.
EngineParams = Any
EngineState = Any


@struct.dataclass
class TokenLogprobs:
  """What a sampled token scored under the model (temperature 1): see sampling.token_logprobs."""

  chosen_B: Any  # float32 log-probability of the sampled token
  top_ids_Bk: Any  # int32 the most probable tokens, best first
  top_logprobs_Bk: Any  # float32 their log-probabilities


@struct.dataclass
class Emitted:
  """What one decode step gave every slot. One token each: `tokens` [T] and `logprobs` fields [T] /
  [T, top], `counts` None. A speculative round or a call of several steps (or one given
  `StepLimits`): `tokens` [T, K], of which slot t emitted the first counts[t] (0 for a slot that had
  stopped), `logprobs` fields [T, K] / [T, K, top]. May hold device arrays: read it after
  jax.device_get when the host needs the values."""

  tokens: jax.Array | np.ndarray
  logprobs: TokenLogprobs
  counts: jax.Array | np.ndarray | None = None

  def count(self, slot: int) -> int:
    return 1 if self.counts is None else int(self.counts[slot])

  def token(self, slot: int, i: int = 0) -> int:
    return int(self.tokens[slot] if self.counts is None else self.tokens[slot, i])

  def scores(self, slot: int, i: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """The slot's i-th token's log-probability and the most probable alternatives, best first."""
    index = (slot,) if self.counts is None else (slot, i)
    lp = self.logprobs
    return float(lp.chosen_B[index]), [(int(t), float(p)) for t, p in zip(np.asarray(lp.top_ids_Bk[index]),
                                                                         np.asarray(lp.top_logprobs_Bk[index]))]


@struct.dataclass
class Prefilled:
  """What a caller reads of a prefill that went straight into slots (PrefillsIntoSlots): an engine_api.Admitted."""

  first_tokens_B: Any  # [B] the token sampled from each prompt's last position
  first_logprobs: TokenLogprobs


@dataclasses.dataclass(frozen=True)
class StepLimits:
  """Where each slot stops inside a `decode_step` call (checked on the device, after every step):
  a slot steps while its sequence (prompt + generated tokens) is shorter than ends[t] and its latest
  token is none of `stop_ids`; a stopped slot emits nothing more and its state does not move on.
  Host values that stay fixed for a request's life, so the next call can be dispatched before the
  previous one's tokens are read."""

  ends: np.ndarray  # [T] int: prompt length + max new tokens of the slot's request; 0: the slot does not step
  stop_ids: tuple[int, ...] = ()  # end-of-sequence tokens
  # False: no request of the call reads the tokens' top alternatives; the engine may give none (empty
  # arrays) instead of computing them (engine.Engine does: a top-k per step is a large part of a small model's step).
  top_logprobs: bool = True


@dataclasses.dataclass(frozen=True)
class SlotInfo:
  """What a slot holds, as the engine's host side knows it."""

  busy: bool  # a request was put in (insert or begin_prompt) and not released
  prefilling: bool  # its prompt is being prefilled into pages, not yet generating
  pages: int  # KV pages it holds (0 for the dense cache, whose slots own max_target_length each)


class Admitted(Protocol):
  """What `prefill` returns: the engine's own prefix, of which callers read the first sampled tokens."""

  @property
  def first_tokens_B(self) -> jax.Array: ...

  @property
  def first_logprobs(self) -> TokenLogprobs: ...


class DecodeEngine(Protocol):
  """The calls a server, decode.py, the rollouts and the benchmarks make of an engine."""

  @property
  def num_slots(self) -> int: ...

  @property
  def cfg(self) -> ModelConfig:
    """The model's config: max_target_length is each slot's cache length."""

  @property
  def speculative_tokens(self) -> int:
    """k of a speculative engine (a step emits 1..k + 1 tokens per slot); 0 for one token per step."""

  @property
  def prefills_into_pages(self) -> bool:
    """Whether prompts go in through begin_prompt / prefill_chunk instead of prefill + insert."""

  @property
  def prefill_chunk_size(self) -> int:
    """Prompt tokens per prefill_chunk call; 0: the rest of the prompt in one call."""

  @property
  def param_shardings(self) -> EngineParams:
    """Where the engine's parameters live (NamedShardings shaped like them): the target a weight
    copy from another mesh is put onto (rl/rollout_mesh.py)."""

  def init_decode_state(self, seed: int = 0) -> EngineState:
    """A fresh decode state with every slot free (and every page back in the pool)."""

  def prefill(self, params: EngineParams, prompts: Sequence[Sequence[int]], seed: int = 0,
              row_params: Sequence[sampling.RowParams] | None = None,
              images: Sequence[image_prompts.PromptImages | None] | None = None,
              masks: np.ndarray | None = None) -> Admitted: ...

  def insert(self, prefix: Any, state: EngineState, slot: int, row: int = 0) -> EngineState:
    """`state` with prompt `row` of `prefix` (what this engine's `prefill` returned) in slot `slot`."""

  def begin_prompt(self, slot: int, prompt: Sequence[int], images: image_prompts.PromptImages | None = None,
                   cache_key: bytes = b"") -> int:
    """The slot's pages for `prompt`; returns how many leading tokens are already cached (under the
    same `cache_key`: what the cached keys and values depend on beyond the tokens, a LoRA adapter)."""

  def prefill_chunk(self, params: EngineParams, state: EngineState, slot: int, prompt: Sequence[int], start: int,
                    row_params: sampling.RowParams | None = None, seed: int = 0,
                    images: image_prompts.PromptImages | None = None, mask: np.ndarray | None = None
                    ) -> tuple[EngineState, int, tuple[jax.Array, TokenLogprobs] | None]:
    """(state, where the next chunk starts, after the last chunk (first token [1], its TokenLogprobs) else None)."""

  def decode_step(self, params: EngineParams, state: EngineState, active: Sequence[bool] | np.ndarray | None = None,
                  mask: np.ndarray | None = None, limits: StepLimits | None = None) -> tuple[EngineState, Emitted]:
    """Every slot's next token(s); `active` names the slots holding a request (for the engine's metrics);
    `mask` [T, W] the slots' token bitmasks for one step (a constrained slot emits one token in a call of several
    steps, or a speculative round, while the others go on).
    With decode_steps_per_call > 1 counts are given and slots stop on the device at their `limits`;
    with one step per call every slot gets a token and `limits` only keep a slot at its end from
    taking pages; a speculative engine ignores them. Callers drop tokens past a request's end."""

  @property
  def continues_slots(self) -> bool:
    """Whether `hold` and `continue_prompt` append tokens to a slot's context (a multi-turn episode's
    next turn, rl/interleaved_episodes.py) instead of the whole context being prefilled again."""

  def hold(self, slot: int) -> None:
    """The slot keeps what it cached but generates nothing (no page written or taken) until `continue_prompt`."""

  def continue_prompt(self, slot: int, context: Sequence[int]) -> int:
    """A held slot takes `context` (what it holds, then new tokens); returns where `prefill_chunk` starts."""

  def release(self, slot: int) -> None: ...

  def score(self, params: EngineParams, prompt: Sequence[int], images: image_prompts.PromptImages | None = None
            ) -> TokenLogprobs: ...

  def slot(self, slot: int) -> SlotInfo: ...

  def pages_needed(self, num_tokens: int) -> int:
    """KV pages a request holds once `num_tokens` tokens are cached (0: the dense cache)."""

  def admission_pages(self, reserved: Mapping[int, int], prompt: Sequence[int], need: int, text_only: bool) -> int: ...

  def cache_stats(self) -> dict[str, Any]:
    """layout, cache_bytes, pages_total / pages_free / pages_used (0 for the dense cache), ..."""

  def metrics(self) -> dict[str, float]:
    """The engine's counters: step_compilations; a speculative engine's acceptance counts."""


# A prompt's first token among the rows of a call: (first tokens [B], their TokenLogprobs, the prompt's row).
FirstToken = tuple[Any, TokenLogprobs, int]


@runtime_checkable
class InsertsRowsTogether(Protocol):
  """An engine that puts several rows of one `prefill` into their slots in one call (engine.Engine.insert_rows;
  speculative_engine.SpeculativeEngine.insert_rows, one call per model):
  what the scheduler calls for the prompts admitted in one loop, where it made an `insert` each."""

  def insert_rows(self, prefix: Any, state: EngineState, slots: Sequence[int], rows: Sequence[int]) -> EngineState: ...


@runtime_checkable
class PrefillsRestsTogether(Protocol):
  """An engine that prefills into pages and can prefill several begun prompts' rests as the rows of
  one call per piece (engine.Engine.prefill_rests): what the scheduler calls, with prefill_chunk_size 0,
  for the prompts admitted in one loop (with images or not; a recurrent model's too)."""

  def prefill_rests(self, params: EngineParams, state: EngineState, slots: Sequence[int],
                    prompts: Sequence[Sequence[int]], starts: Sequence[int], row_params: Sequence[sampling.RowParams],
                    images: Sequence[image_prompts.PromptImages | None] | None = None,
                    masks: np.ndarray | None = None) -> tuple[EngineState, list[FirstToken]]: ...


@runtime_checkable
class PrefillsChunksTogether(Protocol):
  """An engine with chunked prefill (prefill_chunk_size > 0) that spends one call's chunk budget,
  prefill_chunk_size prompt tokens, on the next chunks of several begun prompts, first come first, as
  the rows of one call (engine.Engine.prefill_chunks; vLLM's chunked prefill likewise fills a step's
  token budget from several requests). Returns each prompt's (where its next chunk starts, after its
  last chunk its FirstToken else None); a prompt the budget did not reach keeps its start."""

  def prefill_chunks(self, params: EngineParams, state: EngineState, slots: Sequence[int],
                     prompts: Sequence[Sequence[int]], starts: Sequence[int], row_params: Sequence[sampling.RowParams],
                     images: Sequence[image_prompts.PromptImages | None] | None = None,
                     masks: np.ndarray | None = None) -> tuple[EngineState, list[tuple[int, FirstToken | None]]]: ...


@runtime_checkable
class PrefillsIntoSlots(Protocol):
  """An engine that prefills prompts and puts prompt i into slots[i] in one device call that takes the decode
  state (engine.Engine.prefill_insert): what the scheduler calls for the prompts it admits in one loop where it
  made a `prefill` and an `insert_rows` (two calls, the prompts' caches returned in between). The prompts past
  len(slots) are padding rows."""

  def prefill_insert(self, params: EngineParams, state: EngineState, prompts: Sequence[Sequence[int]],
                     slots: Sequence[int], seed: int = 0, row_params: Sequence[sampling.RowParams] | None = None,
                     images: Sequence[image_prompts.PromptImages | None] | None = None,
                     masks: np.ndarray | None = None) -> tuple[EngineState, Admitted]: ...


def prefill_into_slots(engine: DecodeEngine, params: EngineParams, state: EngineState,
                       prompts: Sequence[Sequence[int]], slots: Sequence[int],
                       row_params: Sequence[sampling.RowParams]) -> tuple[EngineState, Admitted]:
  """Prompt i into slots[i] (the prompts past len(slots) pad the call), as the rollouts admit their rows:
  one PrefillsIntoSlots call where the engine offers it, else a `prefill` and then one `insert_rows`
  (InsertsRowsTogether) or an `insert` per prompt. The slots' tokens are the same either way."""
  if isinstance(engine, PrefillsIntoSlots):
    return engine.prefill_insert(params, state, prompts, slots, row_params=row_params)
  prefix = engine.prefill(params, prompts, row_params=row_params)
  if isinstance(engine, InsertsRowsTogether):
    return engine.insert_rows(prefix, state, slots, list(range(len(slots)))), prefix
  for row, slot in enumerate(slots):
    state = engine.insert(prefix, state, slot=slot, row=row)
  return state, prefix
