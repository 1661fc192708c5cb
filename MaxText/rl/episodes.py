"""Multi-turn GRPO episodes: the model and an environment (rl/environments.py) take turns until the
environment ends the episode or a limit does.

    record ─► env.start() messages ─► chat template (+ the env's tools) ─► prompt ids
      ┌─► the model's turn: the engine samples from [prompt + everything so far] until its end token
      │     ─► tool calls parsed (inference/tool_calls.py) ─► env.step(turn): messages, reward, done
      └── the env's messages rendered by the chat template and appended (not trained on)

Episodes run in batch by turn: each turn the engine decodes the open episodes together (one slot
each), then every open episode's `step` runs at once on threads of its own (Guarded), then the
next turn prefills the grown contexts. An episode ends when its environment says so (`done`), after
rl_max_turns model turns (`turns`), or when the next turn's context would pass
max_prefill_predict_length or leave no token within rl_max_episode_tokens (`tokens`). Messages longer
than the characters that many tokens can spell are cut before they are tokenised (`Renderer.within`),
so a tool that returns megabytes costs what fits, not what it wrote. A model turn
cut at max_completion_length is the environment's to judge (ModelTurn.ended is False); if the
episode goes on, the template's closing of that turn (its end token) is context, not the model's. The episode's tokens are kept exactly as the engine saw
them, with a mask of which the model sampled: training_rows weighs only those, so the trainer
scores the rollout's own context and the loss and the KL see the model's tokens alone.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import weakref
from typing import Any, Callable, Mapping, Sequence

from MaxText.configuration.rl_config import RLConfig
from MaxText.errors import UserError
from MaxText.inference import sampling
from MaxText.input_pipeline import chat
from MaxText.rl import calculator, environments
from MaxText.rl.environments import Message, ModelTurn

# (contexts, each one's sampling parameters, the most new tokens) -> (each context's new tokens, ending
# with the end-of-sequence token when it ended; the engine's log-probability of each)
Generate = Callable[[list[list[int]], list[sampling.RowParams], int], tuple[list[list[int]], list[list[float]]]]
ENDINGS = ("done", "turns", "tokens")


@dataclasses.dataclass(frozen=True)
class Limits:
  max_turns: int  # model turns per episode (rl_max_turns)
  max_turn_tokens: int  # tokens per model turn (max_completion_length)
  max_context: int  # the longest context a model turn starts from (max_prefill_predict_length)
  max_episode_tokens: int  # the prompt and every turn (rl_max_episode_tokens, else max_target_length + 1)

  @classmethod
  def of(cls, rl: RLConfig, max_prefill_predict_length: int, max_target_length: int) -> "Limits":
    return cls(rl.rl_max_turns, rl.max_completion_length, max_prefill_predict_length,
               rl.rl_max_episode_tokens or max_target_length + 1)


@dataclasses.dataclass
class Episode:
  index: int  # the prompt record
  prompt_ids: list[int]  # the opening messages rendered, with the generation prompt
  messages: list[Message]  # the conversation so far (the model's turns as assistant messages)
  tools: list[dict[str, Any]] | None
  tokens: list[int] = dataclasses.field(default_factory=list)  # after the prompt: every turn, as the engine saw it
  model_mask: list[bool] = dataclasses.field(default_factory=list)  # per token: sampled by the model
  logps: list[float] = dataclasses.field(default_factory=list)  # per token: the engine's log-prob (0: not the model's)
  reward: float = 0.0  # the environment's contributions, summed
  turns: int = 0  # model turns taken
  last_text: str = ""  # the last model turn, decoded
  last_ids: list[int] = dataclasses.field(default_factory=list)  # its tokens
  last_ended: bool = False  # it ended with the end-of-sequence token (else cut at max_completion_length)
  end: str = ""  # one of ENDINGS once it ended

  @property
  def model_tokens(self) -> int:
    return sum(self.model_mask)


def environment_for(rl: RLConfig) -> environments.Guarded:
  """The run's environment: the built-in calculator or the `package.module:Name` of rl_environment."""
  name = rl.rl_environment
  factory = calculator.factory(rl.rl_answer_column) if name == "calculator" else environments.load(name)
  return environments.Guarded(name, factory, rl.rl_environment_timeout_seconds)


