"""The CPU one gRPC call costs in Python (grpc.aio on uvloop), before any work: the floor under
`bench/episode_cpu.py`'s per-episode figure.

    .venv/bin/python bench/grpc_floor.py [--calls 3000] [--concurrency 16] [--repeats 3]
                                         [--calls-per-episode 6]

A server process answers the standard health service's `Check` (a unary call with an empty
handler) and echoes the messages of one bidirectional stream; a client in this process makes
`--calls` calls at `--concurrency`, first as unary calls, then as messages on one open stream
(requests matched to answers by a key, as a multiplexed stream would carry them). CPU seconds of
each side (user + system, all threads, from /proc) per call; the median of `--repeats`. Plaintext
on loopback, no interceptor, no auth: the platform's calls cost at least this, TLS and its
interceptors on top. The last line multiplies the unary floor by `--calls-per-episode` (an
episode of the calc loop makes 6: OpenSession with its first turn, Generate, Verify and
CloseSession from the worker, two Generates from the session server to the gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

STREAM_METHOD = "/rlfleet.bench.Echo/Stream"


def serve(port_queue) -> None:
    import grpc
    import uvloop
    from grpc_health.v1 import health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    def same(raw: bytes) -> bytes:
        return raw

    async def echo(requests, context) -> None:
        async for message in requests:
            await context.write(message)

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        handler = grpc.method_handlers_generic_handler(
            "rlfleet.bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo, same, same)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    uvloop.run(main())


async def unary_calls(address: str, calls: int, concurrency: int) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub, request = health_pb2_grpc.HealthStub(channel), health_pb2.HealthCheckRequest()

        async def worker(n: int) -> None:
            for _ in range(n):
                await stub.Check(request)

        await asyncio.gather(*(worker(calls // concurrency) for _ in range(concurrency)))


async def stream_messages(address: str, calls: int, concurrency: int) -> None:
    import grpc

    def same(raw: bytes) -> bytes:
        return raw

    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM_METHOD, request_serializer=same, response_deserializer=same)()
        waiting: dict[bytes, asyncio.Future] = {}
        write_lock = asyncio.Lock()  # one write in flight on a stream at a time
        loop = asyncio.get_running_loop()

        async def reader() -> None:
            while (message := await call.read()) is not grpc.aio.EOF:
                waiting.pop(message[:8]).set_result(message)

        async def request(key: int) -> None:
            tag = key.to_bytes(8, "big")
            waiting[tag] = answer = loop.create_future()
            async with write_lock:
                await call.write(tag + bytes(200))
            await answer

        reading = asyncio.create_task(reader())

        async def worker(first: int, n: int) -> None:
            for i in range(n):
                await request(first + i)

        per = calls // concurrency
        await asyncio.gather(*(worker(w * per, per) for w in range(concurrency)))
        await call.done_writing()
        await reading


def measure(server, run, address: str, calls: int, concurrency: int) -> tuple[float, float, float]:
    import psutil
    import uvloop

    def cpu(process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    me, other = psutil.Process(), psutil.Process(server.pid)
    mine, theirs, started = cpu(me), cpu(other), time.perf_counter()
    uvloop.run(run(address, calls, concurrency))
    elapsed = time.perf_counter() - started
    done = calls // concurrency * concurrency
    return ((cpu(me) - mine) * 1000 / done, (cpu(other) - theirs) * 1000 / done, done / elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls-per-episode", type=int, default=6)
    args = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=serve, args=(ports,), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=30)}"
        rows = {}
        for name, run in (("unary call", unary_calls), ("stream message", stream_messages)):
            measure(server, run, address, min(args.calls, 500), args.concurrency)  # warm up
            results = [measure(server, run, address, args.calls, args.concurrency)
                       for _ in range(args.repeats)]
            rows[name] = [statistics.median(r[i] for r in results) for i in range(3)]
        print(f"grpc.aio on uvloop, plaintext loopback, concurrency {args.concurrency}, "
              f"{args.calls} calls x {args.repeats} (median)")
        print(f"  {'':16} {'client ms':>10} {'server ms':>10} {'both ms':>9} {'per s':>8}")
        for name, (client, server_ms, rate) in rows.items():
            print(f"  {name:16} {client:10.3f} {server_ms:10.3f} {client + server_ms:9.3f} {rate:8.0f}")
        unary = sum(rows["unary call"][:2])
        floor = args.calls_per_episode * unary
        print(f"  {args.calls_per_episode} unary calls per episode: {floor:.2f} ms of CPU before any work")
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
