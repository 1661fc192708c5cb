"""Speculative decoding behind the engine interface the scheduler and decode.py use.

`SpeculativeEngine` wraps a `speculative.SpeculativeDecoder` (a target Engine and a draft Engine)
and is an engine_api.DecodeEngine (prefill, insert, begin_prompt, prefill_chunk, release, score,
pages and cache figures) whose `decode_step` is a round: 1 to k + 1 tokens per slot. Its
`params` are the pair (target's, draft's), which the scheduler passes along without looking inside.

Both engines share every decode and cache key (config.draft_config), so their page allocators see
the same prompts, lengths and rounds; admission reserves for the k + 1 positions a round writes
past the pending token (pages_needed adds k), in both pools. With chunked prefill or prefix
caching each engine prefills into its own pages from where its own cache stops; the target's
first token is the slot's pending token for both (the round reads the target's).

`load` picks what a tool serves: a plain Engine when speculative_tokens is 0, else this over the
target and the draft named by draft_model_name / draft_load_parameters_path, or, with no draft
named and a model with MTP heads (mtp_num_layers > 0), over mtp_draft.MtpSpeculativeDecoder (whose
prompts are prefilled whole: no chunked prefill, no shared prefix pages).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from MaxText.configuration.config import Config, draft_config
from MaxText.errors import UserError
from MaxText.inference import image_prompts, mtp_draft, sampling, speculative
from MaxText.inference.decode_state import Prefix
from MaxText.training.model_assembly import Params
from MaxText.inference.engine import Engine, load_engine, refuse_mtp_speculative
from MaxText.inference.engine_api import DecodeEngine, Emitted, Prefilled, SlotInfo, StepLimits, TokenLogprobs
from MaxText.paths import storage
from MaxText.platform import distributed


@dataclasses.dataclass
class SpeculativePrefix:
  """Both models' prefills of the same prompts; what a caller reads is the target's."""

  target: Prefix
  draft: Any  # the draft model's Prefix, or mtp_draft.MtpDraft

  @property
  def first_tokens_B(self) -> jax.Array:
    return self.target.first_tokens_B

  @property
  def first_logprobs(self) -> TokenLogprobs:
    return self.target.first_logprobs

  @property
  def next_positions_B(self) -> jax.Array:
    return self.target.next_positions_B


class SpeculativeEngine:
  """engine_api.DecodeEngine over a SpeculativeDecoder (a step is a round); params = (target's, draft's)."""

  def __init__(self, decoder: speculative.SpeculativeDecoder | mtp_draft.MtpSpeculativeDecoder):
    self.decoder, self.target, self.draft = decoder, decoder.target, decoder.draft
    self.speculative_tokens = decoder.k
    self.num_slots, self.cfg, self.decode_cfg = self.target.num_slots, self.target.cfg, self.target.decode_cfg
    self.vocab_size, self.spec = self.target.vocab_size, self.target.spec
    # Its parameters are (the target's, the draft model's or None): their shardings likewise.
    self.param_shardings = (self.target.param_shardings,
                            None if self.draft is None else self.draft.param_shardings)
    # The MTP draft prefills prompts whole (its module runs over them): no chunks, no prefix pages.
    self.prefills_into_pages = self.target.prefills_into_pages and self.draft is not None
    self._draft_done: dict[int, int] = {}  # slot -> prompt tokens the draft has cached (chunked prefill)

  # ---------------------------------------------------------------- state and pages
  def init_decode_state(self, seed: int = 0) -> Any:
    """The decoder's state (speculative.SpeculativeState, or mtp_draft.MtpState)."""
    self._draft_done.clear()
    return self.decoder.init_decode_state(seed)

  def pages_needed(self, num_tokens: int) -> int:
    """Pages a request holds at its end: a round writes k positions past the last token it keeps."""
    return self.target.pages_needed(num_tokens + self.speculative_tokens)

  def admission_pages(self, reserved: Mapping[int, int], prompt: Sequence[int], need: int, text_only: bool) -> int:
    if not self.prefills_into_pages:  # every prompt gets pages of its own: nothing is shared
      return self.target.admission_pages(reserved, [], need, text_only)
    return max(engine.admission_pages(reserved, prompt, need, text_only) for engine in self._engines())

  def cache_stats(self) -> dict[str, Any]:
    """The target's figures (its pool is the one admission counts), cache_bytes of both models."""
    stats = self.target.cache_stats()
    decoder = self.decoder
    draft_bytes = (decoder.cache_bytes if isinstance(decoder, mtp_draft.MtpSpeculativeDecoder)
                   else decoder.draft.cache_stats()["cache_bytes"])
    return {**stats, "cache_bytes": stats["cache_bytes"] + draft_bytes}

  def _engines(self) -> tuple[Engine, ...]:
    return (self.target,) if self.draft is None else (self.target, self.draft)

  def metrics(self) -> dict[str, float]:
    return {**self.decoder.metrics(), "step_compilations": self.decoder.traces["round"]}

  @property
  def prefill_chunk_size(self) -> int:
    return self.target.prefill_chunk_size

  def slot(self, slot: int) -> SlotInfo:
    return self.target.slot(slot)

  # ---------------------------------------------------------------- requests
  def score(self, params: tuple[Params, Params], prompt: Sequence[int],
            images: image_prompts.PromptImages | None = None) -> TokenLogprobs:
    return self.target.score(params[0], prompt, images)

  def prefill(self, params: tuple[Params, Params], prompts: Sequence[Sequence[int]], seed: int = 0,
              row_params: Sequence[sampling.RowParams] | None = None,
              images: Sequence[image_prompts.PromptImages | None] | None = None,
              masks: np.ndarray | None = None) -> SpeculativePrefix:
    _text_only(images)
    return SpeculativePrefix(*self.decoder.prefill(params[0], params[1], prompts, seed, row_params, masks))

  def insert(self, prefix: SpeculativePrefix, state: Any, slot: int, row: int = 0) -> Any:
    return self.decoder.insert((prefix.target, prefix.draft), state, slot, row)

  def insert_rows(self, prefix: SpeculativePrefix, state: Any, slots: Sequence[int], rows: Sequence[int]) -> Any:
    """engine_api.InsertsRowsTogether: rows[i] of both models' prefills in slots[i], one call per model."""
    return self.decoder.insert_rows((prefix.target, prefix.draft), state, slots, rows)

  def prefill_insert(self, params: tuple[Params, Params], state: Any, prompts: Sequence[Sequence[int]],
                     slots: Sequence[int], seed: int = 0, row_params: Sequence[sampling.RowParams] | None = None,
                     images: Sequence[image_prompts.PromptImages | None] | None = None,
                     masks: np.ndarray | None = None) -> tuple[Any, Prefilled]:
    """engine_api.PrefillsIntoSlots: both models' prefills into slots[i] in one call."""
    _text_only(images)
    return self.decoder.prefill_insert(params[0], params[1], state, prompts, slots, seed, row_params, masks)

  def begin_prompt(self, slot: int, prompt: Sequence[int], images: image_prompts.PromptImages | None = None,
                   cache_key: bytes = b"") -> int:
    """Both engines' pages for the prompt; where the target's prefill starts (the draft keeps its own)."""
    _text_only([images])
    start = self.target.begin_prompt(slot, prompt, cache_key=cache_key)
    assert self.draft is not None  # prefills_into_pages
    try:
      self._draft_done[slot] = self.draft.begin_prompt(slot, prompt, cache_key=cache_key)
    except Exception:
      self.target.release(slot)
      raise
    return start

  def prefill_chunk(self, params: tuple[Params, Params], state: speculative.SpeculativeState, slot: int,
                    prompt: Sequence[int], start: int, row_params: sampling.RowParams | None = None, seed: int = 0,
                    images: image_prompts.PromptImages | None = None, mask: np.ndarray | None = None
                    ) -> tuple[speculative.SpeculativeState, int, tuple[jax.Array, TokenLogprobs] | None]:
    """The target's next chunk (`mask`: the first token's bitmask), and the draft's chunks until its cache
    reaches as far."""
    _text_only([images])
    assert self.draft is not None  # prefills_into_pages
    target, end, first = self.target.prefill_chunk(params[0], state.target, slot, prompt, start, row_params, seed,
                                                   mask=mask)
    draft, done = state.draft, self._draft_done.get(slot, 0)
    while done < end or (first is not None and done < len(prompt)):
      draft, done, _ = self.draft.prefill_chunk(params[1], draft, slot, prompt, done, row_params, seed)
    self._draft_done[slot] = done
    return speculative.SpeculativeState(target, draft), end, first

  def speculative_round(self, params: tuple[Params, Params], state: Any, active: Sequence[bool] | np.ndarray
                        ) -> tuple[Any, np.ndarray, np.ndarray, TokenLogprobs]:
    """One round: (state, tokens [T, k + 1], counts [T], their target log-probabilities); slot t
    emitted tokens[t, :counts[t]]. `active`: the slots the acceptance counters count."""
    return self.decoder.scored_step(params[0], params[1], state, active)

  def decode_step(self, params: tuple[Params, Params], state: Any, active: Sequence[bool] | np.ndarray | None = None,
                  mask: np.ndarray | None = None, limits: StepLimits | None = None) -> tuple[Any, Emitted]:
    """`speculative_round` as engine_api.Emitted (tokens [T, k + 1], counts [T]); `limits` are not needed
    (the caller cuts a round's tokens; decode_steps_per_call > 1 is refused with speculative_tokens).
    `mask`: token bitmasks [T, W]; a constrained slot emits one token a round, drawn from the target
    under its mask (speculative.verify)."""
    state, tokens_TK, counts_T, logprobs = self.decoder.scored_step(params[0], params[1], state, active, mask)
    return state, Emitted(tokens_TK, logprobs, counts_T)

  def release(self, slot: int) -> None:
    self._draft_done.pop(slot, None)
    self.decoder.release(slot)

  # A draft model's cache and the target's would both have to grow: the rollouts prefill contexts whole.
  continues_slots = False

  def hold(self, slot: int) -> None:
    raise ValueError("a speculative engine does not hold slots (continues_slots is False)")

  def continue_prompt(self, slot: int, context: Sequence[int]) -> int:
    raise ValueError("a speculative engine does not continue slots (continues_slots is False)")


