"""A choice's tokens as the text and logprobs an OpenAI answer carries, apart from HTTP.

`ChoiceText` turns a choice's token stream into text, finding stop sequences and holding back text that
could still become one (or half a multi-byte character); `TokenTexts` gives each token the text it adds
where it stands, so a logprobs object's tokens join to the choice's text; `completion_logprobs` builds that
object (the completions API's shape; -inf read as LOGPROB_FLOOR, JSON having no infinity).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Collection, Sequence


class ChoiceText:
  """One choice's tokens -> text: `add(token)` returns the text now safe to send (none that a
  stop sequence could still claim, no half of a multi-byte character); a stop sequence ends the
  text before it, as does a token of `stop_ids` (a stop sequence that is a special token decode does not write).
  `context`: the tokens before the choice's own (the prompt's last), decoded with them and cut off: SentencePiece
  drops the space a text's first word carries, so the first token of " world" after "hello", decoded alone, read
  as "world"."""

  def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], stop_ids: Collection[int] = (),
               context: Sequence[int] = ()):
    self.decode, self.stops, self.stop_ids = decode, list(stops), frozenset(stop_ids)
    self.context = list(context)
    self.tokens: list[int] = []
    self.text = ""
    # Only the tokens since the last settled ones are decoded (after those, for their leading space): decoding the
    # whole choice at every call made a long completion's text quadratic in its length, on the event loop.
    self._window = _DecodeWindow(decode, self.context)
    self.sent = 0
    self.stopped = False  # a stop sequence was found (the job is then cancelled)
    self._hold = max((len(s) for s in self.stops), default=1) - 1

  def add(self, token: int) -> str:
    if self.stopped:
      return ""
    self.tokens.append(token)
    self.text = self._decode()
    if token in self.stop_ids:  # the text before it is final; a stop sequence in it may still end it sooner
      delta = self.flush()
      self.stopped = True
      return delta
    return self._advance(self._settled_end())

  def add_many(self, tokens: Sequence[int]) -> tuple[str, int]:
    """`add` for several tokens: (the text now safe to send, how many of them it took: all, or those
    up to the one that completed a stop sequence). Without stop sequences the tokens are decoded once."""
    if self.stops:
      deltas: list[str] = []
      for taken, token in enumerate(tokens):
        if self.stopped:
          return "".join(deltas), taken
        deltas.append(self.add(token))
      return "".join(deltas), len(tokens)
    self.tokens.extend(tokens)
    self.text = self._decode()
    return self._advance(self._settled_end()), len(tokens)

  def _decode(self) -> str:
    """The choice's tokens as text after the context's; the tokens alone where the context's text is not a prefix
    (a context ending inside a UTF-8 sequence that the first token completes)."""
    return self._window.text(self.tokens)

  def _settled_end(self) -> int:
    """Where the characters no later token can change end: a trailing U+FFFD may be an incomplete UTF-8
    sequence that the next token completes (it then decodes to another character, or to fewer)."""
    end = len(self.text)
    while end > 0 and self.text[end - 1] == "\ufffd":
      end -= 1
    return end

  def _advance(self, settled: int) -> str:
    """Ends the text at the first stop sequence within its first `settled` characters, else sends
    those that no stop sequence can still claim."""
    # None starts before `sent`: a stop there would have ended within text already searched (sent trails it by
    # the longest stop's length less one).
    found = [i for i in (self.text.find(s, self.sent, settled) for s in self.stops) if i >= 0]
    if found:
      self.text, self.stopped = self.text[:min(found)], True
      return self._send_to(len(self.text))
    return self._send_to(settled - self._hold)

  def flush(self) -> str:
    """The rest of the text at the choice's end, where every character is final (a stop sequence may
    still end it)."""
    delta = "" if self.stopped else self._advance(len(self.text))
    return delta + self._send_to(len(self.text))

  def _send_to(self, end: int) -> str:
    if end <= self.sent:
      return ""
    delta, self.sent = self.text[self.sent:end], end
    return delta


class _DecodeWindow:
  """The text of a growing list of tokens, decoding only those after the last settled run (with that run before
  them, for the leading space SentencePiece writes after a word): the text so far is the settled runs' texts joined,
  then the unsettled tokens' (a run settles once its text grows and does not end inside a UTF-8 character, U+FFFD)."""

  def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int]):
    self.decode = decode
    self.ids = list(context)
    self.from_context = bool(self.ids)  # the window still starts inside the context
    self._prefix, self._read = 0, len(self.ids)  # ids[prefix:read]: the last settled run (at first the context)
    self._before = decode(self.ids) if self.ids else ""
    self._settled = ""
    self._seen = 0  # how many of the tokens are in ids

  def text(self, tokens: Sequence[int]) -> str:
    """The text of `tokens`, which extend those of the previous call."""
    self.ids += tokens[self._seen:]
    self._seen = len(tokens)
    after = self.decode(self.ids[self._prefix:])
    if self.from_context and not after.startswith(self._before):
      # The context's text is no prefix (it ended inside a character the tokens complete): the tokens alone.
      self.ids, self._prefix, self._read, self._before, self.from_context = list(tokens), 0, 0, "", False
      after = self.decode(self.ids)
    tail = after[len(self._before):]
    if tail and not tail.endswith("\ufffd"):
      self._settled += tail
      self._prefix, self._read, self.from_context = self._read, len(self.ids), False
      self._before = self.decode(self.ids[self._prefix:])
      return self._settled
    return self._settled + tail


