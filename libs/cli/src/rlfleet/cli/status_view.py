"""`rlfleet status`: a live view of a launched platform.

Each refresh asks every source once, with short deadlines, and shows what answered:

    services   gRPC health / PING of every process the launch started, and its restarts (platform.json)
    engines    the gateway's registry (pool, state, policy version, in-flight requests)
    versions   the broker (latest, canary, accepted) and the trainer (its version, step, idle fraction)
    queues     JetStream consumers of the run's TASKS and TRAJECTORIES (pending, ack pending)
    staleness  trainer version minus the oldest engine version (and the last step's max)
    throughput trajectories/s and steps/s from the change since the previous refresh
    stop rules the run's last verifier audit and long-tail account, and a stop rule that fired
               (from the run directory's run_state.json: the controller's copy of the run's state)

A source that does not answer is shown as down with the reason; the view itself never fails on it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.cli.health import Health, probe
from rlfleet.cli.launcher import PlatformState
from rlfleet.common.config import NatsConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import channel
from rlfleet.common.infra_auth import run_dir_login
from rlfleet.common.streams import connect_nats, subject

STREAMS = ("TASKS", "TRAJECTORIES")
TIMEOUT_S = 2.0


@dataclass
class Snapshot:
    taken: float  # time.monotonic()
    services: list[Health]
    engines: list[dict[str, Any]] = field(default_factory=list)
    broker: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    queues: list[dict[str, Any]] = field(default_factory=list)
    trajectories: int | None = None  # messages of this run on TRAJECTORIES
    down: dict[str, str] = field(default_factory=dict)  # source -> why it did not answer
    # stop rules: last audit, long tail, the rule that fired
    run: dict[str, Any] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return all(s.healthy for s in self.services)


async def collect(state: PlatformState) -> Snapshot:
    snapshot = Snapshot(time.monotonic(), await probe(state))
    names = {p.name: p for p in state.processes}
    await asyncio.gather(_engines(snapshot, names), _broker(snapshot, names), _trainer(snapshot, names),
                         _queues(snapshot, state))
    snapshot.run = stop_rules(Path(state.run_dir))
    return snapshot


def stop_rules(run_dir: Path) -> dict[str, Any]:
    """What the run driver last wrote about its stop rules; empty without a readable run_state.json."""
    try:
        record = json.loads((run_dir / "run_state.json").read_text()).get("record", {})
    except (OSError, ValueError, AttributeError):
        return {}
    audits = record.get("audits") or []
    return {"stop_rule": record.get("stop_rule", ""),
            "long_tail": (record.get("long_tail") or {}).get("message", ""),
            "audit": audits[-1] if audits else None}


async def _rpc(snapshot: Snapshot, source: str, names: dict, call) -> Any:
    """One status call to a launched service; None (and the reason noted) when it does not answer."""
    import grpc

    record = names.get(source)
    if record is None or not record.address:
        return None
    try:
        async with channel(record.address) as ch:
            return await call(ch)
    except grpc.aio.AioRpcError as exc:
        snapshot.down[source] = f"{exc.code().name}: {exc.details() or ''}".strip()
    except (OSError, TimeoutError) as exc:
        snapshot.down[source] = str(exc) or type(exc).__name__
    return None


async def _engines(snapshot: Snapshot, names: dict) -> None:
    reply = await _rpc(snapshot, "rollout-gateway", names, lambda ch: gateway_pb2_grpc.GatewayServiceStub(ch)
                       .ListEngines(gateway_pb2.ListEnginesRequest(), timeout=TIMEOUT_S))
    if reply is None:
        return
    for engine in reply.engines:
        snapshot.engines.append({
            "engine_id": engine.engine_id, "pool": gateway_pb2.EnginePool.Name(engine.pool).removeprefix(
                "ENGINE_POOL_").lower(),
            "state": gateway_pb2.EngineState.Name(engine.state).removeprefix("ENGINE_STATE_").lower(),
            "policy_version": engine.policy_version, "in_flight": engine.in_flight_requests,
            "sessions": engine.sessions, "last_error": engine.last_error})


async def _broker(snapshot: Snapshot, names: dict) -> None:
    reply = await _rpc(snapshot, "weight-broker", names, lambda ch: broker_pb2_grpc.BrokerServiceStub(ch)
                       .GetStatus(broker_pb2.GetStatusRequest(), timeout=TIMEOUT_S))
    if reply is not None:
        snapshot.broker = {"latest": reply.latest_version, "canary": reply.canary_version,
                           "accepted": reply.accepted_version, "fleet": reply.fleet_version,
                           "weights": {e.engine_id: _weights(e) for e in reply.engines}}


def _transport(value: int) -> str:
    return broker_pb2.Transport.Name(value).removeprefix("TRANSPORT_").lower() if value else "-"


def _weights(engine: broker_pb2.EngineVersion) -> str:
    """The engine's configured transport, and what its last update took (as the broker saw it)."""
    last = (f" (last {_transport(engine.last_transport)}, pause {engine.last_pause_s * 1000:.1f} ms, "
            f"{engine.last_bytes / 2**20:.1f} MiB)") if engine.last_transport else ""
    return _transport(engine.transport) + last