def _text_only(images: Sequence[image_prompts.PromptImages | None] | None) -> None:
  """check_draft refuses a vision-language model, so images never reach a speculative engine."""
  if images is not None and any(row is not None for row in images):
    raise UserError("speculative decoding (speculative_tokens > 0) is for text prompts: set speculative_tokens=0")


def check_draft(config: Config) -> None:
  """speculative_tokens > 0 needs a draft: a named one, or the target's MTP heads."""
  d = config.decode
  if d.speculative_tokens <= 0:
    return
  if config.model.vision.use_multimodal:
    raise UserError("speculative decoding (speculative_tokens > 0) is for text models; this one has "
                    "use_multimodal=True: set speculative_tokens=0")
  named = d.draft_model_name or d.draft_load_parameters_path
  if not named and config.model.mtp.mtp_num_layers > 0:
    refuse_mtp_speculative(config.model)
  if not named and config.model.mtp.mtp_num_layers == 0:
    raise UserError(f"speculative_tokens={d.speculative_tokens} needs a draft model: set draft_model_name=<a "
                    "configs/models name> (draft_overrides=key=value,... to resize it) and/or "
                    "draft_load_parameters_path=<its checkpoint>, use a model with MTP heads (mtp_num_layers > 0), "
                    "or set speculative_tokens=0")
  if d.draft_load_parameters_path and not storage.exists(d.draft_load_parameters_path):
    raise UserError(f"draft checkpoint {d.draft_load_parameters_path} does not exist (draft_load_parameters_path)")


