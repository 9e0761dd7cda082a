#!/usr/bin/env python3
"""The Secrets the Kubernetes manifests mount, from a run's credentials directory.

    python deploy/k8s/make_secrets.py DIR [--run-id RUN] [--namespace NS] > rlfleet-secrets.yaml
    kubectl apply -f rlfleet-secrets.yaml

DIR is made on the first call and kept (mode 0600, like `rlfleet up`'s `<run_dir>/secrets/`): the
NATS/Redis users and the gRPC trust material come from the code compose uses
(rlfleet.cli.compose_config: `write_secrets`, `write_tls_secrets`), so a later call prints the same
credentials. Two Secrets come out:

- `rlfleet-infra-auth`: every NATS/Redis password, NATS's authorization block, Redis's ACL file;
- `rlfleet-tls`: the run's CA certificate, the token key, the engines' api keys, the workers' token and
  one `<identity>.pem` (key and certificate) per service identity, plus `engine-registrar.pem` for the
  SGLang pods' registrar, and the NATS cluster's route material (`nats-route.pem`, signed by a CA of
  its own, `nats-route-ca.pem`; SANs: the pods `nats-<i>.nats-headless` of the gpu-cluster overlay's
  StatefulSet, `--nats-replicas` of them). Each pod mounts only its own items (deploy/k8s/base/*.yaml).

The CA keys (DIR/ca.key, DIR/nats-route-ca.key) go in neither: they stay in DIR, where new certificates are
signed. So do the token list and the operator's certificate; with DIR = RUN/secrets, `rlfleet token issue
NAME --run-dir RUN` issues environment-client tokens the pods accept (docs/security.md "Kubernetes").
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

import yaml

from rlfleet.cli.compose_config import write_secrets, write_tls_secrets
from rlfleet.common import security

REGISTRAR = "engine-registrar"  # the SGLang pods' sidecar registers its engine with the gateway
NEVER = {"ca.key", f"{security.NATS_ROUTE_CA}.key"}
TLS_FILES = ("ca.pem", "token.key", *security.ENGINE_KEY_FILES, "worker.token",
             f"{security.NATS_ROUTE_CA}.pem")
# deploy/k8s/base/nats.yaml: the Service the cluster's routes name the pods by
NATS_HEADLESS = "nats-headless"


def nats_route_hosts(replicas: int, namespace: str) -> list[str]:
    """The names a NATS server of the StatefulSet is reached by on its route: the pod under the headless
    Service, short (the overlay's `routes`) and qualified."""
    return [f"nats-{i}.{NATS_HEADLESS}{suffix}" for i in range(replicas)
            for suffix in ("", f".{namespace}.svc", f".{namespace}.svc.cluster.local")]
INFRA_SUFFIXES = (".password", ".acl", ".conf")


def secret(name: str, namespace: str, files: dict[str, bytes]) -> dict:
    leaked = NEVER & set(files)
    if leaked:
        raise ValueError(f"{name} would carry {sorted(leaked)}")
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/part-of": "rlfleet"}},
            "data": {key: base64.b64encode(value).decode() for key, value in sorted(files.items())}}


def secret_manifests(directory: Path, run_id: str, namespace: str = "rlfleet",
                     nats_replicas: int = 3) -> list[dict]:
    """Makes DIR's credentials when missing; returns the two Secret objects."""
    write_secrets(directory, run_id, container_uid=None)
    write_tls_secrets(directory, run_id)
    security.identity_pem(directory, REGISTRAR)
    security.nats_route_pem(directory, nats_route_hosts(nats_replicas, namespace))
    infra = {p.name: p.read_bytes() for p in sorted(directory.iterdir())
             if p.is_file() and p.name.endswith(INFRA_SUFFIXES)}
    tls = {name: (directory / name).read_bytes() for name in TLS_FILES}
    # Secret keys are flat; the pods' `items` put each back at certs/<identity>.pem.
    tls |= {p.name: p.read_bytes() for p in sorted((directory / "certs").glob("*.pem"))
            if p.stem != "operator"}
    return [secret("rlfleet-infra-auth", namespace, infra), secret("rlfleet-tls", namespace, tls)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the run's credentials (made when missing, then kept)")
    parser.add_argument("--run-id", default="rlfleet",
                        help="the run the tokens are bound to (the manifests': rlfleet)")
    parser.add_argument("--namespace", default="rlfleet")
    parser.add_argument("--nats-replicas", type=int, default=3,
                        help="NATS servers the route certificate names (the gpu-cluster "
                             "overlay's 3); read when it is made")
    args = parser.parse_args(argv)
    yaml.safe_dump_all(secret_manifests(args.directory, args.run_id, args.namespace, args.nats_replicas),
                       sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