class Renderer:
  """Messages to token ids through the chat template; `continuation` is what appending messages adds
  after a model turn that ended with the end-of-sequence token."""

  def __init__(self, tokenizer: chat.ChatTokenizer, eos_id: int | None):
    self.tokenizer = tokenizer
    self.eos_text = tokenizer.decode([eos_id], skip_special_tokens=False) if eos_id is not None else ""
    self.token_chars = longest_token(tokenizer)

  def within(self, messages: list[Message], tokens: int) -> tuple[list[Message], bool]:
    """`messages` with their contents cut past the characters `tokens` + 1 tokens can spell (the longest
    token's each), and whether any was cut. Contents past that need more tokens than fit whatever the
    template adds, so the episode ends as it would have, without tokenising them. A cut content ends with
    a note of the cut, which fits only where the template or tokenizer drops text."""
    if self.token_chars is None:
      return messages, False
    left, out, cut = (max(tokens, 0) + 1) * self.token_chars, [], False
    for message in messages:
      content = message["content"]
      if len(content) > left:
        message = {**message, "content": content[:left] + f" [{len(content) - left} characters cut: past the "
                                                         "episode's token limit]"}
        cut = True
      left = max(0, left - len(content))
      out.append(message)
    return out, cut

  def text(self, messages: list[Message], tools: list[dict[str, Any]] | None, generation_prompt: bool,
           guard: chat.ContentGuard | None = None) -> str:
    """`guard` (chat.ContentGuard): a special token's spelling in a message (a tool's output) stays text."""
    what = f"an episode's messages (roles {', '.join(str(m.get('role')) for m in messages)})"
    if guard is not None:
      messages, tools = guard.hide(messages), guard.hide(tools)
    return chat.render(self.tokenizer, messages, generation_prompt, tools, what=what)

  def ids(self, text: str, guard: chat.ContentGuard | None = None) -> list[int]:
    if guard is not None:
      return guard.encode(self.tokenizer, text)[0]
    return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

  def continuation(self, messages: list[Message], new: list[Message], tools: list[dict[str, Any]] | None,
                   index: int, ended: bool = True) -> list[int]:
    """The tokens after the model's last one: the rest of its turn as the template closes it (from its
    end token on when the model did not write it, `ended` False), the new messages and the next
    generation prompt."""
    guard = chat.ContentGuard(self.tokenizer, messages, new, tools)
    before = self.text(messages, tools, False, guard)
    after = self.text(messages + new, tools, True, guard)
    if not after.startswith(before):
      raise UserError(f"prompt record {index}: the chat template renders the episode differently once the "
                      "environment's messages are appended (the earlier text changes), so the model's context "
                      "cannot grow turn by turn; use a template that renders each message on its own")
    prefix, reply = self.text(messages[:-1], tools, True, guard), guard.hide(messages[-1]["content"])
    if before.startswith(prefix + reply):
      closing = before[len(prefix + reply):]
    else:  # the template rewrites the reply (trims it): its turn closes at its last end token
      at = before.rfind(self.eos_text) if self.eos_text else -1
      closing = before[at:] if at >= 0 else ""
    if ended and self.eos_text and closing.startswith(self.eos_text):
      closing = closing[len(self.eos_text):]  # the model wrote it: it is in the context already
    return self.ids(closing + after[len(before):], guard)


_LONGEST: "weakref.WeakKeyDictionary[Any, int | None]" = weakref.WeakKeyDictionary()
_LONGEST_LOCK = threading.Lock()


def longest_token(tokenizer: Any) -> int | None:
  """The most characters one token's vocabulary entry has (an upper bound on the text it covers: a
  byte-level entry is a character per byte), per tokenizer; None without a vocabulary to read."""
  with _LONGEST_LOCK:
    if tokenizer in _LONGEST:
      return _LONGEST[tokenizer]
    vocab = tokenizer.get_vocab() if callable(getattr(tokenizer, "get_vocab", None)) else None
    longest = (max(map(len, vocab), default=0) or None) if isinstance(vocab, Mapping) else None
    try:
      _LONGEST[tokenizer] = longest
    except TypeError:  # not weakly referable: read again next time
      pass
    return longest


@dataclasses.dataclass
class Timing:
  generate_s: float = 0.0
  environment_s: float = 0.0  # waiting for the environment with nothing to decode
  decode_steps: int = 0  # the engine's decode calls
  overlapped_steps: int = 0  # of which taken while an environment call ran (interleaved episodes)


def open_episodes(env: environments.Guarded, renderer: Renderer, records: Sequence[tuple[int, Any, Mapping[str, Any]]],
                  limits: Limits, timing: Timing) -> tuple[list[Any], list[Episode]]:
  """Each record's episode object (the environment's) and its Episode, opened by `start`'s messages."""
  indices = [index for index, _, _ in records]
  started = time.perf_counter()
  objects = env.episodes([{**columns, "prompt": prompt} for _, prompt, columns in records], indices)
  openings = env.opening(objects, indices)
  timing.environment_s += time.perf_counter() - started
  episodes = []
  room = min(limits.max_context, limits.max_episode_tokens - 1)
  for obj, opening, index in zip(objects, openings, indices):
    tools = env.tools(obj, index)
    opening, cut = renderer.within(opening, room)
    guard = chat.ContentGuard(renderer.tokenizer, opening, tools)
    ids = renderer.ids(renderer.text(opening, tools, True, guard), guard)
    size = f"over {room}" if cut else f"{len(ids)}"
    if not 1 <= len(ids) <= limits.max_context:
      raise UserError(f"prompt record {index}: the environment's opening messages are {size} tokens; an episode "
                      f"must start with 1 to max_prefill_predict_length={limits.max_context} (raise it or shorten them)")
    if len(ids) >= limits.max_episode_tokens:  # else the first turn's budget (turn_budget) is not positive
      raise UserError(f"prompt record {index}: the environment's opening messages are {size} tokens, which leaves "
                      f"the model no token within rl_max_episode_tokens={limits.max_episode_tokens}; raise it"
                      f"{'' if cut else f' above {len(ids)}'} (0 = max_target_length + 1) or shorten the opening")
    episodes.append(Episode(index, ids, opening, tools))
  return objects, episodes


