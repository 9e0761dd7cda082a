"""`rlfleet-cpu-engine`: parse the config first, import torch/transformers after, so `--help` is instant.

`config_from_args` is the only place that knows about the command line; it maps flags one-to-one
onto `EngineConfig` fields (generated from the model, with the field descriptions as help) and
can be replaced by the shared config loader without touching the server.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
import typing
from collections.abc import Sequence

from rlfleet.engine.config import EngineConfig


def config_from_args(argv: Sequence[str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser(
        prog="rlfleet-cpu-engine", description="rlfleet's built-in CPU engine (SGLang HTTP API)"
    )
    for name, field in EngineConfig.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        kind = _scalar_type(field.annotation)
        default = "required" if field.is_required() else f"default {field.default}"
        parser.add_argument(
            flag, dest=name, type=kind, required=field.is_required(), help=f"{field.description} ({default})"
        )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config as JSON and exit")
    args = vars(parser.parse_args(argv))
    dry_run = args.pop("dry_run")
    config = EngineConfig(**{k: v for k, v in args.items() if v is not None})
    if dry_run:
        print(config.model_dump_json(indent=2))
        raise SystemExit(0)
    return config


def _scalar_type(annotation) -> type:
    # `int | None` -> int; Path stays Path; str for anything else.
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation if isinstance(annotation, type) else str


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

    from rlfleet.engine.server import serve

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
