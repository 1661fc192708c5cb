"""Reading the shell of the docs' command blocks and the repository's scripts, for checks that need
no run: which commands a text runs (python3 ..., bash x.sh, lm_eval ...) and the Python it feeds
(heredocs, -c), whether it hides a failing step's error, and whether it starts a server on a fixed
port.

A step's error is hidden when its stderr goes to /dev/null (`2>/dev/null`, `&>/dev/null`,
`>/dev/null 2>&1`) or its status is dropped (`|| true`, `|| :`), unless the step is a probe whose
status the text uses (`if`/`until`/`while`, `&& ...`, `|| handler`), an existence probe or clean-up
(`kill`, `command -v`, `compgen`, `type`, `which`, `hash`), or a `{ grep ... || true; }` group (grep
finding no line; with pipefail the steps before it still count).

A server a runnable text starts (`MaxText.serve` in the background) takes `port=0` (or a variable
that defaults to 0) and is reached at the address its start-up line names: on a fixed port, another
program already listening there would answer the text's client. A client of a fixed port on the
loopback (`127.0.0.1:8000`) is the same mistake from the other side.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}
_PROBES = {"kill", "command", "compgen", "type", "which", "hash"}
_CONDITIONS = {"if", "elif", "while", "until", "!"}
_PREFIXES = {"do", "then", "else", "{", "(", "time", "exec"} | _CONDITIONS


@dataclasses.dataclass
class Shell:
  """A shell text split into logical lines (continuations joined, heredoc bodies taken out) and
  the heredocs (the command line that opens each, its body)."""

  lines: list[tuple[int, str]]  # (1-based line number in the text, logical line)
  heredocs: list[tuple[str, str]]


def read(text: str) -> Shell:
  lines: list[tuple[int, str]] = []
  heredocs: list[tuple[str, str]] = []
  raw = text.splitlines()
  i = 0
  while i < len(raw):
    start, line = i, raw[i]
    while line.endswith("\\") and i + 1 < len(raw):
      i += 1
      line = line[:-1] + " " + raw[i].strip()
    i += 1
    m = _HEREDOC.search(line)
    if m and not line.lstrip().startswith("#"):
      body = []
      while i < len(raw) and raw[i].strip() != m.group(2):
        body.append(raw[i])
        i += 1
      i += 1  # the terminator
      heredocs.append((line, "\n".join(body) + "\n"))
    lines.append((start + 1, line))
  return Shell(lines, heredocs)


def tokens(line: str) -> list[str]:
  """The words and operators of one logical line, comments dropped (a line shlex cannot split, such
  as one with an unbalanced quote inside a heredoc opener, gives its whitespace-split words)."""
  lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  lexer.commenters = "#"
  try:
    return list(lexer)
  except ValueError:
    return line.split("#")[0].split()


def segments(words: list[str]) -> list[tuple[list[str], str]]:
  """The simple commands of a line, each with the operator after it ('' at the end)."""
  out: list[tuple[list[str], str]] = []
  current: list[str] = []
  for w in words:
    if w in _OPERATORS:
      out.append((current, w))
      current = []
    else:
      current.append(w)
  out.append((current, ""))
  return out


def command_words(segment: list[str]) -> list[str]:
  """A simple command without the keywords, `VAR=value` assignments and wrappers before it."""
  words = list(segment)
  while words:
    w = words[0]
    if w in _PREFIXES or re.match(r"^[A-Za-z_]\w*=", w):
      words.pop(0)
    elif w in ("nice", "timeout") and len(words) > 1:
      words.pop(0)
      while words and (words[0].startswith("-") or words[0].isdigit() or re.match(r"^\d+[smh]?$", words[0])):
        words.pop(0)
    elif w == "env":
      words.pop(0)
    else:
      break
  return words


def _discards_stderr(seg: list[str]) -> bool:
  joined = " ".join(seg)
  return bool(re.search(r"(^|\s)2 > /dev/null|&> /dev/null|> /dev/null 2 >& 1|2 >& 1 > /dev/null", joined))


def hidden_errors(text: str) -> list[tuple[int, str]]:
  """(line, why) for each step of a shell text whose error is hidden (see the module docstring)."""
  found: list[tuple[int, str]] = []
  for number, line in read(text).lines:
    segs = segments(tokens(line))
    condition = False  # inside an if/while/until condition: statuses are used
    for k, (seg, op) in enumerate(segs):
      if seg and seg[0] in _CONDITIONS:
        condition = True
      if seg and seg[0] in ("then", "do"):
        condition = False
      words = command_words(seg)
      name = words[0] if words else ""
      after = command_words(segs[k + 1][0]) if k + 1 < len(segs) else []
      drops = op == "||" and after[:1] in (["true"], [":"])
      grouped_grep = name == "grep" and seg[:1] == ["{"]
      if drops and name not in _PROBES and not grouped_grep:
        found.append((number, f"`{' '.join(seg)} || {after[0]}` drops the step's failure"))
      if _discards_stderr(seg) and name not in _PROBES and not condition and not (op in ("&&", "||") and not drops):
        found.append((number, f"`{' '.join(seg)}` sends the step's error to /dev/null"))
  return found


_SERVE = re.compile(r"\bMaxText\.serve\b")
_PORT = re.compile(r"(?:^|\s)port=(\S+)")
_LOOPBACK_PORT = re.compile(r"(?:127\.0\.0\.1|localhost):(\d+)")


def fixed_ports(text: str) -> list[tuple[int, str]]:
  """(line, why) for each server a runnable text starts on a fixed port, and each client of a fixed
  loopback port."""
  found: list[tuple[int, str]] = []
  for number, line in read(text).lines:
    code = line.split(" #")[0]
    if _SERVE.search(code) and code.rstrip().endswith("&"):  # started in the background
      m = _PORT.search(code)
      value = m.group(1).strip("'\"") if m else ""
      var = re.fullmatch(r"\$\{?(\w+)\}?", value)
      zero_default = var and re.search(rf"\b{var.group(1)}:?=0\b", text)
      if value != "0" and not zero_default:
        found.append((number, f"starts MaxText.serve on {'port=' + value if value else 'the default port'}: "
                              "use port=0 and read the address from its start-up line"))
    for m in _LOOPBACK_PORT.finditer(code):
      found.append((number, f"talks to a fixed port ({m.group(0)}): another program may be the one answering"))
  return found
