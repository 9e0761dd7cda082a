"""Typed configuration: defaults < TOML file < environment < command line.

Every service and tool declares one pydantic model (subclass of `StrictModel`, so unknown keys are
errors) and calls `load_config(Model, argv, prog=...)`. Field descriptions are the `--help` text.

- File: `--config FILE`, TOML (or JSON when FILE ends in .json: what `rlfleet up` writes for each
  process it starts).
- Environment: `RLFLEET__SECTION__FIELD=value` (double underscores separate levels).
- Command line: one flag per leaf field (`--grpc.port 7000`, `--ready-file F`; `_` may be `-`) and
  `--set section.field=value`.
- `--dry-run` prints the resolved config as TOML-like JSON and exits 0.

Values given as strings (environment, command line) are parsed as JSON when they look like JSON
(lists, objects, numbers, booleans) and otherwise kept as strings; pydantic then validates them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "RLFLEET__"
M = TypeVar("M", bound=BaseModel)


class ConfigError(Exception):
    """A config that cannot be loaded; the message is one line meant for the user."""


class StrictModel(BaseModel):
    """The base of every config model: unknown keys are errors (a misspelt `clip_eps_hgih` must not
    silently run with the default), and an assignment is validated like a file would be."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GrpcServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="address the gRPC server binds")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    max_message_bytes: int = Field(64 << 20, ge=4 << 20, description="max gRPC message size, both directions")
    grace_seconds: float = Field(5.0, ge=0, description="time in-flight RPCs get on shutdown")


class MetricsConfig(StrictModel):
    enabled: bool = Field(True, description="serve Prometheus metrics over HTTP")
    host: str = Field("127.0.0.1", description="address the metrics endpoint binds")
    port: int = Field(0, ge=0, le=65535, description="metrics port; 0 picks a free one")


class TelemetryConfig(StrictModel):
    otlp_endpoint: str = Field("", description="OTLP/gRPC collector for traces, e.g. http://otel:4317; "
                               "empty = off")
    export_timeout_s: float = Field(1.0, gt=0, description="longest an export may block at shutdown")
    span_file: str = Field("", description="also append every finished span as one JSON line to this file "
                           "(several processes may share it); empty = off")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="fraction of traces recorded when tracing is on "
                                "(an endpoint or a span file); decided at the root span")


class LogConfig(StrictModel):
    level: str = Field("INFO", description="log level: DEBUG, INFO, WARNING, ERROR")
    format: str = Field("json", pattern="^(json|text)$", description="json (one object per line) or text")


class NatsConfig(StrictModel):
    url: str = Field("", description="NATS server URL with JetStream, e.g. tls://127.0.0.1:4222 (TLS, "
                     "checked against the run's CA; nats:// is plaintext, which the platform's NATS refuses)")
    connect_timeout_s: float = Field(3.0, gt=0, description="give up connecting after this long")
    user: str = Field("", description="NATS user this process logs in as (its subject permissions)")
    password: str = Field("", description="its password; prefer password_file or RLFLEET__NATS__PASSWORD "
                          "(a flag shows in `ps`)")
    password_file: str = Field("", description="file holding the password (a mounted secret, "
                               "<run_dir>/secrets/nats-<user>.password)")
    ca_file: str = Field("", description="the run's CA certificate to check a tls:// server by; empty: this "
                         "process's credentials' (RLFLEET_CA_FILE or the secrets directory's ca.pem)")


class RedisConfig(StrictModel):
    url: str = Field("", description="Redis URL, e.g. rediss://127.0.0.1:6379/0 (TLS with this process's "
                     "certificate, checked against the run's CA; redis:// is plaintext, which the platform's "
                     "Redis refuses)")
    connect_timeout_s: float = Field(3.0, gt=0, description="give up connecting after this long")
    user: str = Field("", description="Redis ACL user this process logs in as (its key patterns)")
    password: str = Field("", description="its password; prefer password_file or RLFLEET__REDIS__PASSWORD "
                          "(a flag shows in `ps`)")
    password_file: str = Field("", description="file holding the password (a mounted secret, "
                               "<run_dir>/secrets/redis-<user>.password)")


class ProcessConfig(StrictModel):
    """What every rlfleet process has (the CPU engine, which serves HTTP, included)."""

    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    ready_file: str = Field("", description="write what the process serves (pid, ports, addresses) as JSON "
                            "here once it serves")


class ServiceConfig(ProcessConfig):
    """What every gRPC service has; services add their own sections."""

    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                        description="run namespace for streams and keys")
    grpc: GrpcServerConfig = Field(default_factory=GrpcServerConfig)


def propagate(model: BaseModel, values: dict[str, Any], *, shared: bool = False, where: str = "") -> None:
    """Hands values down into a nested config: each (nested) value of `values` is set on `model`
    unless `model`'s own config set it explicitly, which wins. With `shared` (a value the parent
    decides once for everyone, like run_id or the group size), an explicit different value is an
    error instead. Assignments are validated, the model's checks across fields included."""
    for key, value in values.items():
        name = f"{where}.{key}" if where else key
        current = getattr(model, key)
        if isinstance(value, dict) and isinstance(current, BaseModel):
            propagate(current, value, shared=shared, where=name)
        elif key not in model.model_fields_set:
            try:
                setattr(model, key, value)
            except ValidationError as exc:
                raise ValueError(f"{name}: {format_validation_error(exc)}") from None
        elif shared and current != value:
            raise ValueError(f"{name} is {current!r}, but {value!r} is set for everyone at the top: "
                             "set it there, once")