async def _trainer(snapshot: Snapshot, names: dict) -> None:
    reply = await _rpc(snapshot, "trainer", names, lambda ch: trainer_pb2_grpc.TrainerServiceStub(ch)
                       .GetStatus(trainer_pb2.GetStatusRequest(), timeout=TIMEOUT_S))
    if reply is not None:
        snapshot.trainer = {"state": reply.state, "version": reply.policy_version, "step": reply.step,
                            "idle_fraction": reply.idle_fraction, "trained": reply.trained_trajectories,
                            "pending_groups": reply.pending_groups,
                            "staleness_max": reply.last_metrics.get("staleness_max"),
                            "dropped": dict(reply.dropped_by_reason)}


async def _queues(snapshot: Snapshot, state: PlatformState) -> None:
    from nats.errors import Error as NatsError

    try:
        url = state.by_name("nats").url
    except KeyError:
        return
    try:
        login = run_dir_login(state.run_dir, "nats", "operator")
        nc = await connect_nats(NatsConfig(url=url, connect_timeout_s=TIMEOUT_S, **login), "rlfleet-status")
    except StartupError as exc:
        snapshot.down["nats"] = str(exc)
        return
    try:
        js = nc.jetstream(timeout=TIMEOUT_S)
        for stream in STREAMS:
            wanted = subject(stream, state.run_id)
            for info in await js.consumers_info(stream):
                if info.config.filter_subject == wanted:
                    snapshot.queues.append({"stream": stream, "consumer": info.name,
                                            "pending": info.num_pending or 0,
                                            "ack_pending": info.num_ack_pending or 0})
        stream_info = await js.stream_info("TRAJECTORIES",
                                           subjects_filter=subject("TRAJECTORIES", state.run_id))
        snapshot.trajectories = sum((stream_info.state.subjects or {}).values())
    except (NatsError, TimeoutError) as exc:  # streams not created yet, or NATS going away
        snapshot.down["nats"] = str(exc) or type(exc).__name__
    finally:
        await nc.close()


# -- derived figures -----------------------------------------------------------------------------


def staleness(snapshot: Snapshot) -> int | None:
    """Trainer version minus the oldest version a healthy engine serves."""
    versions = [e["policy_version"]
                for e in snapshot.engines if e["state"] != "unhealthy" and e["policy_version"] >= 0]
    if not versions or "version" not in snapshot.trainer or snapshot.trainer["version"] < 0:
        return None
    return snapshot.trainer["version"] - min(versions)


def rates(snapshot: Snapshot, previous: Snapshot | None) -> dict[str, float | None]:
    """Per-second changes since the previous snapshot (None without one, or when a side is missing)."""
    result: dict[str, float | None] = {"trajectories_per_s": None, "steps_per_s": None}
    if previous is None or snapshot.taken <= previous.taken:
        return result
    elapsed = snapshot.taken - previous.taken
    if snapshot.trajectories is not None and previous.trajectories is not None:
        result["trajectories_per_s"] = (snapshot.trajectories - previous.trajectories) / elapsed
    if "step" in snapshot.trainer and "step" in previous.trainer:
        result["steps_per_s"] = (snapshot.trainer["step"] - previous.trainer["step"]) / elapsed
    return result


# -- rendering -----------------------------------------------------------------------------------


def to_json(snapshot: Snapshot, previous: Snapshot | None) -> str:
    data = asdict(snapshot)
    data.pop("taken")
    data.update(healthy=snapshot.healthy, staleness=staleness(snapshot), **rates(snapshot, previous))
    return json.dumps(data, indent=2)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines]


