"""The functions the ``repo`` suite builds its repositories from: a correct body, the one-line bugs
it can carry, visible test cases (in the workspace) and hidden ones (the verifier's only).

Bodies are one to three short lines, so a tiny model reads and edits a whole file in a few dozen
tokens. Every bug is a single line: the correct line and the buggy line that replaces it, and the
name of the mistake (``kind``), which the task's metadata carries as its failure mode. Expected
values are written out by hand, so the test that runs every reference against its hidden cases
checks both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Case = tuple[tuple[Any, ...], Any]  # (args, expected)


@dataclass(frozen=True)
class Bug:
    kind: str   # the mistake's name: wrong_operator, off_by_one, wrong_comparison, ...
    line: str   # the correct line, as it appears in the body (unindented)
    buggy: str  # what replaces it


@dataclass(frozen=True)
class FunctionTemplate:
    name: str
    params: str
    doc: str       # completes "<name>() ..." in prompts and the docstring
    body: str      # unindented lines
    bugs: tuple[Bug, ...]
    visible: tuple[Case, ...]
    hidden: tuple[Case, ...]

    def source(self, bug: Bug | None = None, stub: bool = False) -> str:
        """The function's source: correct, with `bug` in it, or a stub raising NotImplementedError."""
        lines = ["    raise NotImplementedError"] if stub else [
            "    " + (bug.buggy if bug is not None and line == bug.line else line)
            for line in self.body.split("\n")]
        return f"def {self.name}({self.params}):\n    \"\"\"{self.doc[0].upper()}{self.doc[1:]}.\"\"\"\n" + \
            "\n".join(lines) + "\n"

    def body_lines(self) -> list[str]:
        return ["    " + line for line in self.body.split("\n")]


def _f(name: str, params: str, doc: str, body: str, bugs: list[tuple[str, str, str]],
       visible: list[Case], hidden: list[Case]) -> FunctionTemplate:
    return FunctionTemplate(name, params, doc, body, tuple(Bug(*b) for b in bugs),
                            tuple(visible), tuple(hidden))


