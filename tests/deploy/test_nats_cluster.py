"""The gpu-cluster overlay's 3-node NATS cluster, run here: three `nats-server -js` on loopback with
the rendered nats.conf and the Secret items deploy/k8s/make_secrets.py makes, their routes mutual TLS.

Only the addresses change (the pods' names become 127.0.0.1 and free ports, which the route
certificate's IP SAN covers); the TLS blocks, users and JetStream settings are the manifest's.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import deploy_helpers as h
import pytest

from rlfleet.common import security
from rlfleet.common.processes import free_port

TLS_SECRET = "rlfleet-tls"
RUN = "rlfleet"  # make_secrets.py's default run id, as the manifests'


def nats_binary() -> str:
    local = h.ROOT / ".venv" / "bin" / "nats-server"
    found = h.tool("nats-server") or (str(local) if local.exists() else None)
    if found is None:
        pytest.skip("nats-server is not installed")
    return found


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    directory = tmp_path_factory.mktemp("k8s-credentials")
    found = {s["metadata"]["name"]: {k: base64.b64decode(v) for k, v in s["data"].items()}
             for s in h.make_secrets(directory)}
    return found, directory


@pytest.fixture(scope="module")
def cluster_manifest(rendered):
    objects = h.by_kind_name(rendered["gpu-cluster"])
    conf = objects[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    spec = h.pod_spec(objects[("StatefulSet", "nats")])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    return conf, volumes, mounts


def materialize_pod(where: Path, conf: str, volumes: dict, mounts: dict, secrets: dict) -> None:
    """The pod's /etc/nats as the kubelet writes it, with `where` for /etc/nats."""
    for name in ("auth", "tls"):
        source = volumes[name]["secret"]
        directory = where / Path(mounts[name]).relative_to("/etc/nats")
        directory.mkdir(parents=True)
        for item in source["items"]:
            (directory / item["path"]).write_bytes(secrets[source["secretName"]][item["key"]])
    (where / "nats.conf").write_text(conf.replace("/etc/nats/", f"{where}/"))


class Node:
    def __init__(self, index: int, client: int, monitor: int, route: int) -> None:
        self.index, self.client, self.monitor, self.route = index, client, monitor, route
        self.process: subprocess.Popen | None = None
        self.log: Path | None = None

    def monitoring(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}{path}", timeout=5) as reply:
            return json.loads(reply.read())

    def routes(self) -> int:
        return self.monitoring("/routez")["num_routes"]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def localize(conf: str, node: Node, peers: list[Node], data: Path) -> str:
    """The manifest's config with this machine's addresses: ports and 127.0.0.1 for the pod names."""
    conf = conf.replace("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{node.client}")
    conf = conf.replace("http: 0.0.0.0:8222", f"http: 127.0.0.1:{node.monitor}")
    conf = conf.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{node.route}")
    conf = conf.replace("store_dir: /data", f"store_dir: {data}")
    for peer in peers:
        conf = conf.replace(f"nats://nats-{peer.index}.nats-headless:6222", f"nats://127.0.0.1:{peer.route}")
    assert "nats://nats-" not in conf and "0.0.0.0" not in conf, conf
    return conf


def start(binary: str, node: Node, where: Path) -> None:
    node.log = where / "nats.log"
    with node.log.open("w") as log:
        node.process = subprocess.Popen([binary, "-js", "-c", str(where / "nats.conf")], stdout=log,
                                        stderr=subprocess.STDOUT, env={"POD_NAME": f"nats-{node.index}",
                                                                       "PATH": "/usr/bin:/bin"})


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what}: {last!r}")


