#!/usr/bin/env python3
"""rlfleet-healthcheck: exits 0 when the server answers healthy, 1 otherwise (one line on stderr).

    rlfleet-healthcheck                         gRPC health of 127.0.0.1:$RLFLEET__GRPC__PORT (50051)
    rlfleet-healthcheck HOST:PORT [--service S] gRPC health (grpc.health.v1.Health/Check) of that server
    rlfleet-healthcheck --http URL              HTTP 200 from URL (the CPU engine's /health)

Installed in every image as /usr/local/bin/rlfleet-healthcheck and used by the Dockerfiles'
HEALTHCHECK and by compose. gRPC goes over TLS with the container's credentials: the run's CA and the
one service certificate in $RLFLEET_SECRETS_DIR/certs/ (rlfleet.common.security). Kubernetes runs it as
an exec probe: the kubelet's native gRPC probe speaks plaintext, which these servers refuse.
"""

from __future__ import annotations

import argparse
import os
import sys


def grpc_serving(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlfleet.common import grpc_server, security
    from rlfleet.common.errors import StartupError

    # TLS, presenting the certificate of the service this container runs (mutual-TLS servers demand
    # one), from the secrets directory in RLFLEET_SECRETS_DIR.
    security.adopt_mounted_identity()
    try:
        opened = (grpc.insecure_channel(address) if security.plaintext()
                  else grpc_server.blocking_channel(address))
    except StartupError as exc:
        return False, f"{address}: {exc}"
    with opened as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def http_ok(url: str, timeout_s: float) -> tuple[bool, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"{url}: HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url}: {getattr(exc, 'reason', exc)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet-healthcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default="",
                        help="gRPC HOST:PORT (default 127.0.0.1:$RLFLEET__GRPC__PORT, else 50051)")
    parser.add_argument("--service", default="", help="health service name; empty = the whole server")
    parser.add_argument("--http", metavar="URL", help="check an HTTP endpoint instead of gRPC")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    if args.http:
        ok, detail = http_ok(args.http, args.timeout)
    else:
        address = args.address or f"127.0.0.1:{os.environ.get('RLFLEET__GRPC__PORT') or 50051}"
        ok, detail = grpc_serving(address, args.service, args.timeout)
    print(("healthy " if ok else "unhealthy ") + detail, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