FUNCTIONS: tuple[FunctionTemplate, ...] = (
    _f("add", "a, b", "returns a plus b", "return a + b",
       [("wrong_operator", "return a + b", "return a - b")],
       [((2, 3), 5)], [((1, 1), 2), ((10, -4), 6), ((0, 7), 7)]),
    _f("area", "w, h", "returns the area of a w by h rectangle", "return w * h",
       [("wrong_operator", "return w * h", "return w + h")],
       [((2, 3), 6)], [((4, 5), 20), ((1, 9), 9), ((0, 3), 0)]),
    _f("square", "x", "returns x squared", "return x * x",
       [("wrong_operator", "return x * x", "return x * 2")],
       [((3,), 9)], [((5,), 25), ((-4,), 16), ((1,), 1)]),
    _f("is_even", "n", "returns True when n is even", "return n % 2 == 0",
       [("wrong_constant", "return n % 2 == 0", "return n % 2 == 1")],
       [((4,), True)], [((7,), False), ((0,), True), ((10,), True)]),
    _f("is_adult", "age", "returns True when age is 18 or more", "return age >= 18",
       [("wrong_comparison", "return age >= 18", "return age > 18")],
       [((30,), True)], [((18,), True), ((17,), False), ((65,), True)]),
    _f("last", "xs", "returns the last item of xs", "return xs[-1]",
       [("wrong_index", "return xs[-1]", "return xs[0]")],
       [(([1, 2, 3],), 3)], [(([5, 6],), 6), (([9],), 9), ((["a", "b", "c"],), "c")]),
    _f("first_n", "xs, n", "returns the first n items of xs", "return xs[:n]",
       [("off_by_one", "return xs[:n]", "return xs[:n - 1]")],
       [(([1, 2, 3, 4], 2), [1, 2])],
       [(([5, 6, 7], 3), [5, 6, 7]), (([1, 2], 1), [1]), (([4, 5, 6], 0), [])]),
    _f("count_up", "n", "returns the list 1, 2, ..., n", "return list(range(1, n + 1))",
       [("off_by_one", "return list(range(1, n + 1))", "return list(range(1, n))")],
       [((3,), [1, 2, 3])], [((1,), [1]), ((5,), [1, 2, 3, 4, 5]), ((0,), [])]),
    _f("doubled", "xs", "returns every item of xs times two", "return [x * 2 for x in xs]",
       [("wrong_operator", "return [x * 2 for x in xs]", "return [x + 2 for x in xs]")],
       [(([1, 5],), [2, 10])], [(([3],), [6]), (([],), []), (([0, -2, 4],), [0, -4, 8])]),
    _f("average", "xs", "returns the mean of the numbers in xs", "return sum(xs) / len(xs)",
       [("wrong_operator", "return sum(xs) / len(xs)", "return sum(xs) // len(xs)")],
       [(([2, 4],), 3.0)], [(([1, 2],), 1.5), (([5],), 5.0), (([1, 2, 4],), 7 / 3)]),
    _f("largest", "xs", "returns the largest number in xs", "return max(xs)",
       [("wrong_function", "return max(xs)", "return min(xs)")],
       [(([1, 9, 4],), 9)], [(([-3, -1, -8],), -1), (([7],), 7), (([2, 2, 5, 1],), 5)]),
    _f("reverse", "s", "returns the string s backwards", "return s[::-1]",
       [("wrong_index", "return s[::-1]", "return s[::1]")],
       [(("abc",), "cba")], [(("hello",), "olleh"), (("",), ""), (("ab",), "ba")]),
    _f("greet", "name", "returns the greeting 'Hello, NAME!'", "return 'Hello, ' + name + '!'",
       [("wrong_constant", "return 'Hello, ' + name + '!'", "return 'Hello ' + name + '!'")],
       [(("Ann",), "Hello, Ann!")],
       [(("Bo",), "Hello, Bo!"), (("",), "Hello, !"), (("Zed",), "Hello, Zed!")]),
    _f("count_positive", "xs", "returns how many numbers in xs are above zero",
       "return len([x for x in xs if x > 0])",
       [("wrong_comparison", "return len([x for x in xs if x > 0])",
         "return len([x for x in xs if x >= 0])")],
       [(([1, -2, 3],), 2)], [(([0, 0, 1],), 1), (([],), 0), (([-1, 0, 5, 6],), 2)]),
    _f("percent", "part, whole", "returns part as a percentage of whole", "return 100 * part / whole",
       [("swapped_arguments", "return 100 * part / whole", "return 100 * whole / part")],
       [((1, 4), 25.0)], [((1, 2), 50.0), ((3, 3), 100.0), ((2, 8), 25.0)]),
    _f("contains", "xs, x", "returns True when x is in xs", "return x in xs",
       [("negated_condition", "return x in xs", "return x not in xs")],
       [(([1, 2], 2), True)], [(([1, 2], 3), False), (([], 1), False), ((["a"], "a"), True)]),
    _f("join_words", "words", "returns the words joined by single spaces", "return ' '.join(words)",
       [("wrong_constant", "return ' '.join(words)", "return ''.join(words)")],
       [((["a", "b"],), "a b")], [((["hi", "there", "you"],), "hi there you"), (([],), ""), ((["x"],), "x")]),
    _f("clamp", "x, lo, hi", "returns x limited to the range lo to hi", "return max(lo, min(x, hi))",
       [("wrong_function", "return max(lo, min(x, hi))", "return max(lo, max(x, hi))")],
       [((5, 0, 10), 5)], [((-3, 0, 10), 0), ((12, 0, 10), 10), ((7, 1, 9), 7)]),
    _f("with_tax", "price, rate", "returns price plus rate percent of tax",
       "return price + price * rate / 100",
       [("wrong_operator", "return price + price * rate / 100", "return price * rate / 100")],
       [((100, 10), 110.0)], [((200, 5), 210.0), ((50, 0), 50.0), ((10, 50), 15.0)]),
    _f("sign", "x", "returns 1 for a positive x, -1 for a negative one and 0 for zero",
       "if x > 0:\n    return 1\nif x < 0:\n    return -1\nreturn 0",
       [("wrong_comparison", "if x < 0:", "if x <= 0:")],
       [((5,), 1)], [((-2,), -1), ((0,), 0), ((9,), 1)]),
    _f("total_length", "words", "returns the number of characters in all the words together",
       "total = 0\nfor w in words:\n    total += len(w)\nreturn total",
       [("wrong_accumulator", "    total += len(w)", "    total = len(w)")],
       [((["ab", "c"],), 3)], [((["abc", "de", "f"],), 6), (([],), 0), ((["xyz"],), 3)]),
    _f("evens", "xs", "returns the even numbers of xs in order", "return [x for x in xs if x % 2 == 0]",
       [("wrong_constant", "return [x for x in xs if x % 2 == 0]", "return [x for x in xs if x % 2 == 1]")],
       [(([1, 2, 3, 4],), [2, 4])], [(([6, 7],), [6]), (([],), []), (([1, 3],), [])]),
)

# Module names of the generated repositories (none shadows a standard-library module).
MODULES = ("mathutil", "geometry", "statkit", "textkit", "listops", "shop", "grades", "inventory", "scoring",
           "ledger", "planner", "toolbox")
HELPER_MODULES = ("helpers", "common", "basics", "core_ops")
