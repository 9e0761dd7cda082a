"""`rlfleet-cpu-engine`: parse the config first, import torch/transformers after, so `--help` is instant.

`config_from_args` is the only place that knows about the command line; it maps flags one-to-one
onto `EngineConfig` fields (generated from the model, with the field descriptions as help): a
field of a section is a dotted flag as for the other services (`--telemetry.span-file`,
`--metrics.port`), and `--set KEY=VALUE` takes any key the way their `--set` does, which is how the
launcher passes its per-process overrides.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from rlfleet.common.config import format_validation_error
from rlfleet.engine.config import EngineConfig


def config_from_args(argv: Sequence[str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser(
        prog="rlfleet-cpu-engine", description="rlfleet's built-in CPU engine (SGLang HTTP API)"
    )
    leaves = _leaf_fields(EngineConfig)
    for path, field in leaves:
        default = (
            "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)}"
        )
        flags = ["--" + path.replace("_", "-")] + (["--" + path] if "_" in path else [])
        parser.add_argument(
            *flags,
            dest="field:" + path,
            metavar="VALUE",
            required=field.is_required(),
            help=f"{field.description} ({default})".replace("%", "%%"),
        )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="set any key as the other services take it, e.g. --set telemetry.span_file=spans.jsonl "
        "(repeatable; an explicit flag wins)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config as JSON and exit")
    args = vars(parser.parse_args(argv))
    # Values stay strings: pydantic parses them into each field's type (and says what is wrong).
    tree: dict[str, Any] = {}
    known = {path for path, _ in leaves}
    for item in args.pop("set"):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in known:
            parser.error(
                f"--set expects KEY=VALUE with one of the keys {', '.join(sorted(known))}; got {item!r}"
            )
        _set_path(tree, key, value)
    for dest, value in args.items():
        if dest.startswith("field:") and value is not None:
            _set_path(tree, dest.removeprefix("field:"), value)
    try:
        config = EngineConfig.model_validate(tree)
    except ValidationError as exc:
        parser.error(format_validation_error(exc))
    if args["dry_run"]:
        print(config.model_dump_json(indent=2))
        raise SystemExit(0)
    return config


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, field) of every scalar field: `telemetry.span_file` for a field of a section."""
    leaves = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            leaves += _leaf_fields(field.annotation, f"{prefix}{name}.")
        else:
            leaves.append((prefix + name, field))
    return leaves


def _set_path(tree: dict[str, Any], key: str, value: str) -> None:
    *sections, leaf = key.split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[leaf] = value


class _JsonFormatter(logging.Formatter):
    # One JSON object per line until libs/common ships the shared log setup.
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    import asyncio

    from rlfleet.common.errors import StartupError
    from rlfleet.engine.server import serve

    try:
        asyncio.run(serve(config))
    except StartupError as exc:  # e.g. the metrics port is taken: one line, not a traceback
        print(f"rlfleet-cpu-engine: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
