"""Kinds that compare the committed answer with the task's: ``exact`` and ``numeric``."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from rlfleet.verifier.kinds.base import VerifierKind
from rlfleet.verifier.kinds.records import Episode, Reason, ReasonCode

# Optional sign, digits with or without thousands separators, optional fraction and exponent.
_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d*)?(?:[eE][+-]?\d+)?")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-"})


def normalise_text(text: str, case_sensitive: bool = False) -> str:
    """NFKC, surrounding whitespace stripped, inner runs of whitespace collapsed to one space."""
    text = " ".join(unicodedata.normalize("NFKC", text).split())
    return text if case_sensitive else text.casefold()


def parse_number(text: str) -> Decimal | None:
    """``"1,781"``, ``"1781.0"``, ``"-33"``, ``"1.5e3"`` as exact decimals; None for anything else."""
    text = unicodedata.normalize("NFKC", text).strip().translate(_MINUS_SIGNS)
    if not _NUMBER_RE.fullmatch(text) or not any(ch.isdigit() for ch in text.split("e")[0].split("E")[0]):
        return None
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _no_answer() -> list[Reason]:
    return [Reason(ReasonCode.NO_ANSWER, "the episode ended without an <answer>")]


class ExactKind(VerifierKind):
    """Pass when the answer equals ``spec.answer`` after :func:`normalise_text`."""

    name = "exact"

    def check(self, spec: Mapping[str, Any], episode: Episode, answer: str | None) -> list[Reason]:
        if answer is None:
            return _no_answer()
        case_sensitive = bool(spec.get("case_sensitive", False))
        if normalise_text(answer, case_sensitive) == normalise_text(spec["answer"], case_sensitive):
            return []
        return [
            Reason(
                ReasonCode.WRONG_ANSWER,
                "the answer does not match",
                {"expected": spec["answer"], "got": answer},
            )
        ]


class NumericKind(VerifierKind):
    """Pass when the answer is a number within ``spec.tolerance`` (absolute, default 0) of ``spec.answer``."""

    name = "numeric"

    def check(self, spec: Mapping[str, Any], episode: Episode, answer: str | None) -> list[Reason]:
        if answer is None:
            return _no_answer()
        expected = parse_number(str(spec["answer"]))
        if expected is None:
            raise ValueError(f"the task's numeric answer {spec['answer']!r} is not a number")
        got = parse_number(answer)
        details = {"expected": str(spec["answer"]), "got": answer}
        if got is None:
            return [Reason(ReasonCode.WRONG_ANSWER, "the answer is not a number", details)]
        if abs(got - expected) <= Decimal(str(spec.get("tolerance", 0.0))):
            return []
        return [Reason(ReasonCode.WRONG_ANSWER, "the answer is outside the tolerance", details)]
