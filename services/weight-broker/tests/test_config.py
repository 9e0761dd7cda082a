"""The broker's config: the shipped example loads, and engine sources are exclusive."""

from pathlib import Path

import pytest

from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.common.config import ConfigError, load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_shipped_config_loads(path):
    config = load_config(WeightBrokerConfig, ["--config", str(path)], prog="t", environ={})
    assert config.sync.transport in ("disk_delta", "disk_full", "distributed")


def test_a_gateway_and_a_static_engine_list_together_are_a_config_error():
    argv = ["--gateway-address", "127.0.0.1:1", "--engines", '[{"engine_id": "e", "url": "http://x"}]']
    with pytest.raises(ConfigError, match="either gateway_address"):
        load_config(WeightBrokerConfig, argv, prog="t", environ={})


def test_an_unknown_transport_is_a_config_error():
    with pytest.raises(ConfigError, match="sync.transport"):
        load_config(WeightBrokerConfig, ["--sync.transport", "carrier-pigeon"], prog="t", environ={})
