"""`rlfleet-cpu-engine`: parse the config first, import torch/transformers after, so `--help` is instant.

The config loads as every service's does (`rlfleet.common.config`: defaults < TOML or JSON file
< environment `RLFLEET__...` < flags), logs are the shared JSON lines, and the ready file says
`{"url", "port", "pid", "engine_id", "metrics_port"}` once the engine listens.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlfleet.common.config import ConfigError, load_config
from rlfleet.common.service import run_process
from rlfleet.engine.config import EngineConfig

NAME = "rlfleet-cpu-engine"


def config_from_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """The resolved config of a command line (what `--dry-run` prints)."""
    return load_config(EngineConfig, None if argv is None else list(argv), prog=NAME)


async def serve(config: EngineConfig) -> None:
    if config.model_path is None:
        raise ConfigError("model_path is required: set it in the config file, with --model-path or with "
                          "RLFLEET__MODEL_PATH")
    from rlfleet.engine.server import serve as serve_engine  # torch and transformers: after --help

    await serve_engine(config)


def main(argv: Sequence[str] | None = None) -> int:
    run_process(NAME, EngineConfig, serve, None if argv is None else list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
