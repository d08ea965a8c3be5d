"""A safe arithmetic evaluator for the calculator tool (never Python's ``eval``).

The expression is parsed with ``ast`` and only these nodes are evaluated: int/float literals,
``+ - * / // % **``, unary ``+ -`` and parentheses. Names, calls, attributes, strings, comparisons
and everything else are rejected. Bounds keep a hostile expression cheap: at most
``MAX_CHARS`` characters, exponents of magnitude at most ``MAX_EXPONENT``, and intermediate
results of magnitude at most ``MAX_VALUE``. Every failure is a ``CalcError`` with the reason.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_VALUE = 10**18


class CalcError(ValueError):
  """The expression is malformed, not plain arithmetic, or out of bounds."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
  """The value of an arithmetic expression such as ``"3*4 + (10 - 2) / 4"``."""
  if not isinstance(expression, str):
    raise CalcError(f"expected a string, got {type(expression).__name__}")
  text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
  if not text:
    raise CalcError("empty expression")
  if len(text) > MAX_CHARS:
    raise CalcError(f"expression longer than {MAX_CHARS} characters")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise CalcError(f"not an arithmetic expression: {e.msg}") from None
  value = _eval(tree.body)
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  return value


def _check(value):
  if isinstance(value, float) and not math.isfinite(value):
    raise CalcError("result is not finite")
  if abs(value) > MAX_VALUE:
    raise CalcError(f"result exceeds {MAX_VALUE:.0e}")
  return value


def _eval(node: ast.AST):
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _check(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _check(_UNARY[type(node.op)](_eval(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalcError(f"exponent {right} exceeds {MAX_EXPONENT}")
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
      raise CalcError("division by zero")
    try:
      return _check(_BINARY[type(node.op)](left, right))
    except (OverflowError, ZeroDivisionError, TypeError) as e:
      raise CalcError(str(e)) from None
  raise CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def format_value(value: int | float) -> str:
  """Integers as they are, other values with up to 10 significant digits."""
  if isinstance(value, int):
    return str(value)
  return f"{value:.10g}"
