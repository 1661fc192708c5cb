"""The built-in tool environment (`rl_environment=calculator`): one tool, `calculator`, that
evaluates an arithmetic expression, and a reward of 1 when the model's final answer (a turn
without a tool call) equals the record's rl_answer_column, as the exact_match reward compares them.

The evaluator reads the expression with `ast` and walks a whitelist: numbers, + - * / // % **,
unary + -, parentheses. Names, calls, attributes, subscripts and everything else are refused, and
so are numbers beyond MAX_MAGNITUDE, exponents beyond MAX_EXPONENT and expressions longer than
MAX_CHARS: nothing the model writes runs as code or takes long. A refusal is the tool's answer to
the model ("error: ..."), never an error of the run.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from typing import Any, Callable

from MaxText.errors import UserError
from MaxText.rl import rewards
from MaxText.rl.environments import Message, ModelTurn, Step

MAX_CHARS = 200
MAX_MAGNITUDE = 10.0 ** 30
MAX_EXPONENT = 100
TOOL_NAME = "calculator"
TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluates an arithmetic expression of numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
  """An expression the calculator refuses; its text is what the model reads."""


def evaluate(expression: str) -> int | float:
  """The value of an arithmetic expression, or CalculatorError saying why not."""
  if not isinstance(expression, str):
    raise CalculatorError(f"the expression must be a string, not {type(expression).__name__}")
  if len(expression) > MAX_CHARS:
    raise CalculatorError(f"the expression has {len(expression)} characters; at most {MAX_CHARS}")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    raise CalculatorError(f"cannot read {expression!r} as arithmetic") from None
  return _value(tree.body)


def _value(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _bounded(_UNARY[type(node.op)](_value(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Pow):
      _check_power(left, right)
    try:
      return _bounded(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError(f"the result is beyond {MAX_MAGNITUDE:g}") from None
  what = type(node).__name__
  if isinstance(node, ast.Name):
    what = f"the name {node.id!r}"
  elif isinstance(node, ast.Constant):
    what = f"the constant {node.value!r}"
  raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _check_power(base: int | float, exponent: int | float) -> None:
  if abs(exponent) > MAX_EXPONENT:
    raise CalculatorError(f"the exponent {exponent:g} is beyond {MAX_EXPONENT}")
  if base == 0 and exponent < 0:
    raise CalculatorError("division by zero")
  if abs(base) > 1 and abs(exponent) * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
    raise CalculatorError(f"the result is beyond {MAX_MAGNITUDE:g}")
  if base < 0 and not float(exponent).is_integer():
    raise CalculatorError("a negative number to a fractional power is not a real number")


def _bounded(value: Any) -> int | float:
  if isinstance(value, complex) or not isinstance(value, (int, float)):
    raise CalculatorError("the result is not a real number")
  if isinstance(value, float) and not math.isfinite(value):
    raise CalculatorError("the result is not a finite number")
  if abs(value) > MAX_MAGNITUDE:
    raise CalculatorError(f"the result is beyond {MAX_MAGNITUDE:g}")
  return value


def format_value(value: int | float) -> str:
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  return str(value) if isinstance(value, int) else f"{value:.12g}"


def answer_call(arguments: dict[str, Any]) -> str:
  """The tool's reply to one call: the value, or `error: ...`."""
  expression = arguments.get("expression")
  if expression is None:
    return 'error: the calculator takes {"expression": "<arithmetic>"}'
  try:
    return format_value(evaluate(expression))
  except CalculatorError as e:
    return f"error: {e}"


@dataclasses.dataclass
class Calculator:
  """One episode: the prompt as a user turn; each model turn with tool calls gets one `tool` message
  per call; a turn without calls is the final answer and ends the episode with its reward."""

  prompt: Any
  answer: Any
  tools: list[dict[str, Any]] = dataclasses.field(default_factory=lambda: list(TOOLS))

  def start(self) -> list[Message]:
    if isinstance(self.prompt, list):
      return [dict(m) for m in self.prompt]
    return [{"role": "user", "content": str(self.prompt)}]

  def step(self, turn: ModelTurn) -> Step:
    malformed = ('error: a tool call must be <tool_call>{"name": "calculator", "arguments": {"expression": '
                 '"..."}}</tool_call>')
    if turn.calls or turn.malformed:
      replies = [answer_call(c.arguments) if c.name == TOOL_NAME else f"error: no tool named {c.name!r}; the only "
                 f"tool is {TOOL_NAME}" for c in turn.calls]
      # A call that did not parse beside ones that did is answered too: not a final answer, not silence.
      return Step([{"role": "tool", "content": r} for r in replies + ([malformed] if turn.malformed else [])])
    matched = rewards.ExactMatch("answer")(completions=[turn.text], answer=[self.answer])[0]
    return Step([], matched, True)


def factory(answer_column: str) -> Callable[..., Calculator]:
  """The episode factory: reads the prompt and the answer column of each record."""
  def make(prompt: Any, **columns: Any) -> Calculator:
    if answer_column not in columns:
      raise UserError(f"the calculator environment reads the column rl_answer_column={answer_column!r}, which "
                              f"the prompt records do not have (their columns: {', '.join(sorted(columns)) or 'none'})")
    return Calculator(prompt, columns[answer_column])
  return make


__all__ = ["Calculator", "CalculatorError", "MAX_EXPONENT", "MAX_MAGNITUDE", "TOOLS", "answer_call", "evaluate",
           "factory"]
