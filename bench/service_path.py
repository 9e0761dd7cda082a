"""What the service path costs: engine tokens/s straight to the engine vs through session server + gateway.

    .venv/bin/python bench/service_path.py [--concurrency 1 8 32] [--new-tokens 64] [--turns 4]
                                           [--episodes 2] [--repeats 2] [--threads 1] [--model DIR]
                                           [--observation call|with-generate] [--compare-plaintext]

Starts NATS, Redis, a CPU engine on the default model (built into a temp dir unless --model is
given), a gateway and a session server, all on free loopback ports. At concurrency C, C workers
each run `--episodes` multi-turn episodes back to back: a chat prompt, then `--turns` times
"generate --new-tokens tokens (ignore_eos), append an 8-token observation".

- direct: the worker keeps the token list itself and calls the engine's /generate with it.
- service: OpenSession, Generate / AppendObservation through the session server (which calls the
  gateway, which calls the engine), CloseSession (the trajectory is published on JetStream). With
  `--observation with-generate` a turn is one call, as the environment SDK makes it: the previous
  turn's observation rides in the Generate request instead of an AppendObservation call of its own
  (the engine is sent the same requests either way).

`--compare-plaintext` starts two service stacks side by side on the one engine: as deployed (TLS
between every process, mutual TLS between services, NATS and Redis over TLS, a client token checked
on every call) and with the services, NATS and Redis in plaintext without access checks
(RLFLEET_INSECURE_PLAINTEXT_FOR_BENCHMARKS=1, benchmarks only). Each repeat runs the service path
through both, back to back, alternating which goes first, so that a shared machine's drifting load
falls on both alike; it prints what security costs at each concurrency: throughput of the secure
service path against the plaintext one (median of the repeats), the p50 added per turn of both,
and each stack's CPU per turn: what the secure path adds outside the engine, also as a share of
a plaintext turn's whole CPU (engine included), which is the throughput a CPU-bound machine loses
to it and, unlike tokens/s, hardly moves with other load. The secure run calls as an environment client
(a token issued for the run), as a real environment does.

Both paths send the engine the same requests (same prompt lengths, same new tokens). Printed per
concurrency: generated tokens/s of each path and their ratio; the per-turn latency the service
path adds (a Generate call's wall time minus its engine round trip as the gateway measured it,
plus the AppendObservation call, if the turn makes one), p50 and p99; the median turn latency of
both paths; and the CPU seconds each process (engine, gateway, session server, NATS, Redis, this
client) used during the level's service-path runs, which is where a slower path's time goes on a
machine of few cores. Each level runs `--repeats` times, alternating which path goes first, and
the median is reported. On a shared machine the ratio moves with other load: read it with the
per-turn figures, which do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2 as pb
from rlfleet.api.session.v1 import session_pb2_grpc
from rlfleet.common.chat import render_messages
from rlfleet.common.engine_client import EngineClient, EngineTimeouts
from rlfleet.common.grpc_server import channel

OBSERVATION = [1, 40, 41, 42, 43, 44, 45, 2]  # an 8-token tool result


@dataclass
class LevelResult:
    generated: int = 0
    elapsed: float = 0.0
    turn_latencies: list[float] = field(default_factory=list)
    added: list[float] = field(default_factory=list)  # service path only

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.elapsed


def sampling(args, seed: int) -> dict:
    return {"max_new_tokens": args.new_tokens, "ignore_eos": True, "sampling_seed": seed}


async def direct_level(url: str, prompts: list[list[int]], concurrency: int, args) -> LevelResult:
    result = LevelResult()
    async with EngineClient(url, timeouts=EngineTimeouts(generate_s=3600)) as client:

        async def worker(index: int) -> None:
            for episode in range(args.episodes):
                ids = list(prompts[(index + episode) % len(prompts)])
                for turn in range(args.turns):
                    started = time.perf_counter()
                    reply = await client.generate(ids, sampling(args, index * 1000 + episode * 10 + turn))
                    result.turn_latencies.append(time.perf_counter() - started)
                    ids += reply.output_ids + OBSERVATION
                    result.generated += len(reply.output_ids)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        result.elapsed = time.perf_counter() - started
    return result


def observation(session_id: str) -> pb.AppendObservationRequest:
    return pb.AppendObservationRequest(session_id=session_id, token_ids=common_pb2.TokenIds(ids=OBSERVATION))


async def service_level(address: str, prompts: list[list[int]], concurrency: int, args) -> LevelResult:
    result = LevelResult()
    with_generate = args.observation == "with-generate"
    async with channel(address) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)

        async def worker(index: int) -> None:
            for episode in range(args.episodes):
                opened = await sessions.OpenSession(pb.OpenSessionRequest(
                    prompt_token_ids=common_pb2.TokenIds(ids=prompts[(index + episode) % len(prompts)]),
                    max_total_tokens=0))
                walls, appends = [], []
                for turn in range(args.turns):
                    params = sampling(args, index * 1000 + episode * 10 + turn)
                    request = pb.GenerateRequest(
                        session_id=opened.session_id, sampling=common_pb2.SamplingParams(
                            max_new_tokens=params["max_new_tokens"], ignore_eos=True,
                            seed=params["sampling_seed"]))
                    if with_generate and turn > 0:  # the previous turn's tool result rides along
                        request.observation.CopyFrom(observation(opened.session_id))
                    started = time.perf_counter()
                    reply = await sessions.Generate(request)
                    walls.append(time.perf_counter() - started)
                    result.generated += len(reply.token_ids)
                    if with_generate:
                        appends.append(0.0)
                        continue
                    started = time.perf_counter()
                    await sessions.AppendObservation(observation(opened.session_id))
                    appends.append(time.perf_counter() - started)
                closed = await sessions.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id,
                                                                            return_trajectory=True))
                engine_round_trips = [s.latency_s for s in closed.trajectory.spans
                                      if s.kind == common_pb2.SPAN_KIND_GENERATED]
                for wall, append, engine in zip(walls, appends, engine_round_trips, strict=True):
                    result.turn_latencies.append(wall)
                    result.added.append(wall - engine + append)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        result.elapsed = time.perf_counter() - started
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class CpuMeter:
    """CPU seconds (user + system, all threads) of named processes, read from the kernel."""

    def __init__(self, pids: dict[str, int]) -> None:
        import psutil

        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}

    def read(self) -> dict[str, float]:
        return {name: sum(p.cpu_times()[:2]) for name, p in self.processes.items()}

    @staticmethod
    def line(before: dict[str, float], after: dict[str, float]) -> str:
        used = {name: after[name] - before[name] for name in after}
        return ", ".join(f"{name} {value:.1f}"
                         for name, value in used.items()) + f"; total {sum(used.values()):.1f}"


async def bench(engine_url: str, session_address: str, tokenizer_path: Path, args,
                meter: CpuMeter | None = None) -> dict[int, tuple]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    questions = [f"What is {a}*({a + 3}+{a % 7})?" for a in range(1, 41)]
    prompts = [tokenizer.encode(render_messages([{"role": "user", "content": q}], add_generation_prompt=True),
                                add_special_tokens=False).ids for q in questions]
    warm = argparse.Namespace(**{**vars(args), "turns": 1, "episodes": 1, "new_tokens": 8})
    await direct_level(engine_url, prompts, 4, warm)
    await service_level(session_address, prompts, 4, warm)
    results = {}
    for concurrency in args.concurrency:
        direct_runs, service_runs = [], []
        for repeat in range(args.repeats):
            # Alternate which path goes first, so that drift in the machine's load favours neither.
            if repeat % 2 == 0:
                direct_runs.append(await direct_level(engine_url, prompts, concurrency, args))
            cpu_before = meter.read() if meter else {}
            service_runs.append(await service_level(session_address, prompts, concurrency, args))
            if meter:
                print(f"concurrency {concurrency:>3} service run {repeat}: "
                      f"{service_runs[-1].tokens_per_s:8.1f} tok/s, "
                      f"cpu s: {CpuMeter.line(cpu_before, meter.read())}", flush=True)
            if repeat % 2 == 1:
                direct_runs.append(await direct_level(engine_url, prompts, concurrency, args))
        direct = statistics.median(r.tokens_per_s for r in direct_runs)
        service = statistics.median(r.tokens_per_s for r in service_runs)
        added = [a for r in service_runs for a in r.added]
        direct_turn = statistics.median(t for r in direct_runs for t in r.turn_latencies)
        service_turn = statistics.median(t for r in service_runs for t in r.turn_latencies)
        results[concurrency] = (direct, service, percentile(added, 0.5), percentile(added, 0.99))
        print(f"concurrency {concurrency:>3}: direct {direct:8.1f} tok/s   service {service:8.1f} tok/s   "
              f"ratio {service / direct:5.1%}   added per turn p50 {percentile(added, 0.5) * 1000:6.1f} ms "
              f"p99 {percentile(added, 0.99) * 1000:6.1f} ms   turn p50 direct {direct_turn * 1000:6.0f} ms "
              f"service {service_turn * 1000:6.0f} ms", flush=True)
    return results


def build_default_model(out: Path) -> None:
    from rlfleet.engine.build_model import ModelSpec, build
    from rlfleet.envkit.corpus import default_corpus

    build(out, default_corpus(seed=0), seed=0, spec=ModelSpec())


def prepared_model(args, work: Path, note: str = "") -> tuple[Path, dict]:
    """`--model`, or the default model built in `work`, and its config.json; prints what the run drives."""
    model = args.model
    if model is None:
        model = work / "model"
        build_default_model(model)
    config = json.loads((model / "config.json").read_text())
    observations = "in the next Generate" if args.observation == "with-generate" else "by AppendObservation"
    print(f"model: qwen2 hidden {config['hidden_size']} x {config['num_hidden_layers']} layers, vocab "
          f"{config['vocab_size']}; engine torch threads {args.threads}; "
          f"{args.turns} turns x {args.new_tokens} "
          f"new tokens per episode, {args.episodes} episodes per worker, observations {observations}{note}",
          flush=True)
    return model, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per turn")
    parser.add_argument("--turns", type=int, default=4, help="generate + observation turns per episode")
    parser.add_argument("--episodes", type=int, default=2, help="episodes per worker, back to back")
    parser.add_argument("--repeats", type=int, default=2, help="runs per level and path (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: build the default)")
    parser.add_argument("--observation", choices=("call", "with-generate"), default="call",
                        help="how a turn hands the engine its observation on the service path: its own "
                             "AppendObservation call after each Generate (two round trips a turn), or in the "
                             "next Generate, as the environment SDK does (one)")
    parser.add_argument("--compare-plaintext", action="store_true",
                        help="also run with the services in plaintext and print what TLS + auth cost")
    args = parser.parse_args()
    if args.compare_plaintext:
        compare_plaintext(args)
    else:
        run_set(args, plaintext=False)


def compare_plaintext(args) -> None:
    """Both stacks at once on one engine; each repeat runs both back to back (alternating the order)."""

    from rlfleet.common import security
    from rlfleet.common.processes import ServiceProcess, start_nats, start_redis
    from rlfleet.common.testing import client_env
    from rlfleet.engine.testing import EngineProcess
    from rlfleet.session.testing import gateway_config, session_server_config

    secrets = security.ensure_local_credentials()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        work = Path(tmp)
        model, config = prepared_model(args, work, "; secure and plaintext side by side")
        started: list = []
        stacks: dict[str, dict] = {}
        try:
            engine = EngineProcess(model, work / "engine", torch_threads=args.threads,
                                   max_running_requests=64, weight_version="0", engine_id="e0").start()
            started.append(engine)
            for name in ("secure", "plaintext"):
                plain = name == "plaintext"
                here = work / name
                extra = {security.PLAINTEXT_ENV: "1"} if plain else {}
                nats = start_nats(here / "nats",
                                  tls=None if plain else security.server_tls_files(secrets, "nats"))
                started.append(nats)
                redis = start_redis(here / "redis",
                                    tls=None if plain else security.server_tls_files(secrets, "redis"))
                started.append(redis)
                gateway = ServiceProcess("rlfleet-gateway", here, env=extra, config=gateway_config(
                    redis.url, "bench", [("e0", engine.url)])).start()
                started.append(gateway)
                session = ServiceProcess(
                    "rlfleet-session-server", here, env=extra, config=session_server_config(
                        nats.url, redis.url, "bench", gateway.address, str(model),
                        max_open_sessions=1024, max_total_tokens=config["max_position_embeddings"])).start()
                started.append(session)
                stacks[name] = {"address": session.address,
                                "env": extra or client_env("bench", "bench-client"),
                                "meter": CpuMeter({"gateway": gateway.pid, "session-server": session.pid,
                                                   "nats": nats.pid, "redis": redis.pid})}
            asyncio.run(compare_levels(model / "tokenizer.json", stacks, engine.pid, args))
        finally:
            for process in reversed(started):
                process.stop()


async def compare_levels(tokenizer_path: Path, stacks: dict[str, dict], engine_pid: int, args) -> None:
    import os

    import psutil
    from tokenizers import Tokenizer

    from rlfleet.common import security

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    questions = [f"What is {a}*({a + 3}+{a % 7})?" for a in range(1, 41)]
    prompts = [tokenizer.encode(render_messages([{"role": "user", "content": q}], add_generation_prompt=True),
                                add_special_tokens=False).ids for q in questions]
    client, engine = psutil.Process(), psutil.Process(engine_pid)
    names = ("TOKEN_ENV", "CA_ENV", "PLAINTEXT_ENV")

    async def run(name: str, concurrency: int, level_args) -> tuple[LevelResult, dict[str, float]]:
        # The client's channel is made in service_level: plaintext or TLS with this stack's token.
        for var in names:
            os.environ.pop(getattr(security, var), None)
        os.environ.update(stacks[name]["env"])
        meter = stacks[name]["meter"]
        before = {**meter.read(), "client": sum(client.cpu_times()[:2]),
                  "engine": sum(engine.cpu_times()[:2])}
        result = await service_level(stacks[name]["address"], prompts, concurrency, level_args)
        after = {**meter.read(), "client": sum(client.cpu_times()[:2]), "engine": sum(engine.cpu_times()[:2])}
        return result, {k: after[k] - before[k] for k in after}

    warm = argparse.Namespace(**{**vars(args), "turns": 1, "episodes": 1, "new_tokens": 8})
    for name in stacks:
        await run(name, 4, warm)
    for concurrency in args.concurrency:
        runs: dict[str, list[tuple[LevelResult, dict[str, float]]]] = {name: [] for name in stacks}
        for repeat in range(args.repeats):
            order = list(stacks) if repeat % 2 == 0 else list(reversed(stacks))
            for name in order:
                result, cpu = await run(name, concurrency, args)
                runs[name].append((result, cpu))
                turns = len(result.added)
                services = sum(v for k, v in cpu.items() if k != "engine")
                print(f"concurrency {concurrency:>3} repeat {repeat} {name:>9}: "
                      f"{result.tokens_per_s:8.1f} tok/s, added "
                      f"per turn p50 {percentile(result.added, 0.5) * 1000:6.2f} ms; cpu ms per turn: "
                      + ", ".join(f"{k} {v / turns * 1000:.2f}" for k, v in cpu.items())
                      + f"; all but the engine {services / turns * 1000:.2f}", flush=True)
        summary = {}
        for name, items in runs.items():
            added = [a for r, _ in items for a in r.added]
            services = [sum(v for k, v in cpu.items() if k != "engine") / len(r.added) for r, cpu in items]
            whole = [sum(cpu.values()) / len(r.added) for r, cpu in items]
            summary[name] = (statistics.median(r.tokens_per_s for r, _ in items), percentile(added, 0.5),
                             statistics.median(services), statistics.median(whole))
        (s_tps, s_p50, s_cpu, _), (p_tps, p_p50, p_cpu, p_whole) = summary["secure"], summary["plaintext"]
        print(f"security at concurrency {concurrency:>3}: "
              f"service path {s_tps:8.1f} tok/s secure vs {p_tps:8.1f} "
              f"plaintext ({s_tps / p_tps - 1:+.1%}); added per turn p50 {s_p50 * 1000:6.2f} ms secure "
              f"vs {p_p50 * 1000:6.2f} ms plaintext ({(s_p50 - p_p50) * 1000:+.2f} ms); cpu per turn outside "
              f"the engine {s_cpu * 1000:.2f} ms secure vs {p_cpu * 1000:.2f} ms plaintext "
              f"({(s_cpu - p_cpu) * 1000:+.2f} ms, "
              f"{(s_cpu - p_cpu) / p_whole:+.1%} of the plaintext turn's CPU "
              f"with the engine's)", flush=True)


def run_set(args, plaintext: bool) -> dict[int, tuple]:
    import os

    from rlfleet.common import security

    if plaintext:
        os.environ[security.PLAINTEXT_ENV] = "1"
    else:
        os.environ.pop(security.PLAINTEXT_ENV, None)
    print(f"--- {'PLAINTEXT, no access checks' if plaintext else 'secure: TLS, mutual TLS, client token'}",
          flush=True)

    from rlfleet.common.processes import ServiceProcess, start_nats, start_redis
    from rlfleet.common.testing import client_env
    from rlfleet.engine.testing import EngineProcess
    from rlfleet.session.testing import gateway_config, session_server_config

    secrets = security.ensure_local_credentials()

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        work = Path(tmp)
        model, config = prepared_model(args, work)
        # As deployed, NATS and Redis speak TLS only (Redis mutual TLS); plaintext in the plaintext set.
        nats = start_nats(work / "nats",
                          tls=None if plaintext else security.server_tls_files(secrets, "nats"))
        redis = start_redis(work / "redis",
                            tls=None if plaintext else security.server_tls_files(secrets, "redis"))
        processes = []
        try:
            engine = EngineProcess(model, work / "engine", torch_threads=args.threads,
                                   max_running_requests=64, weight_version="0", engine_id="e0").start()
            processes.append(engine)
            gateway = ServiceProcess("rlfleet-gateway", work, config=gateway_config(
                redis.url, "bench", [("e0", engine.url)])).start()
            processes.append(gateway)
            session = ServiceProcess("rlfleet-session-server", work, config=session_server_config(
                nats.url, redis.url, "bench", gateway.address, str(model),
                max_open_sessions=1024, max_total_tokens=config["max_position_embeddings"])).start()
            processes.append(session)
            if not plaintext:  # this process calls as an environment client, with a token of the run
                os.environ.update(client_env("bench", "bench-client"))
            try:
                meter = CpuMeter({"engine": engine.pid, "gateway": gateway.pid, "session-server": session.pid,
                                  "nats": nats.pid, "redis": redis.pid, "client": os.getpid()})
                results = asyncio.run(bench(engine.url, session.address,
                                            model / "tokenizer.json", args, meter))
            finally:
                os.environ.pop(security.TOKEN_ENV, None)
                os.environ.pop(security.CA_ENV, None)
        finally:
            for process in reversed(processes):
                process.stop()
            redis.stop()
            nats.stop()
    if 32 in results:
        direct, service, _p50, _p99 = results[32]
        print("service path at concurrency 32: "
              f"{service / direct:.1%} of the engine's throughput (aim >= 90%)")
    return results


if __name__ == "__main__":
    main()