@pytest.fixture(scope="module")
def cluster(cluster_manifest, secrets, tmp_path_factory):
    conf, volumes, mounts = cluster_manifest
    found, _ = secrets
    binary = nats_binary()
    nodes = [Node(i, free_port(), free_port(), free_port()) for i in range(3)]
    try:
        for node in nodes:
            where = tmp_path_factory.mktemp(f"nats-{node.index}")
            materialize_pod(where, localize(conf, node, nodes, where / "data"), volumes, mounts, found)
            start(binary, node, where)
        for node in nodes:
            wait_for(lambda n=node: n.routes() == 2, 60, f"nats-{node.index}'s routes")
            wait_for(lambda n=node: n.monitoring("/healthz?js-enabled-only=true").get("status") == "ok", 60,
                     f"nats-{node.index}'s JetStream")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_the_route_certificate_names_every_route_of_the_manifest_and_is_not_the_run_cas(
        cluster_manifest, secrets, tmp_path):
    conf, _, _ = cluster_manifest
    found, _ = secrets
    tls = found[TLS_SECRET]
    (tmp_path / "route.pem").write_bytes(tls["nats-route.pem"])
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "route.pem"), "-noout", "-ext",
                           "subjectAltName,extendedKeyUsage"], capture_output=True, text=True,
                          check=True).stdout
    hosts = re.findall(r"nats://([\w.-]+):6222", conf)
    assert len(hosts) == 3
    for host in hosts:
        assert f"DNS:{host}" in text, (host, text)
    assert "TLS Web Client Authentication" in text and "TLS Web Server Authentication" in text
    for ca, verifies in (("nats-route-ca.pem", True), ("ca.pem", False)):
        (tmp_path / "ca.pem").write_bytes(tls[ca])
        result = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"),
                                 str(tmp_path / "route.pem")],
                                capture_output=True, text=True)
        assert (result.returncode == 0) is verifies, (ca, result.stdout + result.stderr)


async def _publish_and_read(nodes: list[Node], secrets_dir: Path, tls: dict[str, bytes]) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    from rlfleet.common.infra_auth import inbox_prefix

    (secrets_dir / "client-ca.pem").write_bytes(tls["ca.pem"])
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(secrets_dir / "client-ca.pem"))
    user = "session-server"  # the trajectories' publisher (rlfleet.common.infra_auth)
    password = (secrets_dir / f"nats-{user}.password").read_text().strip()
    nc = await nats.connect([f"tls://127.0.0.1:{n.client}" for n in nodes], tls=context, user=user,
                            password=password, inbox_prefix=inbox_prefix(user), connect_timeout=10,
                            max_reconnect_attempts=-1, reconnect_time_wait=0.5)
    try:
        js = nc.jetstream(timeout=10)
        info = await js.add_stream(StreamConfig(name="TRAJECTORIES", subjects=["rlfleet.*.trajectories"],
                                                storage=StorageType.FILE, num_replicas=3))
        assert info.config.num_replicas == 3
        subject = f"rlfleet.{RUN}.trajectories"
        for i in range(20):
            ack = await js.publish(subject, f"trajectory {i}".encode())
            assert ack.stream == "TRAJECTORIES" and ack.seq == i + 1
        info = await wait_async(lambda: _replicated(js, 20), "the stream's replicas")
        leader = info.cluster.leader
        # R3 survives a node: stop the leader; the other two elect one and take writes.
        stopped = next(n for n in nodes if f"nats-{n.index}" == leader)
        stopped.stop()
        ack = await wait_async(lambda: _publish(js, subject), "a publish after the leader stopped")
        assert ack.seq == 21
        info = await js.stream_info("TRAJECTORIES")
        assert info.state.messages == 21 and info.cluster.leader not in ("", None, leader), info.cluster
    finally:
        await nc.close()


async def _replicated(js, messages: int):
    info = await js.stream_info("TRAJECTORIES")
    replicas = info.cluster.replicas or []
    if (info.state.messages == messages and info.cluster.leader and len(replicas) == 2
            and all(r.current for r in replicas)):
        return info
    return None


async def _publish(js, subject: str):
    return await js.publish(subject, b"after failover", timeout=2)


