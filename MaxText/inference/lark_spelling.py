"""A Lark grammar (llguidance's dialect) kept to the texts a tokenizer without a token per byte can write: grammar.py's
`Compiler.lark` for such a tokenizer. llguidance masks a token by its bytes alone, so a reply may start a lexeme, or a
rule's alternative, that only a character no token spells completes, and dead-end there (a failed generation). Here
each regular lexeme is intersected with the characters the tokens write, a `%json` schema is pruned like a
response_format schema, and every alternative that can no longer be completed is replaced by a lexeme that matches
nothing, so no token can start it. A grammar using syntax this reader does not know is left as it is (`prune` returns
None): the reader is small on purpose and only rewrites what it has fully understood."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Protocol

# A never-matching lexeme (no character is outside every code point).
NOTHING = "/[^\\x{0}-\\x{10FFFF}]/"
_TOKEN = re.compile(r"""
    (?P<space>[ \t\r]+|//[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imsxlu]*)
  | (?P<special><[^<>\s]+>)
  | (?P<directive>%[a-z]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>[0-9]+)
  | (?P<punct>\.\.|[:|()\[\]?*+{},.])
""", re.VERBOSE)
_JSON = json.JSONDecoder()
CHECK_BUDGET = 4096  # terminals compiled by the checks of one grammar, all told


class SchemaSpeller(Protocol):
  def spells(self, text: str) -> bool: ...

  def prune(self, schema: Any, unspelled: list[str]) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Pruned:
  text: str  # the rewritten Lark grammar
  empty: bool  # `start` can no longer be completed
  unspelled: list[str]  # what was dropped, by name


@dataclasses.dataclass
class _Tok:
  kind: str
  text: str
  start: int
  end: int
  value: Any = None  # a directive's JSON


class _Unknown(Exception):
  """Syntax this reader does not rewrite."""


def prune(lark: str, chars: str, speller: SchemaSpeller, satisfiable: Callable[[str], bool]) -> Pruned | None:
  """`lark` kept to texts of `chars` (a regex character class); `satisfiable(grammar)` says whether a Lark grammar
  has a text the tokenizer writes. None where the grammar has syntax this reader does not know."""
  try:
    statements = _statements(_tokens(lark))
    return _Rewriter(lark, statements, chars, speller, satisfiable).run()
  except (_Unknown, RecursionError):
    return None


def _tokens(text: str) -> list[_Tok]:
  out: list[_Tok] = []
  at = 0
  while at < len(text):
    match = _TOKEN.match(text, at)
    if match is None:
      raise _Unknown(text[at:at + 20])
    kind = match.lastgroup or ""
    tok = _Tok(kind, match.group(), at, match.end())
    at = match.end()
    if kind == "directive" and tok.text in ("%json", "%regex", "%llguidance"):
      body = len(text[at:]) - len(text[at:].lstrip(" \t"))
      try:
        tok.value, end = _JSON.raw_decode(text, at + body)
      except ValueError:
        raise _Unknown(tok.text) from None
      tok.end = at = end
    if kind != "space":
      out.append(tok)
  return out


def _statements(tokens: list[_Tok]) -> list[list[_Tok]]:
  """Token lists of the grammar's statements: one per line, joined by a line starting with `|` and inside brackets."""
  statements: list[list[_Tok]] = [[]]
  depth = 0
  # Each line break's next token that is not one, found in one backward pass (was: a scan from each line break, which
  # made a grammar of many lines quadratic).
  following, after = [""] * len(tokens), ""
  for i in range(len(tokens) - 1, -1, -1):
    following[i] = after
    after = after if tokens[i].kind == "newline" else tokens[i].text
  for i, tok in enumerate(tokens):
    if tok.kind == "newline":
      if depth == 0 and following[i] != "|":
        statements.append([])
      continue
    depth += tok.text in "([{" and tok.kind == "punct"
    depth -= tok.text in ")]}" and tok.kind == "punct"
    statements[-1].append(tok)
  return [s for s in statements if s]


@dataclasses.dataclass
class _Seq:
  """One alternative: its items and its span in the grammar's text."""
  start: int
  end: int
  items: list[_Item]


@dataclasses.dataclass
class _Item:
  atom: _Tok | list[_Seq]  # a token, or a group's alternatives
  optional: bool  # `?`, `*`, `[...]`, `{0,..}`: may be left out
  lexeme: list[_Tok] | None = None  # a regular lexeme written inline (a regex, a range, %regex)
  ok: bool | None = None  # the lexeme's check, once
  schema: Any = None  # a %json atom's schema, pruned


class _Rewriter:
  def __init__(self, text: str, statements: list[list[_Tok]], chars: str, speller: SchemaSpeller,
               satisfiable: Callable[[str], bool]):
    self.text, self.chars, self.speller, self.satisfiable = text, chars, speller, satisfiable
    self.rules: dict[str, list[_Seq]] = {}
    self.terminals: dict[str, tuple[int, int]] = {}  # a terminal's body span
    self.terminal_names: dict[str, set[str]] = {}  # the names a terminal's body uses
    self.users: dict[str, set[str]] = {}  # a name -> the rules whose bodies use it
    self.checks_left = CHECK_BUDGET
    self.known: set[str] = set()  # imported terminals: taken as they are
    self.imports: list[str] = []
    self.ignores: list[list[_Seq]] = []
    self.edits: list[tuple[int, int, str]] = []
    self.unspelled: list[str] = []
    for statement in statements:
      self._statement(statement)
    names = set(self.rules) | set(self.terminals) | self.known
    self.prefix = "_SPELLED"
    while any(n.startswith(self.prefix) for n in names):
      self.prefix += "_"
    self.lexemes: list[str] = []  # the new terminals' bodies

  def _statement(self, toks: list[_Tok]) -> None:
    head = toks[0]
    if head.kind == "directive":
      if head.text == "%import":
        self.known.update(t.text for t in toks if t.kind == "name")
        self.imports.append("\n" + self.text[head.start:toks[-1].end])
      elif head.text == "%ignore":
        self.ignores.append(_Parser(toks[1:]).alternatives())
      elif head.text != "%llguidance" or len(toks) != 1:
        raise _Unknown(head.text)
      return
    colon = 2 if len(toks) > 2 and toks[1].text == ":" else 0
    if head.kind != "name" or not colon or len(toks) < 3:
      raise _Unknown(head.text)
    if head.text.lstrip("_")[:1].isupper():
      self.terminals[head.text] = (toks[2].start, toks[-1].end)
      self.terminal_names[head.text] = {t.text for t in toks[2:] if t.kind == "name"}
    else:
      self.rules[head.text] = _Parser(toks[2:]).alternatives()
      for name in {t.text for t in toks[2:] if t.kind == "name"}:
        self.users.setdefault(name, set()).add(head.text)

  def run(self) -> Pruned:
    self.productive_terminals = {name for name in self.terminals if self._lexeme_ok(name, None)}
    # A rule is productive once one of its alternatives is; checked again only when a rule it uses becomes so (was:
    # every rule on every pass, quadratic: a chain of 4000 rules held a compile thread for minutes).
    productive: set[str] = set()
    pending = list(self.rules)
    while pending:
      name = pending.pop()
      if name not in productive and any(self._seq_ok(s, productive) for s in self.rules[name]):
        productive.add(name)
        pending.extend(self.users.get(name, ()))
    for alternatives in [*self.rules.values(), *self.ignores]:
      self._rewrite(alternatives, productive)
    for name, (a, b) in self.terminals.items():
      self.edits.append((a, b, f"({self.text[a:b]}) & /{self.chars}*/"))
    pieces, at = [], 0
    for a, b, new in sorted(self.edits):  # spans that do not overlap, joined once
      pieces += [self.text[at:a], new]
      at = b
    text = "".join(pieces) + self.text[at:]
    text += "".join(f"\n{self.prefix}{i}: {body}" for i, body in enumerate(self.lexemes))
    text += f"\n{self.prefix}_NOTHING: {NOTHING}\n"
    return Pruned(text, "start" in self.rules and "start" not in productive, list(dict.fromkeys(self.unspelled)))

  def _lexeme_ok(self, name: str | None, body: str | None) -> bool:
    """Whether a terminal (or an inline lexeme's body, which names no terminal) has a text the tokens write. Each check
    compiles the terminals it uses, not all of them (was: every terminal in every check, quadratic in their number);
    past CHECK_BUDGET terminals compiled the grammar is served as it is."""
    used = self._used(name) if body is None else set()
    self.checks_left -= 1 + len(used)
    if self.checks_left < 0:
      raise _Unknown("more lexemes than the checks allow")
    defs = "".join(self.imports) + "".join(f"\n{n}: ({self.text[a:b]}) & /{self.chars}*/"
                                           for n, (a, b) in self.terminals.items() if n in used)
    if body is not None:
      name = f"{self.prefix}_CHECK"
      defs += f"\n{name}: ({body}) & /{self.chars}*/"
    ok = self.satisfiable(f"start: {name}{defs}\n")
    if not ok:
      self.unspelled.append(f"the lexeme {body or name}"[:60])
    return ok

  def _used(self, name: str | None) -> set[str]:
    """The terminal `name` and those its body uses, and theirs."""
    used: set[str] = set()
    pending = [name]
    while pending:
      current = pending.pop()
      if current in self.terminals and current not in used:
        used.add(current)
        pending.extend(self.terminal_names[current])
    return used

  def _seq_ok(self, seq: _Seq, productive: set[str]) -> bool:
    return all(item.optional or self._item_ok(item, productive) for item in seq.items)

  def _item_ok(self, item: _Item, productive: set[str]) -> bool:
    atom = item.atom
    if isinstance(atom, list):
      return any(self._seq_ok(s, productive) for s in atom)
    if item.lexeme is not None:
      if item.ok is None:
        item.ok = self._lexeme_ok(None, self._span(item.lexeme))
      return item.ok
    if atom.kind == "string":
      if atom.text.endswith("i"):
        return True  # any case of it may be spelled: the lexeme is intersected instead
      try:
        ok = self.speller.spells(json.loads(atom.text))
      except ValueError:
        raise _Unknown(atom.text) from None
      if not ok:
        self.unspelled.append(f"the string {atom.text[:40]}")
      return ok
    if atom.kind == "directive":  # %json
      if item.schema is None:
        item.schema = self.speller.prune(atom.value, self.unspelled)
      return item.schema is not False
    if atom.kind == "name":
      if atom.text in self.terminals:
        return atom.text in self.productive_terminals
      return atom.text in productive or atom.text in self.known or atom.text not in self.rules
    return True  # a special token

  def _rewrite(self, alternatives: list[_Seq], productive: set[str]) -> None:
    for seq in alternatives:
      if seq.items and not self._seq_ok(seq, productive):
        self.edits.append((seq.start, seq.end, f"{self.prefix}_NOTHING"))
        continue
      for item in seq.items:
        if isinstance(item.atom, list):
          self._rewrite(item.atom, productive)
        elif item.lexeme is not None:
          self.lexemes.append(f"({self._span(item.lexeme)}) & /{self.chars}*/")
          self.edits.append((item.lexeme[0].start, item.lexeme[-1].end, f"{self.prefix}{len(self.lexemes) - 1}"))
        elif item.atom.kind == "string" and item.atom.text.endswith("i"):
          self.lexemes.append(f"{item.atom.text} & /{self.chars}*/")
          self.edits.append((item.atom.start, item.atom.end, f"{self.prefix}{len(self.lexemes) - 1}"))
        elif item.atom.kind == "directive" and item.schema is not None and item.schema != item.atom.value:
          self.edits.append((item.atom.start, item.atom.end, f"%json {json.dumps(item.schema)}"))

  def _span(self, toks: list[_Tok]) -> str:
    return self.text[toks[0].start:toks[-1].end]


class _Parser:
  """Recursive descent over one rule's body: alternatives of items (atoms with `?`, `*`, `+`, `{n,m}`)."""

  def __init__(self, toks: list[_Tok]):
    self.toks, self.at = toks, 0

  def _peek(self) -> _Tok | None:
    return self.toks[self.at] if self.at < len(self.toks) else None

  def _next(self) -> _Tok:
    tok = self._peek()
    if tok is None:
      raise _Unknown("end")
    self.at += 1
    return tok

  def alternatives(self, closing: str = "") -> list[_Seq]:
    out = [self._seq(closing)]
    while (tok := self._peek()) is not None and tok.text == "|":
      self.at += 1
      out.append(self._seq(closing))
    if closing and self._next().text != closing or not closing and self._peek() is not None:
      raise _Unknown("unbalanced")
    return out

  def _seq(self, closing: str) -> _Seq:
    items: list[_Item] = []
    first = self._peek()
    start = first.start if first is not None else 0
    end = start
    while (tok := self._peek()) is not None and tok.text not in ("|", closing or "|"):
      item, end = self._item()
      items.append(item)
    return _Seq(start, end, items)

  def _item(self) -> tuple[_Item, int]:
    tok = self._next()
    lexeme: list[_Tok] | None = None
    atom: _Tok | list[_Seq] = tok
    optional = False
    end = tok.end
    if tok.text in ("(", "["):
      atom = self.alternatives(")" if tok.text == "(" else "]")
      optional = tok.text == "["
      end = self.toks[self.at - 1].end
    elif tok.kind == "string" and (dots := self._peek()) is not None and dots.text == "..":
      self.at += 1
      lexeme = [tok, self._next()]
      end = lexeme[-1].end
    elif tok.kind == "regex" or tok.text == "%regex":
      lexeme = [tok]
    elif tok.kind not in ("string", "name", "special") and tok.text != "%json":
      raise _Unknown(tok.text)
    while (op := self._peek()) is not None and op.text in ("?", "*", "+", "{"):
      self.at += 1
      if op.text == "{":
        low = self._next()
        while self._next().text != "}":
          pass
        optional = optional or low.text == "0"
      else:
        optional = optional or op.text in "?*"
      end = self.toks[self.at - 1].end
    return _Item(atom, optional, lexeme), end