class TokenTexts:
  """Each token's text where it stands, so that the texts of a choice's tokens join to its text (a prompt's, to the
  prompt's decoded text) and the offsets line up: a token decoded alone loses the leading space SentencePiece writes
  after a word. A token is decoded with the settled one before it and cut off after that one's text. A token that ends
  inside a UTF-8 character is "" and the one that completes the character carries all of it, as vLLM reports; at
  `finish` the last pending token takes what is left (a character never completed reads U+FFFD, as the text does).
  `context`: the tokens before (a completion's: the prompt's last, as ChoiceText decodes)."""

  def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = (),
               alone: Callable[[int], str] | None = None):
    self.decode = decode
    self.alone = alone  # one token decoded by itself, cached (the server's): the settled run is most often one token
    self.ids = list(context)
    self.start = len(self.ids)  # where the tokens' own ids begin
    # ids[prefix:read]: the last settled token (at first the context's last), which each new one is decoded after
    self._prefix, self._read = max(self.start - 1, 0), self.start

  def add(self, tokens: Sequence[int]) -> list[str]:
    """The texts of the tokens these settle, pending ones first: fewer than `tokens` while a character is unfinished."""
    out: list[str] = []
    for token in tokens:
      self.ids.append(token)
      before, after = self._texts()
      if len(after) > len(before) and not after.endswith("\ufffd"):
        out += self._settle(after[len(before):])
    return out

  def finish(self) -> list[str]:
    """The texts of the tokens still pending (none, or those of a character the choice ended inside)."""
    if self._read == len(self.ids):
      return []
    before, after = self._texts()
    return self._settle(after[len(before):])

  def _texts(self) -> tuple[str, str]:
    settled = (self.alone(self.ids[self._prefix]) if self.alone is not None and self._read - self._prefix == 1
               else self.decode(self.ids[self._prefix:self._read]))
    return settled, self.decode(self.ids[self._prefix:])

  def _settle(self, text: str) -> list[str]:
    pending = len(self.ids) - self._read
    self._prefix, self._read = self._read, len(self.ids)
    return [""] * (pending - 1) + [text]

  def previous(self, index: int) -> int | None:
    """The id before the tokens' `index`-th (None: the first of tokens without context)."""
    at = self.start + index - 1
    return self.ids[at] if at >= 0 else None


def alternative_text(decode: Callable[[list[int]], str], previous: int | None, token: int,
                     alone: Callable[[int], str] | None = None) -> str:
  """An alternative token's text in place of a chosen one, after the same `previous` token (its leading space kept);
  `alone`: decode of one token (cached by the server)."""
  alone = alone or (lambda t: decode([t]))
  if previous is None:
    return alone(token)
  before, after = alone(previous), decode([previous, token])
  return after[len(before):] if after.startswith(before) else alone(token)


def completion_logprobs(texts: Sequence[str], tokens: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[Sequence[tuple[int, float]] | None],
                        how_many: int, alternative: Callable[[int, int], str], start_offset: int = 0) -> dict[str, Any]:
  """OpenAI's completions `logprobs` object: the tokens' texts (TokenTexts), their log-probabilities, the `how_many`
  best alternatives per position (as text -> log-probability; `alternative(position, token)` is the text) and
  character offsets from `start_offset`. Each position's alternatives also hold its own token (`tokens`) when it is
  not among the best: the legacy API always returns the chosen token's, so up to `how_many` + 1 entries. The chosen
  token's key is its entry in `tokens` (lm-eval calls a position greedy when its best key equals that entry, which a
  character split over tokens would break), and it needs no decode of its own (`logprobs: 0` then decodes nothing)."""
  offsets, at = [], start_offset
  for text in texts:
    offsets.append(at)
    at += len(text)
  floored = [None if v is None else _floored(v) for v in logprobs]
  top = [None if t is None else _by_text(_with_chosen([(a, _floored(v)) for a, v in list(t)[:how_many]], tokens[i],
                                                      floored[i]),
                                         functools.partial(_text_of, tokens[i], texts[i], functools.partial(alternative, i)))
         for i, t in enumerate(tops)]
  return {"tokens": list(texts), "token_logprobs": floored, "top_logprobs": top,
          "text_offset": offsets}


LOGPROB_FLOOR = -9999.0  # what a -inf log-probability reads as (JSON has no infinity; the OpenAI API's own floor)


def _floored(logprob: float) -> float:
  return LOGPROB_FLOOR if logprob < LOGPROB_FLOOR else logprob


def _text_of(chosen: int, chosen_text: str, alternative: Callable[[int], str], token: int) -> str:
  return chosen_text if token == chosen else alternative(token)


def _with_chosen(top: list[tuple[int, float]], token: int, logprob: float | None) -> list[tuple[int, float]]:
  """Last: not among the best, it is the least probable (and so yields its text to a better token of the same)."""
  return top if logprob is None or any(t == token for t, _ in top) else top + [(token, logprob)]


def _by_text(top: list[tuple[int, float]], token_text: Callable[[int], str]) -> dict[str, float]:
  """Alternatives keyed by their text; two tokens with the same text keep the more probable one."""
  out: dict[str, float] = {}
  for token, logprob in top:
    out.setdefault(token_text(token), logprob)
  return out
