"""What a request's sampling is, without JAX: the strategies, a decode run's `SamplingParams`, a
serving row's `RowParams`, how many top alternatives a position reports, and the width of a
constrained row's token bitmask. The HTTP front-end processes (serve_frontend.py) parse requests
into these without loading JAX; sampling.py computes with them on the device."""

from __future__ import annotations

import dataclasses

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  strategy: str = "greedy"  # one of STRATEGIES
  temperature: float = 1.0  # logits are divided by this before weighted / nucleus / top-k sampling
  top_p: float = 0.9  # nucleus: smallest set of tokens whose probability mass reaches this
  top_k: int = 40  # topk: sample among the k most probable tokens


# Each decode slot carries its own request's temperature, top-p, top-k and PRNG key as arrays, so
# one compiled step samples every slot by its own rules. temperature 0 is greedy; top_k 0 and
# top_p 1 keep every token.
NUM_TOP_LOGPROBS = 5  # alternatives reported per position (OpenAI's completions allow at most 5)
# A row's seed becomes its PRNG key as a uint32 (decode_state.row_sampling): a request's seed must be in
# [0, SEED_LIMIT), where distinct seeds give distinct keys.
SEED_LIMIT = 2**32


@dataclasses.dataclass(frozen=True)
class RowParams:
  """One request's sampling: what the OpenAI API calls temperature, top_p, top_k and seed."""
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  adapter: int = 0  # the LoRA adapter's row in the engine's adapter table (inference/lora_adapters.py); 0: none

  @classmethod
  def from_strategy(cls, params: SamplingParams, seed: int) -> "RowParams":
    """The per-row form of a decode_sampling_strategy (what decode.py's keys ask for)."""
    if params.strategy == "greedy":
      return cls(0.0, 1.0, 0, seed)
    top_p = params.top_p if params.strategy == "nucleus" else 1.0
    top_k = params.top_k if params.strategy == "topk" else 0
    return cls(params.temperature, top_p, top_k, seed)


# A mask is a bitmask per row, int32 [B, W] with W * 32 > V: bit v of word v // 32 set = token v allowed.
# The host computes it (inference/grammar.py) and the device expands it (sampling.allowed_tokens); a row
# of all ones (-1) is unconstrained. A constrained row always has a bit past the vocabulary clear (W * 32
# > V), so sampling.constrained_rows tells it apart even when every real token is allowed.
ALL_TOKENS = -1  # a mask word with every bit set


def mask_words(vocab_size: int) -> int:
  """W: mask words per row, with at least one bit past the vocabulary."""
  return vocab_size // 32 + 1
