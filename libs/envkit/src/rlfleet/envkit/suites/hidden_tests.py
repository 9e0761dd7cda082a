"""The hidden test script the ``code`` and ``repo`` suites hand the verifier, in the contract the
``unit_tests`` verifier kind parses: one ``PASS <name>`` or ``FAIL <name>: <why>`` line per case, then
``RESULT passed=<p> failed=<f>``, and exit status 0 only when every case passed. The suites differ only
in how a case names and calls the function under test."""

from __future__ import annotations

from typing import Any

_SCRIPT = '''\
"""{title} prints PASS/FAIL per test and a RESULT line, exits 0 iff all pass."""
{imports}

{preamble}CASES = {cases!r}


def same(got, expected):
    if isinstance(expected, bool):
        return isinstance(got, bool) and got == expected
    if isinstance(expected, float):
        return isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
    return type(got) is type(expected) and got == expected


def main():
{setup}    failed = 0
    for index, {case} in enumerate(CASES):
        name = {name}
        try:
            got = {call}
        except BaseException as exc:
            failed += 1
            print(f"FAIL {{name}}: {{type(exc).__name__}}: {{exc}}")
            continue
        if same(got, expected):
            print(f"PASS {{name}}")
        else:
            failed += 1
            print(f"FAIL {{name}}: {mismatch}")
    print(f"RESULT passed={{len(CASES) - failed}} failed={{failed}}")
    return 1 if failed else 0


sys.exit(main())
'''


def hidden_test_script(*, title: str, cases: list[Any], case: str, name: str, call: str, mismatch: str,
                       imports: tuple[str, ...] = (), preamble: str = "", setup: str = "") -> str:
    """The script's source; `title` ends in its own punctuation. `case` unpacks one of `cases` and
    binds `args` and `expected`; `name` and `call` are expressions over it; `mismatch` is the text of an
    f-string, the FAIL line's reason when the value is wrong. `preamble` runs before CASES is bound and
    `setup` (indented) first in main()."""
    modules = "\n".join(f"import {module}" for module in sorted({"math", "sys", *imports}))
    return _SCRIPT.format(title=title, imports=modules, preamble=preamble, cases=cases,
                          setup=setup, case=case, name=name, call=call, mismatch=mismatch)
