import random
import subprocess

import pytest

from rlfleet.envkit.suites.calc import CALC_TOOL_ARGV, CALC_TOOL_SCRIPT
from rlfleet.envkit.suites.calc_tool import MAX_EXPRESSION_CHARS, evaluate_expression


@pytest.mark.parametrize(
    "expression",
    [
        "1+2",
        "37*48+5",
        "12*(3+4)",
        "-5+3",
        "3*-2",
        "--4",
        "100-250",
        "17//5",
        "-17//5",
        "17%5",
        "-17%5",
        " 2 * ( 3 + 4 ) ",
        "(((1)))",
        "007+1",
        "0*99999",
        "5*(3-3)",
        "0%7",
    ],
)
def test_evaluator_computes_integer_arithmetic_like_python(expression):
    assert evaluate_expression(expression) == str(eval(expression.replace("007", "7")))


def test_true_division_prints_integral_results_as_integers_and_others_as_python_floats():
    assert evaluate_expression("6/3") == "2"
    assert evaluate_expression("7/2") == "3.5"
    assert evaluate_expression("1/3") == repr(1 / 3)
    assert evaluate_expression("-9/4") == "-2.25"


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('ls')", "unexpected character '_'"),
        ("abs(-3)", "unexpected character 'a'"),
        ("().__class__", "unexpected character '.'"),
        ("2**10", "'**' is not supported"),
        ("9**9**9**9", "'**' is not supported"),
        ("1.5+1", "unexpected character '.'"),
        ("1_000", "unexpected character '_'"),
        ("\u0663+1", "unexpected character"),  # an Arabic-Indic digit: only ASCII digits are numbers
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("5//(3-3)", "division by zero"),
        ("", "empty expression"),
        ("   ", "empty expression"),
        ("1+", "unexpected end of expression"),
        ("(1+2", "missing ')'"),
        ("1+2)", "unexpected ')'"),
        ("3 4", "unexpected '4'"),
        ("(" * 40 + "1" + ")" * 40, "nested deeper than"),
        ("-" * 50 + "1", "nested deeper than"),
        ("9" * 61, "number too large"),
        ("99999999999*" * 6 + "9", "number too large"),
        ("1+" * MAX_EXPRESSION_CHARS + "1", "longer than"),
        ("lambda: 1", "unexpected character 'l'"),
        ("1;2", "unexpected character ';'"),
    ],
)
def test_evaluator_rejects_unsafe_or_broken_input_with_an_error_line_not_an_exception(expression, error):
    result = evaluate_expression(expression)
    assert result.startswith("error: ")
    assert error in result
    assert "\n" not in result


def test_evaluator_never_raises_on_random_input():
    rng = random.Random(0)
    alphabet = "0123456789+-*/%() ._ax\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        result = evaluate_expression(text)
        assert isinstance(result, str) and result


def test_tool_script_runs_standalone_reading_stdin_or_arguments():
    by_stdin = subprocess.run(CALC_TOOL_ARGV, input="37*48+5", capture_output=True, text=True, timeout=20)
    assert (by_stdin.returncode, by_stdin.stdout) == (0, "1781\n")
    by_argv = subprocess.run([*CALC_TOOL_ARGV, "-2*3"], capture_output=True, text=True, timeout=20)
    assert (by_argv.returncode, by_argv.stdout) == (0, "-6\n")
    error = subprocess.run(CALC_TOOL_ARGV, input="open('x')", capture_output=True, text=True, timeout=20)
    assert (error.returncode, error.stdout) == (1, "error: unexpected character 'o'\n")


def test_tool_script_imports_nothing_from_rlfleet():
    imports = [line for line in CALC_TOOL_SCRIPT.splitlines() if line.startswith(("import ", "from "))]
    assert imports and not any("rlfleet" in line for line in imports)
