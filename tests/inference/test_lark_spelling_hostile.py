"""Structured output for a tokenizer without byte tokens (inference/lark_spelling.py, grammar.py's speller): a Lark
grammar, a forced tool call's parameters and a JSON schema are kept to the texts the tokens write, so every reply the
masks allow completes (was: a reply could start a branch only an unspellable character finishes and fail mid-request,
a 500), and one left with no text is a one-line GrammarError (the server's 400) naming what no token spells."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llguidance", reason="needs llguidance (pip install -r requirements.txt)")
pytest.importorskip("transformers", reason="the tokenizer is read through transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_structured_speculative_hostile import compiler, dead_ends  # noqa: E402,F401 - the fixture


@pytest.mark.parametrize("lark", [
    'start: "a" | "bz"',
    'start: x\nx: "b" "z" | "a"',
    'start: ("b" "z")? "a"',
    'start: "a" | "b" Z\nZ: /z/',
    'start: A\nA: "a"\n  | "bz"',
    'start: "a" /[ab]z|b/',
    '// a comment\nstart: x | "a" // another\nx: "b" "z"',
    'start: %json {"enum": ["az", "b"]}',
], ids=["string", "rule", "optional-group", "terminal", "terminal-alternative", "regex", "comments", "json"])
def test_a_lark_branch_no_token_spells_is_pruned_not_a_failed_generation(compiler: Any, lark: str) -> None:
  """Was: a reply could write "b", find no token for `z` and take llguidance's stand-in: a 500 mid-reply."""
  dead, complete = dead_ends(compiler.lark(lark), depth=5)
  assert not dead and complete, dead


@pytest.mark.parametrize("lark, culprit", [
    ('start: ("a" | "b") "z"', 'the string "z"'),
    ('start: "a"+ "z"', 'the string "z"'),  # was: compiled, and a reply wrote a's until max_tokens
    ('start: /[ab]+z/', "the lexeme /[ab]+z/"),
    ('start: x\nx: ("a" | "b") Z\nZ: "z" | "zz"', "the lexeme Z"),
    ('start: ("a" | "b") %json {"enum": ["az", "bz"]}', 'the enum value "az"'),
    ('start: "a" %json {"enum": ["az"]}', 'the enum value "az"'),  # forced: refused before, now naming it
], ids=["after-a-choice", "after-a-loop", "regex", "terminal", "json", "forced-json"])
def test_a_lark_grammar_only_unspellable_text_satisfies_is_a_grammar_error(compiler: Any, lark: str,
                                                                           culprit: str) -> None:
  from MaxText.inference import grammar

  with pytest.raises(grammar.GrammarError, match="no text satisfies it") as refused:
    compiler.lark(lark)
  assert culprit in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_lark_syntax_the_pruner_does_not_read_is_served_as_it_is(compiler: Any) -> None:
  """A repetition by `~`, or a directive it does not know, leaves the grammar to llguidance as before (not refused)."""
  from MaxText.inference import lark_spelling

  for lark in ('start: ("a" | "b")~2', 'start: "a"\n%declare X'):
    assert lark_spelling.prune(lark, "[ab]", compiler._speller, compiler._satisfiable) is None
  dead, complete = dead_ends(compiler.lark('start: ("a" | "b")~2'), depth=3)
  assert not dead and complete


@pytest.mark.parametrize("s", [
    {"anyOf": [{"type": "object", "properties": {"az": {}}, "required": ["az"]}, {"type": "integer"}]},
    {"anyOf": [{"type": "object", "properties": {"az": {"const": 1}}, "required": ["az"]}, {"const": 1}]},
], ids=["required-key", "required-key-of-a-const"])
def test_a_schema_branch_with_a_required_key_no_token_spells_is_pruned(compiler: Any, s: dict[str, Any]) -> None:
  """Was: a reply could open the object, write `{"a`, find no token for the key's `z` and fail (a 500)."""
  dead, complete = dead_ends(compiler.json_schema(s), depth=5)
  assert not dead and complete, dead


def test_a_reference_to_a_pruned_definition_leaves_its_branch_out(compiler: Any) -> None:
  """Was: the definition pruned to false, and llguidance refused the whole schema ("schema is false") though its
  other branch is satisfiable: a 400 for a schema a reply can match."""
  s = {"$defs": {"x": {"enum": ["az"]}}, "anyOf": [{"$ref": "#/$defs/x"}, {"const": 1}]}
  dead, complete = dead_ends(compiler.json_schema(s), depth=3)
  assert not dead and complete == 1


def test_a_forced_tool_calls_parameters_are_pruned(compiler: Any) -> None:
  """A forced call is a Lark grammar holding the call's schema: its enum value no token spells is left out."""
  from MaxText.inference import grammar

  tools = [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["az"]}}}]
  lark = grammar.tool_call_lark(tools, "json")
  pruned = grammar.lark_spelling.prune(lark, compiler._written, compiler._speller, compiler._satisfiable)
  assert pruned is not None and pruned.empty and any("name" in u or "az" in u for u in pruned.unspelled), pruned


def test_a_long_chain_of_rules_is_pruned_in_linear_time(compiler: Any) -> None:
  """Which rules have a text was found by passes over every rule until none changed: a chain of 2000 rules, each
  using the next, took one pass per rule and held a compile thread for half a minute (quadratic: longer ones for
  hours)."""
  lark = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(2000)) + 'r2000: "b"\n'
  started = time.perf_counter()
  dead, complete = dead_ends(compiler.lark(lark), depth=2)
  assert time.perf_counter() - started < 10
  assert not dead


class _SpellsAll:
  def spells(self, text: str) -> bool:
    return True

  def prune(self, schema: Any, unspelled: list[str]) -> Any:
    return schema


def test_each_terminal_check_compiles_only_the_terminals_it_uses() -> None:
  """Was: every terminal's check compiled all of the grammar's terminals (quadratic in their number); past
  CHECK_BUDGET terminals compiled the grammar is served as it is."""
  from MaxText.inference import lark_spelling

  checked: list[str] = []
  terminals = "".join(f"T{i}: /b{i}[0-9]/\n" for i in range(300))
  lark = "start: " + " ".join(f"T{i}" for i in range(300)) + " U\n" + terminals + "U: T1 T2\n"
  pruned = lark_spelling.prune(lark, "[a-z0-9]", _SpellsAll(), lambda g: checked.append(g) or True)
  assert pruned is not None and not pruned.empty
  assert len(checked) == 301 and max(g.count(": ") for g in checked) <= 4, max(checked, key=len)  # start, U, T1, T2
  many = "start: " + " ".join(f"/c{i}/" for i in range(lark_spelling.CHECK_BUDGET + 1))
  assert lark_spelling.prune(many, "[a-z0-9]", _SpellsAll(), lambda g: True) is None
