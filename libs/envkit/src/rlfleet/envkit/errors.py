"""Errors raised by the environment SDK."""

from __future__ import annotations


class EnvkitError(Exception):
    """Base class of every error this package raises on purpose."""


class SuiteFormatError(EnvkitError, ValueError):
    """A suite file line that does not follow the format; ``line`` is 1-based."""

    def __init__(self, line: int, message: str, path: str | None = None) -> None:
        self.line = line
        self.message = message
        self.path = path
        where = f"{path}:{line}" if path else f"line {line}"
        super().__init__(f"{where}: {message}")


class TaskGenerationError(EnvkitError, ValueError):
    """A generator was asked for more distinct tasks than its split and difficulty hold."""