def _fmt(value: float | None, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def render(snapshot: Snapshot, previous: Snapshot | None, state: PlatformState, color: bool = False) -> str:
    def paint(text: str, ok: bool) -> str:
        return f"\x1b[{32 if ok else 31}m{text}\x1b[0m" if color else text

    lines = [f"rlfleet {state.run_id}  ({state.run_dir})  {time.strftime('%H:%M:%S')}", "", "services"]
    lines += _table(("process", "pid", "address", "state", "restarts"), [
        (s.name, str(s.pid), s.address or "-",
         paint("healthy" if s.healthy
               else ("down" if not s.running else f"unhealthy ({s.detail})"), s.healthy),
         _restarts(s)) for s in snapshot.services])
    lines += ["", "engines"]
    if snapshot.engines:
        weights = snapshot.broker.get("weights", {})
        lines += _table(("engine", "pool", "state", "version", "in flight", "sessions", "weights"), [
            (e["engine_id"], e["pool"], paint(e["state"], e["state"] == "healthy"), str(e["policy_version"]),
             str(e["in_flight"]), str(e["sessions"]), weights.get(e["engine_id"], "-"))
            for e in snapshot.engines])
    else:
        lines.append("  " + ("gateway down: " + snapshot.down["rollout-gateway"]
                             if "rollout-gateway" in snapshot.down
                             else "none known"))
    lines += ["", "versions"]
    trainer, broker = snapshot.trainer, snapshot.broker
    lines.append("  trainer  " + (f"v{trainer['version']}  step {trainer['step']}  {trainer['state']}  "
                                  f"idle {_fmt(trainer['idle_fraction'] * 100, '.0f')}%  "
                                  f"trained {trainer['trained']}"
                                  if trainer else paint("down" + _why(snapshot, "trainer"), False)))
    lines.append("  broker   " + (f"latest {_version(broker['latest'])}  "
                                  f"canary {_version(broker['canary'])}  "
                                  f"accepted {_version(broker['accepted'])}  "
                                  f"fleet {_version(broker['fleet'])}"
                                  if broker else paint("down" + _why(snapshot, "weight-broker"), False)))
    lines += ["", "queues"]
    if snapshot.queues:
        lines += _table(("stream", "consumer", "pending", "ack pending"), [
            (q["stream"], q["consumer"], str(q["pending"]), str(q["ack_pending"])) for q in snapshot.queues])
    else:
        lines.append("  " + ("nats down: " + snapshot.down["nats"] if "nats" in snapshot.down
                             else "no consumers yet"))
    flow = rates(snapshot, previous)
    stale = staleness(snapshot)
    last_max = trainer.get("staleness_max") if trainer else None
    lines += ["", f"staleness  {_fmt(stale, 'd')} versions (trainer - oldest engine); last step max "
                  f"{_fmt(last_max, '.0f')}",
              f"throughput {_fmt(flow['trajectories_per_s'])} "
              f"trajectories/s  {_fmt(flow['steps_per_s'], '.3f')} "
              f"steps/s  ({_fmt(snapshot.trajectories, 'd')} trajectories published)"]
    return "\n".join(lines + _stop_rule_lines(snapshot.run, paint))


def _stop_rule_lines(run: dict[str, Any], paint) -> list[str]:
    if not run:
        return []
    audit = run.get("audit")
    lines = ["", "stop rules"]
    lines.append("  verifier audit  " + (f"{audit['when']}: n {audit['n']}, false positive rate "
                                         f"{audit['false_positive_rate']:.3f}, false negative rate "
                                         f"{audit['false_negative_rate']:.3f}" if audit else "none yet"))
    lines.append("  long tail       " + (run.get("long_tail") or "not accounted yet"))
    if run.get("stop_rule"):
        lines.append("  " + paint(f"FIRED: {run['stop_rule']}", False))
    return lines


def _restarts(health: Health) -> str:
    """"0", or "2 (last: signal SIGKILL at 12:03:04)": how often the launcher restarted it."""
    if not health.restarts:
        return "0"
    when = time.strftime("%H:%M:%S", time.localtime(health.last_restart_unix))
    return f"{health.restarts} (last: {health.last_exit or 'unknown'} at {when})"


def _why(snapshot: Snapshot, source: str) -> str:
    return f" ({snapshot.down[source]})" if source in snapshot.down else ""


def show(state: PlatformState, *, once: bool, as_json: bool, interval_s: float) -> int:
    """Prints one snapshot (`once`) or refreshes until Ctrl-C; exits 0 when every process is healthy.

    Ctrl-C ends the refreshing once the refresh under way is done (each of its calls has a
    deadline), not by cancelling it: a cancelled refresh tears its TLS connections down under
    cancellation, which on a loaded machine took longer than the refresh itself. A second Ctrl-C
    stops at once."""
    previous = None
    color = sys.stdout.isatty() and not as_json
    stop = threading.Event()

    def on_sigint(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    # Not the default handler, so asyncio.run leaves it in place rather than cancel on Ctrl-C.
    before = signal.signal(signal.SIGINT, on_sigint)
    try:
        while True:
            snapshot = asyncio.run(collect(state))
            text = to_json(snapshot, previous) if as_json else render(snapshot, previous, state, color)
            if once:
                print(text, flush=True)
                return 0 if snapshot.healthy else 1
            if stop.is_set():
                return 0
            # Home and clear, then the frame: a plain terminal redraw, no curses.
            sys.stdout.write(("\x1b[H\x1b[2J" if color else "") + text + "\n\n(Ctrl-C to quit)\n")
            sys.stdout.flush()
            previous = snapshot
            if stop.wait(interval_s):
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, before)


def _version(version: int) -> str:
    """v<N>, or "none" where the broker has no version yet (it reports -1: none accepted, none targeted)."""
    return f"v{version}" if version >= 0 else "none"
