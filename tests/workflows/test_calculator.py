"""The safe arithmetic evaluator behind the calculator tool."""

import pytest

from areal_jax.workflows import calculator


@pytest.mark.parametrize("expr,value", [("3*4+1", 13), (" (10 - 2) / 4 ", 2), ("7/2", 3.5),
                                        ("2**10", 1024), ("-(3+4)*2", -14), ("17 // 5 % 3", 0),
                                        ("6 × 7", 42), ("1.5e2", 150)])
def test_calculator_evaluates(expr, value):
  assert calculator.evaluate(expr) == value


@pytest.mark.parametrize("expr,reason", [
    ("__import__('os').system('x')", "Call"), ("a + 1", "Name"), ("'a' * 3", "Constant"),
    ("2 ** 100000", "exponent"), ("9" * 30 + " * 2", "exceeds"), ("1 / 0", "division by zero"),
    ("", "empty"), ("1 +", "not an arithmetic"), ("(1).real", "Attribute"), ("1 < 2", "Compare"),
    ("[1, 2]", "List"), ("1e308 * 10", "exceeds"), ("1" * 300, "longer than"), ("True + 1", "Constant")])
def test_calculator_rejects(expr, reason):
  with pytest.raises(calculator.CalcError, match=reason):
    calculator.evaluate(expr)