def load(config: Config, num_slots: int, fresh_note: str, mesh: Mesh | None = None
         ) -> tuple[DecodeEngine, tuple[Params, Params | None] | Params]:
  """The engine a tool decodes with and its parameters: a plain Engine (speculative_tokens=0), else
  a SpeculativeEngine over the target and its draft, parameters (target's, draft's)."""
  check_draft(config)
  if config.decode.draft_model_name or config.decode.draft_load_parameters_path:
    if config.decode.speculative_tokens == 0:
      distributed.log("note: a draft model is named but speculative_tokens=0: decoding without it")
  if config.decode.speculative_tokens == 0:
    return load_engine(config, num_slots, fresh_note, mesh)
  if not (config.decode.draft_model_name or config.decode.draft_load_parameters_path):  # the MTP heads
    target, target_params = load_engine(config, num_slots, fresh_note, mesh)
    return SpeculativeEngine(mtp_draft.MtpSpeculativeDecoder(target, config.decode.speculative_tokens)), \
        (target_params, None)
  draft_cfg = named_draft_config(config)
  target, target_params = load_engine(config, num_slots, fresh_note, mesh)
  engine, draft_params = with_named_draft(draft_cfg, target, config.decode.speculative_tokens)
  return engine, (target_params, draft_params)


def named_draft_config(config: Config) -> Config:
  """The named draft's config (every mistake in its keys found before anything loads)."""
  draft_cfg = draft_config(config)
  if draft_cfg.model.vocab_size != config.model.vocab_size:
    raise UserError(f"the draft model's vocab_size ({draft_cfg.model.vocab_size}) differs from the target's "
                    f"({config.model.vocab_size}): speculative decoding needs a draft with the target's tokenizer")
  return draft_cfg


def with_draft(config: Config, target: Engine) -> tuple[SpeculativeEngine, Params | None]:
  """A SpeculativeEngine over `target` (a plain or an adapter-table engine) and its draft: the named draft
  model, else the target's MTP heads (draft parameters None: they are the target's); the draft's parameters."""
  check_draft(config)
  k = config.decode.speculative_tokens
  if config.decode.draft_model_name or config.decode.draft_load_parameters_path:
    return with_named_draft(named_draft_config(config), target, k)
  return SpeculativeEngine(mtp_draft.MtpSpeculativeDecoder(target, k)), None


def with_named_draft(draft_cfg: Config, target: Engine, k: int) -> tuple[SpeculativeEngine, Params]:
  """A SpeculativeEngine over `target` (a plain or an adapter-table engine) and the draft of `draft_cfg`
  (its parameters loaded on the target's mesh), and the draft's parameters."""
  try:
    draft, draft_params = load_engine(draft_cfg, target.num_slots,
                                      "speculative: no draft_load_parameters_path given; the draft has randomly "
                                      "initialised parameters", target.mesh)
  except UserError as e:  # the target's keys (quantize_weights_block, ...) apply to the draft too: say whose model
    raise UserError(f"the draft model (draft_model_name / draft_load_parameters_path): {e}") from None
  return SpeculativeEngine(speculative.SpeculativeDecoder(target, draft, k)), draft_params