async def wait_async(make, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = await make()
            if last:
                return last
        except Exception as exc:  # no leader yet: the nats-py errors vary
            last = exc
        await asyncio.sleep(0.5)
    raise AssertionError(f"{what}: {last!r}")


@pytest.mark.parametrize("rogue", ["plaintext", "run-ca-service-cert", "other-ca"])
def test_a_route_without_a_route_certificate_is_refused(rogue, cluster, cluster_manifest, secrets, tmp_path):
    """A fourth server pointing its route at the cluster: with no TLS, with a service's certificate of
    the run CA (trusting the route CA, so only the cluster's check can refuse it), or of another CA."""
    nodes = cluster
    _, directory = secrets
    target = next(n for n in nodes if n.process is not None and n.process.poll() is None)
    before = target.routes()
    node = Node(9, free_port(), free_port(), free_port())
    tls = ""
    if rogue != "plaintext":
        if rogue == "run-ca-service-cert":
            cert = directory / "certs" / "session-server.pem"
        else:
            security.ensure_secrets(tmp_path / "other-ca")
            cert = tmp_path / "other-ca" / "certs" / "session-server.pem"
            security.identity_pem(tmp_path / "other-ca", "session-server")
        tls = (f"tls {{ cert_file: {cert}, key_file: {cert}, ca_file: {directory / 'nats-route-ca.pem'}, "
               f"verify: true, timeout: 5 }}")
    (tmp_path / "nats.conf").write_text(
        f"server_name: rogue\nlisten: 127.0.0.1:{node.client}\nhttp: 127.0.0.1:{node.monitor}\n"
        f"jetstream {{ store_dir: {tmp_path / 'data'} }}\n"
        f"cluster {{ name: rlfleet, listen: 127.0.0.1:{node.route}, no_advertise: true, {tls}\n"
        f"  routes: [nats://127.0.0.1:{target.route}] }}\n")
    start(nats_binary(), node, tmp_path)
    try:
        wait_for(lambda: node.monitoring("/varz"), 30, "the rogue server")
        # The rogue dials the target's route port and retries about once a second: each attempt is a
        # failed handshake in the target's log, and none becomes a route.
        mark = len(target.log.read_text().splitlines())
        wait_for(lambda: sum("TLS route handshake error" in line
                             for line in target.log.read_text().splitlines()[mark:]) >= 2, 30,
                 "the target refusing the rogue's route")
        assert target.routes() == before
        assert node.routes() == 0
    finally:
        node.stop()


def route_handshake(port: int, cert: Path, ca: Path) -> bytes:
    """A TLS handshake on a route port as a route makes it (TLS first, then the server's INFO),
    presenting `cert` whatever CA the server asks for (Go's client would send none); the INFO."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(str(ca))
    context.load_cert_chain(str(cert))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            # TLS 1.3: a refused client certificate arrives as an alert on the first read
            return tls.recv(65536)


def test_the_route_port_takes_the_route_certificate_and_refuses_a_service_certificate(cluster, secrets):
    _, directory = secrets
    target = next(n for n in cluster if n.process is not None and n.process.poll() is None)
    route_ca = directory / f"{security.NATS_ROUTE_CA}.pem"
    info = route_handshake(target.route,
                           directory / "certs" / f"{security.NATS_ROUTE_IDENTITY}.pem", route_ca)
    assert info.startswith(b"INFO ") and b'"cluster":"rlfleet"' in info, info[:300]
    # A certificate of the run's CA: what every service holds. It names a service, never a route.
    mark = len(target.log.read_text().splitlines())
    with pytest.raises(ssl.SSLError, match="BAD_CERTIFICATE"):
        route_handshake(target.route, directory / "certs" / "session-server.pem", route_ca)
    refused = wait_for(lambda: [line for line in target.log.read_text().splitlines()[mark:]
                                if "TLS route handshake error" in line], 10,
                       "the target's log of the refusal")
    assert "certificate signed by unknown authority" in refused[0], refused


def test_an_r3_stream_replicates_over_the_tls_routes_and_survives_a_node(cluster, secrets, tmp_path):
    found, directory = secrets
    asyncio.run(_publish_and_read(cluster, directory, found[TLS_SECRET]))


def test_the_route_ca_key_stays_in_the_directory(secrets):
    found, directory = secrets
    key = (directory / f"{security.NATS_ROUTE_CA}.key").read_bytes().strip()
    assert b"PRIVATE KEY" in key
    for name, data in found.items():
        assert f"{security.NATS_ROUTE_CA}.key" not in data
        assert all(key not in value for value in data.values()), name
    assert os.stat(directory / f"{security.NATS_ROUTE_CA}.key").st_mode & 0o777 == 0o600
