"""The whole platform launched as processes, checked over gRPC, NATS and Redis, then stopped."""

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from redis.exceptions import NoPermissionError

from rlfleet.cli.health import probe
from rlfleet.cli.launcher import PlatformState, is_ours
from rlfleet.common import security
from rlfleet.common.config import NatsConfig, RedisConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import check_health
from rlfleet.common.infra_auth import run_dir_login
from rlfleet.common.redis_store import connect_redis, key
from rlfleet.common.streams import connect_nats, durable_name, ensure_consumer, publish

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RLFLEET = str(Path(sys.executable).parent / "rlfleet")
SERVICES = {"sandbox-manager": "rlfleet.sandbox.v1.SandboxService",
            "rollout-gateway": "rlfleet.gateway.v1.GatewayService",
            "session-server": "rlfleet.session.v1.SessionService",
            "verifier": "rlfleet.verifier.v1.VerifierService",
            "trainer": "rlfleet.trainer.v1.TrainerService",
            "weight-broker": "rlfleet.broker.v1.BrokerService",
            "controller": "rlfleet.controller.v1.RunControl"}


ENGINES = {"engine-0"}  # the default launch starts one CPU engine
MODEL_CACHE: dict[str, str] = {}


def rlfleet(*args, timeout=120):
    if args[0] == "up":
        args = (*args, "--model-cache-dir", MODEL_CACHE["dir"])
    return subprocess.run([RLFLEET, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def _one_model_cache(tmp_path_factory):
    """Every launch here reuses one build of the default model (as runs/.cache does across runs)."""
    MODEL_CACHE["dir"] = str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture
def platform(tmp_path):
    run_dir = tmp_path / "run"
    up = rlfleet("up", "--detach", "--run-dir", str(run_dir), "--run-id", "itest")
    assert up.returncode == 0, up.stdout + up.stderr
    yield run_dir, up.stdout
    rlfleet("down", "--run-dir", str(run_dir))


async def test_launched_platform_is_healthy_and_its_nats_and_redis_work(platform):
    run_dir, printed = platform
    state = PlatformState.load(run_dir)
    assert {p.name for p in state.processes} == {"nats", "redis", *ENGINES, *SERVICES}
    for name in ("nats", "redis", *ENGINES, *SERVICES):
        assert name in printed  # the table of what runs where
    assert all(row.healthy for row in await probe(state))
    operator = security.run_credentials(run_dir)  # the launch made the run's own CA
    for name, service in SERVICES.items():
        assert await check_health(state.by_name(name).address, service, credentials=operator), name
    for name in SERVICES:
        assert (run_dir / "logs" / f"{name}.log").exists()

    # NATS and Redis let in only the launch's users (secrets in the run directory, 0600), each to
    # its own subjects and keys: the trainer publishes a policy version, the broker's user reads it.
    nats_url, redis_url = state.by_name("nats").url, state.by_name("redis").url
    trainer = await connect_nats(NatsConfig(url=nats_url, **run_dir_login(run_dir, "nats", "trainer")),
                                 "itest")
    broker = await connect_nats(NatsConfig(url=nats_url, **run_dir_login(run_dir, "nats", "weight-broker")),
                                "itest")
    js = broker.jetstream()
    await ensure_consumer(js, "POLICY", durable_name("itest", "itest"), "itest")
    await publish(trainer.jetstream(), "POLICY", "itest", b"v1", msg_type="PolicyVersion", msg_id="v1")
    sub = await js.pull_subscribe_bind(durable_name("itest", "itest"), "POLICY")
    (msg,) = await sub.fetch(1, timeout=5)
    assert msg.data == b"v1"
    await msg.ack()
    with pytest.raises(TimeoutError):  # not the broker's to publish, nor another run's subject
        await publish(js, "POLICY", "itest", b"v2", msg_type="PolicyVersion", timeout_s=1.0)
    with pytest.raises(TimeoutError):
        await publish(trainer.jetstream(), "POLICY", "other-run", b"v2", msg_type="PolicyVersion",
                      timeout_s=1.0)
    await trainer.close()
    await broker.close()
    with pytest.raises(StartupError):
        await connect_nats(NatsConfig(url=nats_url, connect_timeout_s=1), "anonymous")

    redis = await connect_redis(RedisConfig(url=redis_url,
                                            **run_dir_login(run_dir, "redis", "session-server")))
    await redis.set(key("itest", "session", "probe"), b"ok")
    assert await redis.get(key("itest", "session", "probe")) == b"ok"
    with pytest.raises(NoPermissionError):
        await redis.set(key("itest", "probe"), b"outside its keys")
    await redis.aclose()
    with pytest.raises(StartupError):
        await connect_redis(RedisConfig(url=redis_url, connect_timeout_s=1))
    # TLS only: the same logins in plaintext are refused (the CA is the run's; mutual TLS for Redis)
    assert nats_url.startswith("tls://") and redis_url.startswith("rediss://")
    with pytest.raises(StartupError):
        await connect_nats(NatsConfig(url="nats://" + nats_url.split("://", 1)[1], connect_timeout_s=1,
                                      **run_dir_login(run_dir, "nats", "trainer")), "plaintext")
    with pytest.raises(StartupError):
        await connect_redis(RedisConfig(url="redis://" + redis_url.split("://", 1)[1], connect_timeout_s=1,
                                        **run_dir_login(run_dir, "redis", "session-server")))

    secrets = sorted((run_dir / "secrets").iterdir())
    assert secrets and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in secrets)
    passwords = [f.read_text().strip() for f in secrets if f.suffix == ".password"]
    written = [run_dir / "platform.json", *sorted((run_dir / "config").glob("*.json"))]
    assert not any(p in f.read_text() for p in passwords for f in written), \
        "only password files are referenced"

    status = rlfleet("status", "--run-dir", str(run_dir), "--once", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    processes = json.loads(status.stdout)["services"]
    assert len(processes) == 2 + len(ENGINES) + len(SERVICES)
    assert all(p["healthy"] for p in processes), processes


def test_down_stops_every_process_the_launch_started(platform):
    run_dir, _ = platform
    records = PlatformState.load(run_dir).processes
    assert all(is_ours(r) for r in records)
    down = rlfleet("down", "--run-dir", str(run_dir))
    assert down.returncode == 0, down.stderr
    assert "killed" not in down.stdout  # every process stopped on SIGTERM
    assert not any(is_ours(r) for r in records)
    assert rlfleet("status", "--run-dir", str(run_dir)).returncode == 1


def test_two_launches_side_by_side_do_not_collide(platform, tmp_path):
    run_dir, _ = platform
    other = tmp_path / "other"
    up = rlfleet("up", "--detach", "--run-dir", str(other), "--run-id", "other")
    try:
        assert up.returncode == 0, up.stderr
        first, second = PlatformState.load(run_dir), PlatformState.load(other)
        assert not {p.address for p in first.processes} & {p.address for p in second.processes}
        assert asyncio.run(probe(first)) and all(r.healthy for r in asyncio.run(probe(second)))
    finally:
        rlfleet("down", "--run-dir", str(other))


def test_a_second_launch_into_a_running_run_dir_is_refused(platform):
    run_dir, _ = platform
    again = rlfleet("up", "--detach", "--run-dir", str(run_dir))
    assert again.returncode == 1
    assert "already has a running platform" in again.stderr
    assert all(r.healthy for r in asyncio.run(probe(PlatformState.load(run_dir))))


def test_foreground_launch_stops_everything_on_ctrl_c(tmp_path):
    run_dir = tmp_path / "fg"
    proc = subprocess.Popen([RLFLEET, "up", "--run-dir", str(run_dir),
                             "--model-cache-dir", MODEL_CACHE["dir"]],
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "all healthy" in line:
            break
    records = PlatformState.load(run_dir).processes
    proc.send_signal(2)  # SIGINT, as Ctrl-C
    assert proc.wait(60) == 0
    assert not any(is_ours(r) for r in records)


def test_bad_launcher_config_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("servces = ['x']\n")
    result = rlfleet("up", "--config", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip() == "rlfleet up: unknown key 'servces'"
    assert json.loads(json.dumps(result.stderr))  # one line, no traceback
    assert "Traceback" not in result.stderr


async def test_killed_nats_and_redis_come_back_on_their_ports_with_their_data(tmp_path):
    """The launcher's supervision: NATS and Redis SIGKILLed are started again by `restart_dead` on
    the ports their clients know, with JetStream's and Redis's durable state; the exit is recorded."""
    import os
    import signal

    from rlfleet.cli.launcher import Platform
    from rlfleet.cli.platform_config import PlatformConfig

    platform = Platform(PlatformConfig(run_id="sup", run_dir=str(tmp_path / "run"), services=[], engines=0))
    platform.up()
    try:
        state = platform.state
        nats_url, redis_url = state.by_name("nats").url, state.by_name("redis").url
        run_dir = tmp_path / "run"
        nc = await connect_nats(NatsConfig(url=nats_url, **run_dir_login(run_dir, "nats", "trainer")),
                                "itest")
        js = nc.jetstream()
        from rlfleet.common.streams import ensure_streams

        await ensure_streams(js, ("POLICY",))
        await publish(js, "POLICY", "sup", b"kept", msg_type="PolicyVersion", msg_id="sup-1")
        redis = await connect_redis(RedisConfig(url=redis_url,
                                                **run_dir_login(run_dir, "redis", "sandbox-manager")))
        await redis.set(key("sup", "sandbox", "kept"), "yes")
        async with redis.pipeline(transaction=True) as pipe:  # a MULTI/EXEC in the append-only file
            pipe.set(key("sup", "sandbox", "in-a-transaction"), "yes")
            pipe.hset(key("sup", "sandbox", "lease"), "owner", "me")
            await pipe.execute()
        for name in ("nats", "redis"):
            os.killpg(state.by_name(name).pid, signal.SIGKILL)
        for name in ("nats", "redis"):
            await asyncio.to_thread(_wait_gone, state.by_name(name))
        events = await asyncio.to_thread(platform.restart_dead)
        assert sorted(e.split()[:2] for e in events) == [["nats", "restarted"], ["redis", "restarted"]], \
            events
        saved = PlatformState.load(tmp_path / "run")
        for name in ("nats", "redis"):
            record = saved.by_name(name)
            assert is_ours(record) and record.restarts == 1 and record.last_exit == "signal SIGKILL"
        assert (saved.by_name("nats").url, saved.by_name("redis").url) == (nats_url, redis_url)
        assert all(row.healthy for row in await probe(saved))
        # the client reconnected by itself
        assert await redis.get(key("sup", "sandbox", "kept")) in ("yes", b"yes")
        assert await redis.get(key("sup", "sandbox", "in-a-transaction")) in ("yes", b"yes"), \
            "a transaction's writes were lost replaying the append-only file"
        assert await redis.hget(key("sup", "sandbox", "lease"), "owner") in ("me", b"me")
        last = await _eventually_last(js)
        assert last == b"kept", "JetStream kept the message and the client reconnected"
        assert platform.restart_dead() == [], "nothing else is down"
        await nc.close()
        await redis.aclose()
    finally:
        platform.down()


def _wait_gone(record, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while is_ours(record) and time.monotonic() < deadline:
        time.sleep(0.05)


async def _eventually_last(js, within_s=20.0):
    import time

    deadline = time.monotonic() + within_s
    while True:
        try:
            return (await js.get_last_msg("POLICY", "rlfleet.sup.policy")).data
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