def turn_budget(episode: Episode, limits: Limits) -> int:
  """The most tokens the episode's next model turn may sample."""
  return min(limits.max_turn_tokens, limits.max_episode_tokens - len(episode.prompt_ids) - len(episode.tokens))


def record_turn(episode: Episode, out: Sequence[int], logps: Sequence[float], tokenizer: chat.ChatTokenizer,
                eos_id: int | None) -> ModelTurn:
  """The episode grown by a model turn's sampled tokens (each with the engine's log-prob); the turn
  as its environment's `step` gets it."""
  ended = bool(out) and out[-1] == eos_id
  episode.tokens += out
  episode.model_mask += [True] * len(out)
  episode.logps += [float(p) for p in logps[:len(out)]]
  episode.last_ids = list(out)
  episode.last_text = tokenizer.decode(list(out[:-1]) if ended else list(out), skip_special_tokens=True)
  episode.turns += 1
  episode.last_ended = ended
  return environments.model_turn(episode.last_text, ended, episode.turns)


def run(env: environments.Guarded, tokenizer: chat.ChatTokenizer, eos_id: int | None,
        records: Sequence[tuple[int, Any, Mapping[str, Any]]], generate: Generate,
        row_params: Callable[[int], list[sampling.RowParams]], limits: Limits,
        timing: Timing | None = None) -> list[Episode]:
  """One episode per record (index, prompt, other columns), in batch by turn. `row_params(turn)` gives
  every record's sampling parameters for that turn (0 for the first)."""
  timing = timing or Timing()
  renderer = Renderer(tokenizer, eos_id)
  objects, episodes = open_episodes(env, renderer, records, limits, timing)
  for turn in range(limits.max_turns):
    live = [i for i, e in enumerate(episodes) if not e.end]
    if not live:
      break
    contexts = [episodes[i].prompt_ids + episodes[i].tokens for i in live]
    budgets = [turn_budget(episodes[i], limits) for i in live]
    turn_params = row_params(turn)
    started = time.perf_counter()
    outputs, logps = generate(contexts, [turn_params[i] for i in live], max(budgets))
    timing.generate_s += time.perf_counter() - started
    turns = [record_turn(episodes[i], out[:budget], lps, tokenizer, eos_id)
             for i, out, lps, budget in zip(live, outputs, logps, budgets)]
    started = time.perf_counter()
    steps = env.step([objects[i] for i in live], turns, [episodes[i].index for i in live])
    timing.environment_s += time.perf_counter() - started
    for i, model, step in zip(live, turns, steps):
      advance(episodes[i], model, step, renderer, limits, env.name)
  return episodes


def advance(episode: Episode, model: ModelTurn, step: environments.Step, renderer: Renderer, limits: Limits,
            env_name: str = "") -> None:
  """The episode after its environment's answer (`env_name`'s, for the error): ended, or grown by its tokens."""
  episode.reward += step.reward
  if not math.isfinite(episode.reward):  # finite rewards each, but their sum is not (1e308 twice)
    raise UserError(f"environment {env_name or '?'}: its rewards summed over {episode.turns} turns overflow float64 "
                    f"(the last {step.reward:g}, prompt record {episode.index}); scale them down")
  episode.messages = episode.messages + [{"role": "assistant", "content": model.text}]
  if step.done:
    episode.end = "done"
  elif episode.turns >= limits.max_turns:
    episode.end = "turns"
  if episode.end:
    return
  length = len(episode.prompt_ids) + len(episode.tokens)
  new, _ = renderer.within(step.messages, min(limits.max_context, limits.max_episode_tokens - 1) - length)
  added = renderer.continuation(episode.messages, new, episode.tools, episode.index, model.ended)
  length += len(added)
  if length > limits.max_context or length >= limits.max_episode_tokens:
    episode.end = "tokens"
    return
  episode.messages = episode.messages + new
  episode.tokens += added
  episode.model_mask += [False] * len(added)
  episode.logps += [0.0] * len(added)


def metrics(episodes: Sequence[Episode], timing: Timing) -> dict[str, float]:
  """Per batch: turns, the share of the episodes' tokens (after the prompt) the model sampled, how they ended."""
  count = max(len(episodes), 1)
  model = sum(e.model_tokens for e in episodes)
  total = sum(len(e.tokens) for e in episodes)
  out = {"episodes/mean_turns": sum(e.turns for e in episodes) / count,
         "episodes/model_token_share": model / max(total, 1),
         "episodes/environment_s": timing.environment_s,
         "episodes/overlapped_step_share": timing.overlapped_steps / max(timing.decode_steps, 1)}
  out.update({f"episodes/{ending}_ratio": sum(e.end == ending for e in episodes) / count for ending in ENDINGS})
  return out


__all__ = ["ENDINGS", "Episode", "Generate", "Limits", "Renderer", "Timing", "advance", "environment_for", "metrics",
           "longest_token", "open_episodes", "record_turn", "run", "turn_budget"]
