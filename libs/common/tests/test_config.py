import json

import pytest
from pydantic import Field

from rlfleet.common.config import (
    ConfigError,
    NatsConfig,
    ServiceConfig,
    StrictModel,
    load_config,
    require,
)


class Limits(StrictModel):
    tokens: int = Field(100, gt=0, description="token budget")
    names: list[str] = Field(default_factory=list, description="names")


class DemoConfig(ServiceConfig):
    """A demo service."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    limits: Limits = Field(default_factory=Limits)
    peer_address: str = Field("", description="host:port of a peer")


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_apply_when_nothing_is_given():
    config = load_config(DemoConfig, [], prog="demo", environ={})
    assert config.grpc.port == 0
    assert config.limits.tokens == 100
    assert config.run_id == "default"


def test_toml_overrides_defaults_env_overrides_toml_and_cli_overrides_env(tmp_path):
    path = write(tmp_path, "run_id = 'from-toml'\n[limits]\ntokens = 5\n[grpc]\nport = 7001\n")
    environ = {"RLFLEET__LIMITS__TOKENS": "6", "RLFLEET__GRPC__PORT": "7002"}
    config = load_config(DemoConfig, ["--config", path, "--grpc.port", "7003"], prog="demo", environ=environ)
    assert config.run_id == "from-toml"
    assert config.limits.tokens == 6
    assert config.grpc.port == 7003


def test_set_flag_and_json_values_reach_nested_fields():
    config = load_config(DemoConfig, ["--set", "limits.names=[\"a\", \"b\"]", "--peer-address", "h:1"],
                         prog="demo", environ={})
    assert config.limits.names == ["a", "b"]
    assert config.peer_address == "h:1"


def test_underscored_flag_spelling_is_accepted_too():
    config = load_config(DemoConfig, ["--peer_address", "h:2"], prog="demo", environ={})
    assert config.peer_address == "h:2"


def test_unknown_key_in_toml_is_an_error_naming_the_key(tmp_path):
    path = write(tmp_path, "[limits]\ntokenz = 5\n")
    with pytest.raises(ConfigError, match="unknown key 'limits.tokenz'"):
        load_config(DemoConfig, ["--config", path], prog="demo", environ={})


def test_unknown_key_in_environment_is_an_error():
    with pytest.raises(ConfigError, match="unknown key 'grpc.prot'"):
        load_config(DemoConfig, [], prog="demo", environ={"RLFLEET__GRPC__PROT": "1"})


def test_unknown_key_in_set_is_an_error():
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        load_config(DemoConfig, ["--set", "nope=1"], prog="demo", environ={})


def test_invalid_value_says_where_and_what(tmp_path):
    with pytest.raises(ConfigError, match=r"limits.tokens: .*greater than 0"):
        load_config(DemoConfig, ["--set", "limits.tokens=0"], prog="demo", environ={})
    with pytest.raises(ConfigError, match=r"grpc.port: .*integer"):
        load_config(DemoConfig, ["--grpc.port", "abc"], prog="demo", environ={})


def test_missing_config_file_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(DemoConfig, ["--config", str(tmp_path / "missing.toml")], prog="demo", environ={})


def test_malformed_toml_is_a_one_line_error(tmp_path):
    path = write(tmp_path, "[limits\ntokens = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(DemoConfig, ["--config", path], prog="demo", environ={})


def test_set_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(DemoConfig, ["--set", "limits.tokens"], prog="demo", environ={})


def test_dry_run_prints_the_resolved_config_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_config(DemoConfig, ["--dry-run", "--set", "limits.tokens=9"], prog="demo", environ={})
    assert exit_info.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["limits"]["tokens"] == 9
    assert printed["grpc"]["max_message_bytes"] >= 4 << 20


def test_help_lists_every_leaf_field_with_its_description(capsys):
    with pytest.raises(SystemExit):
        load_config(DemoConfig, ["--help"], prog="demo", environ={})
    out = capsys.readouterr().out
    assert "--limits.tokens" in out and "token budget" in out
    assert "--peer-address" in out and "host:port of a peer" in out


def test_required_peer_address_fails_fast_with_the_ways_to_set_it():
    with pytest.raises(ConfigError, match="peer_address is required.*--peer_address.*RLFLEET__PEER_ADDRESS"):
        require("", "peer_address")
    assert require("h:1", "peer_address") == "h:1"
