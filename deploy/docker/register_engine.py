#!/usr/bin/env python3
"""rlfleet-register-engine: registers one SGLang-compatible engine with the rollout gateway.

Runs beside an engine (a compose service, or a sidecar in the engine's pod):

1. waits until the engine answers its health URL (default `<url>/health_generate`);
2. calls `GatewayService.RegisterEngine` (retrying while the gateway is unreachable);
3. every `--interval` seconds checks `ListEngines` and registers again if the engine is missing
   (e.g. the registry was wiped);
4. on SIGTERM/SIGINT calls `DeregisterEngine` and exits 0, so a pod being deleted leaves the
   fleet before its engine stops.

`--once` registers and exits (for an initContainer, or a one-shot job).

    rlfleet-register-engine --gateway dns:///rollout-gateway:50051 --engine-id sglang-0 \
        --url http://10.0.0.7:30000 --kind sglang --pool fleet

Every flag also reads an environment variable (ENGINE_ID, ENGINE_URL, ...; see --help), so a
Kubernetes sidecar can take the pod name and IP from the downward API.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger("rlfleet-register-engine")

POOLS = {"fleet": "ENGINE_POOL_FLEET", "canary": "ENGINE_POOL_CANARY", "candidate": "ENGINE_POOL_CANDIDATE"}
KINDS = {"cpu": "ENGINE_KIND_CPU", "sglang": "ENGINE_KIND_SGLANG"}
RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "RESOURCE_EXHAUSTED")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="rlfleet-register-engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default=env("GATEWAY_ADDRESS", ""),
                        help="gateway gRPC target, e.g. dns:///rollout-gateway:50051 (env GATEWAY_ADDRESS)")
    parser.add_argument("--engine-id", default=env("ENGINE_ID", ""),
                        help="unique engine name (env ENGINE_ID)")
    parser.add_argument("--url", default=env("ENGINE_URL", ""),
                        help="engine base URL reachable from the gateway (env ENGINE_URL)")
    parser.add_argument("--kind", choices=sorted(KINDS), default=env("ENGINE_KIND", "sglang"),
                        help="cpu or sglang (env ENGINE_KIND, default sglang)")
    parser.add_argument("--pool", choices=sorted(POOLS), default=env("ENGINE_POOL", "fleet"),
                        help="fleet, canary or candidate (env ENGINE_POOL, default fleet)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="engine label (repeatable; env ENGINE_LABELS as a JSON object)")
    parser.add_argument("--start-draining", action="store_true",
                        default=env("ENGINE_START_DRAINING", "") in ("1", "true"),
                        help="register DRAINING until the broker has synced its weights")
    parser.add_argument("--wait-url", default=env("ENGINE_HEALTH_URL", ""),
                        help="engine health URL to wait for (default <url>/health_generate; 'none' skips)")
    parser.add_argument("--interval", type=float, default=float(env("REGISTER_INTERVAL_S", "15")),
                        help="seconds between registry checks (env REGISTER_INTERVAL_S, default 15)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per RPC or health request")
    parser.add_argument("--once", action="store_true", help="register, then exit")
    args = parser.parse_args(argv)
    missing = [flag for flag, value in (("--gateway", args.gateway), ("--engine-id", args.engine_id),
                                        ("--url", args.url)) if not value]
    if missing:
        parser.error(f"{', '.join(missing)} required (flag or environment)")
    labels = json.loads(env("ENGINE_LABELS", "{}") or "{}")
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--label expects KEY=VALUE, got {item!r}")
        labels[key] = value
    args.labels = labels
    args.url = args.url.rstrip("/")
    if not args.wait_url:
        args.wait_url = f"{args.url}/health_generate"
    return args


class Registrar:
    def __init__(self, args: argparse.Namespace, stop: threading.Event) -> None:
        import grpc

        from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

        self.args = args
        self.stop = stop
        self.grpc = grpc
        self.pb = gateway_pb2
        from rlfleet.common import grpc_server, security

        # TLS with the credentials of this pod/container (RLFLEET_SECRETS_DIR: the run's CA and the one
        # service certificate mounted there); registering is a service or operator right.
        security.adopt_mounted_identity()
        self.channel = (grpc.insecure_channel(args.gateway) if security.plaintext()
                        else grpc_server.blocking_channel(args.gateway))
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    def wait_for_engine(self) -> bool:
        if self.args.wait_url == "none":
            return True
        delay = 1.0
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.args.wait_url, timeout=self.args.timeout) as reply:
                    if reply.status == 200:
                        log.info("engine healthy at %s", self.args.wait_url)
                        return True
            except (urllib.error.URLError, OSError):
                pass
            self.stop.wait(delay)
            delay = min(delay * 1.5, 10.0)
        return False

    def register(self) -> bool:
        """Registers, retrying with backoff on errors worth retrying; False if stopped first."""
        request = self.pb.RegisterEngineRequest(
            engine_id=self.args.engine_id, url=self.args.url,
            pool=self.pb.EnginePool.Value(POOLS[self.args.pool]),
            kind=self.pb.EngineKind.Value(KINDS[self.args.kind]),
            labels=self.args.labels, start_draining=self.args.start_draining)
        delay = 1.0
        while not self.stop.is_set():
            try:
                engine = self.stub.RegisterEngine(request, timeout=self.args.timeout)
            except self.grpc.RpcError as exc:
                if exc.code().name not in RETRYABLE:
                    raise
                log.warning("register %s: %s: %s; retrying in %.0f s", self.args.engine_id,
                            exc.code().name, exc.details(), delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 30.0)
                continue
            log.info("registered %s at %s (state %s)", engine.engine_id or self.args.engine_id,
                     self.args.url, self.pb.EngineState.Name(engine.state))
            return True
        return False

    def registered(self) -> bool:
        try:
            reply = self.stub.ListEngines(self.pb.ListEnginesRequest(), timeout=self.args.timeout)
        except self.grpc.RpcError as exc:
            log.warning("list engines: %s: %s", exc.code().name, exc.details())
            return True  # cannot tell; do not hammer a struggling gateway with registrations
        return any(e.engine_id == self.args.engine_id for e in reply.engines)

    def deregister(self) -> None:
        try:
            self.stub.DeregisterEngine(self.pb.DeregisterEngineRequest(engine_id=self.args.engine_id),
                                       timeout=self.args.timeout)
            log.info("deregistered %s", self.args.engine_id)
        except self.grpc.RpcError as exc:
            log.warning("deregister %s: %s: %s", self.args.engine_id, exc.code().name, exc.details())

    def run(self) -> int:
        if not self.wait_for_engine() or not self.register():
            return 0  # stopped before registering: nothing to undo
        if self.args.once:
            return 0
        while not self.stop.wait(self.args.interval):
            if not self.registered():
                log.warning("%s is no longer registered; registering again", self.args.engine_id)
                self.register()
        self.deregister()
        return 0


class _JsonFormatter(logging.Formatter):
    # The services' log shape: one JSON object per line.
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"ts": self.formatTime(record), "level": record.levelname,
                           "logger": record.name, "msg": record.getMessage()})


def main(argv: list[str] | None = None) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    args = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    code = Registrar(args, stop).run()
    log.info("exiting after %.0f s", time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())
