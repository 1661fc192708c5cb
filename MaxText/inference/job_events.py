"""What the scheduler (scheduler.py) tells a job's handler, without JAX: its new tokens, a prompt's scores,
the end; and why it refuses jobs. The HTTP routes read these in the engine's process and in the
front-end processes (serve_frontend.py), which receive them pickled from the engine's."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol, Sequence


class QueueFull(Exception):
  """More jobs than free slots plus serve_max_queue: the caller answers 503 with Retry-After."""


class TooLarge(Exception):
  """A job that needs more KV pages than the whole pool, or more tokens than a slot's cache holds: it could never
  be served (a 400)."""


@dataclasses.dataclass
class Tokens:
  """A run of one job's new tokens, in order: what one engine call gave it (one event per job and
  call, not per token: each event costs the scheduler thread, the event loop and, in a front end,
  a pickle)."""

  index: int  # the job's choice index
  tokens: list[int]
  logprobs: list[float]  # each token's log-probability
  tops: list[list[tuple[int, float]]]  # each token's most probable alternatives, best first ([] when not asked)


@dataclasses.dataclass
class PromptScores:
  index: int
  logprobs: list[float]  # of prompt token i given tokens < i; entry 0 has no context (reported as None)
  top: list[list[tuple[int, float]]]


@dataclasses.dataclass
class Done:
  index: int
  reason: str  # "length" | "stop" (an end-of-sequence token) | "cancelled" | "error"
  message: str = ""


Event = Tokens | PromptScores | Done


class JobHandle(Protocol):
  """What a request's handler holds of each of its jobs: a scheduler.Job in the engine's process, a
  serve_frontend proxy in a front end."""

  submitted: float  # time.monotonic() at submit (in the handler's process)

  def cancel(self) -> None:
    """Asks the scheduler to end the job (a stop sequence found, a client gone, a deadline)."""


# ---------------------------------------------------------------- which of a request's jobs score its prompt
def prompt_owners(choices: Iterable[tuple[int, Sequence[int]]]) -> dict[int, int]:
  """(index, prompt) of a request's choices -> each index to that of the first choice with the same prompt. With
  echo and logprobs only that choice's job scores the prompt and the others share its scores (serve_routes._units):
  the same tokens score the same, so a prompt's n choices (or a prompt listed twice) need one scoring pass."""
  first: dict[tuple[int, ...], int] = {}
  return {index: first.setdefault(tuple(prompt), index) for index, prompt in choices}


def scoring(choices: Sequence[tuple[int, Sequence[int]]], score_prompt: bool) -> list[bool]:
  """Whether each of a request's choices ((index, prompt)) has its job score the prompt: with score_prompt, the first
  with each prompt (prompt_owners)."""
  owners = prompt_owners(choices) if score_prompt else {}
  return [owners.get(index) == index for index, _ in choices]