def require(value: str, name: str) -> str:
    """Fails fast on a peer address or URL that config left empty."""
    if not value:
        flag = "--" + name
        env = ENV_PREFIX + name.upper().replace(".", "__")
        raise ConfigError(f"{name} is required: set it in the config file, with {flag} or with {env}")
    return value


# ---------------------------------------------------------------------------------------------
# Loading


def _parse_scalar(text: str, model: type[BaseModel] | None = None, path: list[str] | None = None) -> Any:
    """A string from the environment or the command line as the value it stands for; kept as text
    for a field that takes text (so `--weight-version 0` or `--run-id 123` stay strings)."""
    if model is not None and path and _takes_text(_annotation(model, path)):
        return text
    stripped = text.strip()
    if stripped[:1] in "[{" or stripped in ("true", "false", "null") or _is_number(stripped):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            pass
    return text


def _annotation(model: type[BaseModel], path: list[str]) -> Any:
    """The annotation of the field at `path`, or None when there is none (pydantic says so later)."""
    annotation: Any = model
    for key in path:
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        field = annotation.model_fields.get(key)
        if field is None:
            return None
        annotation = field.annotation
    return annotation


def _takes_text(annotation: Any) -> bool:
    if annotation in (str, Path):
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(choice, str) for choice in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        return bool(options) and all(_takes_text(a) for a in options)
    return False


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {key} is not a section")
        node = child
    node[path[-1]] = value


def nested(settings: dict[str, Any]) -> dict[str, Any]:
    """A config tree from keys that may be dotted: {"metrics.enabled": False, "redis": {"url": u}}
    is {"metrics": {"enabled": False}, "redis": {"url": u}}."""
    tree: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            value = nested(value)
        path = key.split(".")
        current = _get_path(tree, path)
        both_sections = isinstance(current, dict) and isinstance(value, dict)
        _set_path(tree, path, merge(current, value) if both_sections else value)
    return tree


def _get_path(tree: dict[str, Any], path: list[str]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, section by section."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    leaves = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves.extend(_leaf_fields(annotation, f"{prefix}{name}."))
        else:
            leaves.append((prefix + name, field))
    return leaves


def _describe(field: Any) -> str:
    text = field.description or ""
    default = field.get_default(call_default_factory=True)
    if get_origin(field.annotation) is None or get_args(field.annotation):
        text += f" (default: {json.dumps(default, default=str)})"
    return text.replace("%", "%%")


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file: TOML, or JSON when it ends in .json (what the launcher writes: JSON has null,
    which a field like `tis_cap = None` needs)."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"config file {file} does not exist")
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
    if file.suffix == ".json":
        try:
            tree = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid JSON: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {file} must hold a JSON object")
        return tree
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None


def env_overrides(environ: dict[str, str] | None = None,
                  model: type[BaseModel] | None = None) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in (os.environ if environ is None else environ).items():
        if key.startswith(ENV_PREFIX) and len(key) > len(ENV_PREFIX):
            path = key[len(ENV_PREFIX):].lower().split("__")
            _set_path(tree, path, _parse_scalar(value, model, path))
    return tree


def format_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(root)"
        if error["type"] == "extra_forbidden":
            problems.append(f"unknown key '{where}'")
        elif not error["loc"]:  # a check across fields: the message says it all
            problems.append(error["msg"].removeprefix("Value error, "))
        else:
            problems.append(f"{where}: {error['msg']} (got {error.get('input')!r})")
    return "; ".join(problems)


def build_parser(model: type[BaseModel], prog: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description or model.__doc__)
    parser.add_argument("--config", metavar="FILE", help="config file: TOML, or JSON if it ends in .json")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override any key, e.g. --set grpc.port=7000 (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    for path, field in _leaf_fields(model):
        flags = ["--" + path.replace("_", "-")]
        if "_" in path:
            flags.append("--" + path)  # the key as written in TOML works too
        parser.add_argument(*flags, dest="field:" + path, metavar="VALUE", help=_describe(field))
    return parser


def resolve(model: type[M], toml: dict[str, Any], env: dict[str, Any], cli: dict[str, Any]) -> M:
    merged = merge(merge(toml, env), cli)
    try:
        return model.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(model: type[M], argv: list[str] | None = None, *, prog: str,
                environ: dict[str, str] | None = None, description: str = "") -> M:
    """Parses argv and returns the resolved config; `--dry-run` prints it and exits."""
    parser = build_parser(model, prog, description)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cli: dict[str, Any] = {}
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        path = key.strip().split(".")
        _set_path(cli, path, _parse_scalar(value, model, path))
    for dest, value in vars(args).items():
        if dest.startswith("field:") and value is not None:
            path = dest[len("field:"):].split(".")
            _set_path(cli, path, _parse_scalar(value, model, path))
    toml = read_toml(args.config) if args.config else {}
    config = resolve(model, toml, env_overrides(environ, model), cli)
    if args.dry_run:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        raise SystemExit(0)
    return config
