"""Weight-sync bench: what one update ships and how long the engine stops generating, per transport.

For each model (the default ~3M-parameter CPU-engine policy, and a ~100M config) and learning rate
(1e-6, 1e-5, 1e-4), a trainer in this process (the model in fp32, AdamW on random tokens) publishes
every step to a weight store (`DirectoryWeightStore`, deltas against the previously served bf16
bytes), and one CPU engine process takes each version three ways, through the weight broker's own
transports (`rlfleet.broker.transports`):

  delta  the CPU engine's own `/rlfleet/update_weights_from_store` (kind delta): fetch + decode +
         preverify while serving, then pause (retract) only for the in-place swap. Pause: the
         engine's `pause_s`.
  local  what an SGLang engine gets (the engine taken as kind `sglang`): the broker-mode weight
         agent fetches + checks the delta and applies it to its full local copy, writes the new
         version as a plain HF directory (all while the engine serves: `stage`), then the engine
         loads that directory with `update_weights_from_disk`, load format auto. SGLang holds
         requests for its whole load, so the pause of an SGLang engine is that call's wall time
         (`pause`, this bench's engine is the CPU engine: the call's wall time); side by side with the
         full reload: the same engine paused around the load of a full plain directory the agent
         rebuilt from the store before pausing (`full stage`, `full pause`), and the `full` column
         (the version read and verified from the store inside the pause).
  dist   `update_weights_from_distributed`, this process broadcasting bf16 tensors as rank 0 over
         gloo; the receive overlaps generation, the engine pauses for the swap (its `pause_s`).
  full   pause_generation -> the store route, kind full, of a full checkpoint of the
         same weights (read, every checksum verified, copied into the model) ->
         continue_generation, timed around the whole thing as the broker's full-reload path does
         it (page cache warm: the checkpoint was just written).
  rebuilt  the same, for the delta version itself (the broker's fallback when a delta is refused:
         the nearest full checkpoint plus every delta after it, rebuilt and verified).

Per update it prints the full checkpoint size, the delta payload (and its share of the full), the
share of bf16 values that changed, and the three pauses; then a summary against the aims.

    .venv/bin/python bench/weight_sync.py            # default model x 3 steps per lr, 100M x 1 step per lr
    .venv/bin/python bench/weight_sync.py --quick    # default model x 2 steps per lr

`--transports` (issue 16) runs every transport side by side instead, for three model sizes (~3M,
~25M, ~100M parameters), lr 1e-5, on one CPU engine process, through the code the broker and the
trainer service run (`rlfleet.broker.transports`, `rlfleet.weights.p2p` / `tensor_ipc` / `broadcast`):

  disk_full   the store writes a full checkpoint; the engine pauses, reads and verifies it, swaps
  disk_delta  the store writes a bf16 delta; the engine fetches + decodes it while serving, pauses to swap
  broadcast   the trainer (this process, rank 0) broadcasts bf16 tensors over gloo; the engine
              receives into staging while serving, hashes and casts it; the flip checks the
              trainer's checksums and pauses for the pointer swap alone
  p2p         the trainer writes into the engine's Mooncake staging (tcp on loopback); the engine
              verifies staging against the trainer's checksums and casts it, pauses to swap
  tensor      the trainer puts the tensors in shared memory; update_weights_from_tensor hands over
              the handles, the engine copies + hashes, pauses to swap
  p2p_trainer P2P as the trainer service drives it: the trainer's own sender
              (`rlfleet.trainer.weight_sender.WeightSender`) asks a weight-broker process for a plan
              (StartTrainerSync), writes the buckets into a second CPU engine's staging beside the
              store write, and reports (FinishTrainerSync); the broker has the engine verify by
              checksum and flip, then the store write's end is confirmed (ConfirmTrainerSync). Its
              own line breaks the time down: plan / transfer / finish (verify + flip) / store wait

For each: `e2e` = from the trainer holding the new version (the optimizer step done) to the engine
answering that it serves it. The disk paths include the store write (before the load). The direct
ones run the store write beside the transfer, as the trainer service does, and flip the version in
as soon as it arrived and passed its checksums, before the store has it (the broker's default
`sync.flip_before_stored`), and the store write starts after the flip (the trainer's default
`weight_send.store_after_flip`), so it competes with nothing on the update's path (its time shown
as `store write`). `--flip-after-stored` is the other order: the write beside the transfer, and
the flip once both are done;
`pause` = the engine's own pause (its reply's `pause_s`; the full reload is timed around the whole
paused load); `moved` = bytes that travelled to the engine for this update.

    .venv/bin/python bench/weight_sync.py --transports [--transport-steps 2] [--sizes default,25M,100M]

The trainer-driven leg starts NATS and Redis (TLS, this process's run secrets) for the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlfleet.common.processes import free_port

LRS = (1e-6, 1e-5, 1e-4)
MODELS = {
    "default": {},  # rlfleet.engine.build_model.ModelSpec defaults (~3M parameters)
    "25M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
    "100M": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4),
}
TRANSPORTS = ("disk_full", "disk_delta", "broadcast", "p2p", "tensor", "p2p_trainer")
DIRECT = ("broadcast", "p2p", "tensor", "p2p_trainer")


@dataclass
class Row:
    model: str
    params_m: float
    lr: float
    version: int
    full_mb: float
    delta_kb: float
    delta_pct: float  # of the full checkpoint
    changed_pct: float  # of bf16 values
    delta_prepare_ms: float  # fetch + decode + preverify, while serving
    delta_pause_ms: float
    dist_pause_ms: float
    dist_total_ms: float  # the broadcast, while serving, plus the swap
    full_pause_ms: float
    rebuilt_pause_ms: float  # full load of the delta version (chain rebuilt from the store)
    full_over_delta: float  # full pause / delta pause
    local_stage_ms: float  # weight agent: fetch + check + apply to the local copy + write, while serving
    local_load_ms: float  # the engine's update_weights_from_disk of that directory (SGLang's pause)
    local_full_stage_ms: float  # weight agent: the version rebuilt from the store + written, before the pause
    local_full_ms: float  # paused -> update_weights_from_disk of the full rebuilt directory -> resumed


def build(name: str, out: Path) -> Path:
    from rlfleet.engine.build_model import ModelSpec
    from rlfleet.engine.build_model import build as build_model
    from rlfleet.engine.testing import calc_dialogues

    return build_model(out, calc_dialogues(300), 0, ModelSpec(**MODELS[name]))


class Trainer:
    """Publishes each version twice: into a run of deltas, and as a full checkpoint into a second run."""

    def __init__(self, model_dir: Path, store, full_store, lr: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.store = store
        self.full_store = full_store
        self.version = 0

    def step(self) -> None:
        import torch

        ids = torch.randint(0, self.model.config.vocab_size, (2, 64))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish(self) -> dict:
        manifest = self.store.write_version(self.version, self.model.state_dict())
        self.full_store.write_version(self.version, self.model.state_dict(), kind="full")
        self.version += 1
        return manifest

    def bf16_named(self) -> list:
        import torch

        from rlfleet.broker.distributed_sender import _unique

        return [(n, t.detach().to(torch.bfloat16).contiguous())
                for n, t in _unique(self.model.state_dict().items())]


async def distributed_update(pools, engine, trainer, info) -> tuple[float, float]:
    from rlfleet.broker.transports import BroadcastPlan, Distributed
    from rlfleet.weights import broadcast as distributed

    named = trainer.bf16_named()
    port = free_port()
    plan = BroadcastPlan("127.0.0.1", port, f"bench-{port}", "gloo", [n for n, _ in named],
                         ["bfloat16"] * len(named), [list(t.shape) for _, t in named])  # fmt: skip

    def send() -> None:
        group = distributed.join_group("127.0.0.1", port, 0, 2, plan.group_name, "gloo", 120.0)
        try:
            distributed.send(group, [t for _, t in named])
        finally:
            distributed.leave_group(group)

    started = time.perf_counter()
    receiving = asyncio.create_task(Distributed(pools, plan).update([engine], info))
    sender = threading.Thread(target=send)
    sender.start()
    (outcome,) = await receiving
    await asyncio.to_thread(sender.join)
    assert outcome.ok, outcome.message
    return outcome.pause_s, time.perf_counter() - started


async def run_model(name: str, steps: int, lrs, workdir: Path) -> list[Row]:
    from rlfleet.broker.pools import EngineRef, Pools
    from rlfleet.broker.transports import DiskDelta, DiskFull, Pauser, VersionInfo
    from rlfleet.common.engine_client import EngineTimeouts
    from rlfleet.engine.testing import EngineProcess
    from rlfleet.weights import DirectoryWeightStore
    from rlfleet.weights.local_copy import LocalCopies

    model_dir = await asyncio.to_thread(build, name, workdir / f"model-{name}")
    engine_proc = await asyncio.to_thread(
        EngineProcess(model_dir, workdir / f"engine-{name}",
                      weight_store_root=workdir / "store").start, 300.0)
    pools = Pools([], None, EngineTimeouts(weights_s=600))
    engine = EngineRef(name, engine_proc.url, "fleet", kind="cpu")
    as_sglang = EngineRef(name, engine_proc.url, "fleet", kind="sglang")
    delta, full = DiskDelta(pools), DiskFull(pools, Pauser(pools, None))
    rows: list[Row] = []
    try:
        for lr in lrs:
            store = DirectoryWeightStore(workdir / "store", f"{name}-{lr:g}", full_every=10**6,
                                         max_delta_fraction=10.0)
            full_store = DirectoryWeightStore(workdir / "store", f"{name}-{lr:g}-full", full_every=1)
            trainer = await asyncio.to_thread(Trainer, model_dir, store, full_store, lr)
            copies = LocalCopies(store, workdir / "local-copies")
            local_delta = DiskDelta(pools, copies=copies)
            local_full = DiskFull(pools, Pauser(pools, None), copies=copies)
            params_m = sum(p.numel() for p in trainer.model.parameters()) / 1e6
            await asyncio.to_thread(trainer.publish)
            (first,) = await full.update([engine], VersionInfo.from_store(store, 0))
            assert first.ok, first.message
            for _ in range(steps):
                await asyncio.to_thread(trainer.step)
                manifest = await asyncio.to_thread(trainer.publish)
                version = manifest["version"]
                info = VersionInfo.from_store(store, version)
                assert info.kind == "delta", manifest
                (f,) = await full.update([engine], VersionInfo.from_store(full_store, version))
                assert f.ok, f.message
                dist_pause, dist_total = await distributed_update(pools, engine, trainer, info)
                (rebuilt,) = await full.update([engine], VersionInfo.from_store(store, version - 1))
                assert rebuilt.ok, rebuilt.message  # the engine holds the delta's base again
                (d,) = await delta.update([engine], info)
                assert d.ok, d.message
                reply = d.reply
                # The SGLang path: a full plain directory of the base (paused around its load), then
                # the delta on the agent's copy and the engine's load of the new directory.
                (lf,) = await local_full.update([as_sglang], VersionInfo.from_store(store, version - 1))
                assert lf.ok, lf.message
                (ld,) = await local_delta.update([as_sglang], info)
                assert ld.ok and ld.reply["stage"] == "delta", ld.message
                row = Row(
                    name, round(params_m, 1), lr, version, info.full_bytes / 2**20, d.bytes / 1024,
                    100 * d.bytes / info.full_bytes, 100 * (info.changed_fraction or 0),
                    1000 * (reply["fetch_s"] + reply["preverify_s"]), 1000 * d.pause_s, 1000 * dist_pause,
                    1000 * dist_total, 1000 * f.pause_s, 1000 * rebuilt.pause_s,
                    f.pause_s / max(d.pause_s, 1e-9),
                    1000 * (ld.reply["fetch_s"] + ld.reply["write_s"]), 1000 * ld.reply["load_call_s"],
                    1000 * (lf.reply["fetch_s"] + lf.reply["write_s"]), 1000 * lf.pause_s,
                )  # fmt: skip
                print_row(row)
                rows.append(row)
    finally:
        await pools.close()
        engine_proc.stop()
    return rows


HEADER = (f"{'model':>7} {'params':>7} {'lr':>6} {'v':>2} {'full MB':>8} {'delta KB':>9} {'delta%':>7} "
          f"{'changed%':>8} {'prep ms':>8} {'pause: delta':>12} {'dist':>8} {'full':>8} {'full/delta':>10} "
          f"{'rebuilt':>8} {'dist total':>10} | {'sglang: stage':>13} {'pause':>8} {'full stage':>10} "
          f"{'full pause':>10}")  # fmt: skip


def print_row(r: Row) -> None:
    print(f"{r.model:>7} {r.params_m:>6.1f}M {r.lr:>6.0e} {r.version:>2} {r.full_mb:>8.1f} "
          f"{r.delta_kb:>9.1f} {r.delta_pct:>6.2f}% {r.changed_pct:>7.2f}% {r.delta_prepare_ms:>8.1f} "
          f"{r.delta_pause_ms:>9.1f} ms "
          f"{r.dist_pause_ms:>5.1f} ms {r.full_pause_ms:>5.0f} ms {r.full_over_delta:>9.1f}x "
          f"{r.rebuilt_pause_ms:>5.0f} ms {r.dist_total_ms:>7.0f} ms | {r.local_stage_ms:>10.1f} ms "
          f"{r.local_load_ms:>5.1f} ms {r.local_full_stage_ms:>7.1f} ms {r.local_full_ms:>7.1f} ms",
          flush=True)  # fmt: skip


def summary(rows: list[Row]) -> None:
    print("\nsummary (medians per model and lr):")
    ok_small, ok_smaller, ok_pause = True, True, True
    for (model, lr) in dict.fromkeys((r.model, r.lr) for r in rows):
        group = [r for r in rows if r.model == model and r.lr == lr]
        pct = statistics.median(r.delta_pct for r in group)
        dp = statistics.median(r.delta_pause_ms for r in group)
        fp = statistics.median(r.full_pause_ms for r in group)
        dist = statistics.median(r.dist_pause_ms for r in group)
        load = statistics.median(r.local_load_ms for r in group)
        stage = statistics.median(r.local_stage_ms for r in group)
        local_full = statistics.median(r.local_full_ms for r in group)
        full_stage = statistics.median(r.local_full_stage_ms for r in group)
        print(f"  {model:>7} lr {lr:.0e}: delta {pct:6.2f}% of full, "
              f"pause delta {dp:7.1f} ms / dist {dist:7.1f} ms"
              f" / full {fp:7.0f} ms  (full/delta {fp / dp:6.1f}x)\n"
              f"  {'':>7} SGLang path, pause: "
              f"node-local delta load {load:7.1f} ms (staged {stage:6.1f} ms while "
              f"serving) vs full reload {local_full:7.1f} ms (staged {full_stage:6.1f} ms) / {fp:7.0f} ms "
              f"(store read inside the pause)")  # fmt: skip
        ok_small &= lr != 1e-6 or pct <= 5.0
        ok_smaller &= all(r.delta_pct < 100 for r in group)
        ok_pause &= dp * 10 < fp
    print(f"\naims: delta <= 5% of full at lr 1e-6: {'met' if ok_small else 'NOT met'}; "
          f"delta smaller than full at every rate: {'met' if ok_smaller else 'NOT met'}; "
          "delta pause < 1/10 of a full reload's: "
          f"{'met' if ok_pause else 'NOT met (see the per-row ratios)'}")


@dataclass
class TransportRow:
    model: str
    params_m: float
    version: int
    transport: str
    e2e_ms: float
    pause_ms: float
    moved_mb: float
    # this version's store write (its own for the disk paths; the delta write otherwise)
    store_write_ms: float


async def run_transports(name: str, steps: int, workdir: Path, infra: Infra | None = None,
                         flip_after_stored: bool = False) -> list[TransportRow]:
    import torch

    from rlfleet.broker.pools import EngineRef, Pools
    from rlfleet.broker.transports import (
        DiskDelta,
        DiskFull,
        Pauser,
        PeerCommit,
        TensorHandOver,
        VersionInfo,
    )
    from rlfleet.common.engine_client import EngineTimeouts
    from rlfleet.engine.testing import EngineProcess
    from rlfleet.weights import DirectoryWeightStore
    from rlfleet.weights.p2p import Endpoint, P2PSender, TransferAgent
    from rlfleet.weights.sent import nbytes, served_named, tensor_checksums
    from rlfleet.weights.tensor_ipc import SharedTensors

    model_dir = await asyncio.to_thread(build, name, workdir / f"model-{name}")
    engine_proc = await asyncio.to_thread(
        EngineProcess(model_dir, workdir / f"engine-{name}",
                      weight_store_root=workdir / "store").start, 300.0)
    pools = Pools([], None, EngineTimeouts(weights_s=600))
    engine = EngineRef(name, engine_proc.url, "fleet", kind="cpu")
    delta, full = DiskDelta(pools), DiskFull(pools, Pauser(pools, None))
    peer, tensor = PeerCommit(pools, "retract"), TensorHandOver(pools, "retract")
    staged_flip = PeerCommit(pools, "retract", source="distributed")
    agent = TransferAgent()
    p2p = P2PSender(agent)
    rows: list[TransportRow] = []
    stack: list = []
    try:
        store = DirectoryWeightStore(workdir / "store", f"t-{name}", full_every=10**6,
                                     max_delta_fraction=10.0)
        full_store = DirectoryWeightStore(workdir / "store", f"t-{name}-full", full_every=1)
        trainer = await asyncio.to_thread(Trainer, model_dir, store, full_store, 1e-5)
        params_m = sum(p.numel() for p in trainer.model.parameters()) / 1e6
        await asyncio.to_thread(store.write_version, 0, trainer.model.state_dict())
        beside_stores = {t: DirectoryWeightStore(workdir / "store", f"t-{name}-{t}", full_every=10**6,
                                                 max_delta_fraction=10.0)
                         for t in ("broadcast", "p2p", "tensor")}
        for beside_store in beside_stores.values():
            await asyncio.to_thread(beside_store.write_version, 0, trainer.model.state_dict())
        (first,) = await full.update([engine], VersionInfo.from_store(store, 0))
        assert first.ok, first.message
        sent = None
        if infra is not None:
            sent = await asyncio.to_thread(TrainerSent, name, model_dir, workdir, infra,
                                           trainer.model.state_dict(), flip_after_stored)
            stack.append(sent)
        endpoint = Endpoint.from_json(await pools.client(engine).transfer_engine_info(0))
        for version in range(1, steps + 1):
            await asyncio.to_thread(trainer.step)
            state = trainer.model.state_dict()

            def row(transport: str, e2e: float, pause: float, moved: int, write: float,
                    version: int = version) -> None:
                r = TransportRow(name, round(params_m, 1), version, transport, 1000 * e2e, 1000 * pause,
                                 moved / 2**20, 1000 * write)
                print_transport_row(r)
                rows.append(r)

            # disk_full: its own full checkpoint write, then the paused full load.
            started = time.perf_counter()
            await asyncio.to_thread(full_store.write_version, version, state, kind="full")
            write_full = time.perf_counter() - started
            (f,) = await full.update([engine], VersionInfo.from_store(full_store, version))
            assert f.ok, f.message
            row("disk_full", time.perf_counter() - started, f.pause_s, f.bytes, write_full)
            # disk_delta: the delta against version - 1; the engine must hold version - 1 first.
            (back,) = await full.update([engine], VersionInfo.from_store(store, version - 1))
            assert back.ok, back.message
            started = time.perf_counter()
            await asyncio.to_thread(store.write_version, version, state)
            write_delta = time.perf_counter() - started
            (d,) = await delta.update([engine], VersionInfo.from_store(store, version))
            assert d.ok, d.message
            row("disk_delta", time.perf_counter() - started, d.pause_s, d.bytes, write_delta)
            # The direct transports, as the trainer service sends (`weight_send.beside_store`): the
            # transfer into the engine's staging and this version's store write (each transport its
            # own store, so each writes the version once) side by side; the flip as soon as the
            # transfer passed its checksums (`sync.flip_before_stored`), or after the write too.
            def beside(transport: str, version: int = version, state: dict = state) -> asyncio.Task:
                return asyncio.create_task(asyncio.to_thread(timed, beside_stores[transport].write_version,
                                                             version, state))

            async def direct(transport: str, transfer, flip) -> None:
                """`transfer()`, then `flip(transfer's result)`, then the store write, as the trainer
                service does by default (`weight_send.store_after_flip`); with `flip_after_stored`
                the write runs beside the transfer and the flip waits for it. One row."""
                started = time.perf_counter()
                writing = beside(transport) if flip_after_stored else None
                sent = await transfer()
                if writing is not None:
                    await asyncio.shield(writing)
                outcome = await flip(sent)
                e2e = time.perf_counter() - started
                assert outcome.ok, outcome.message
                row(transport, e2e, outcome.pause_s, outcome.bytes, await (writing or beside(transport)))

            async def broadcast_transfer(state: dict = state, version: int = version):
                named = served_named(state)
                sums = tensor_checksums(named)
                return sums, await broadcast_update(pools, engine, named, sums, version)

            async def broadcast_flip(sent, version: int = version):  # staged on the engine, flipped in here
                sums, received = sent
                return await staged_flip.commit(engine, version, sums, "sha256", received.bytes)

            async def p2p_transfer(state: dict = state):
                named = served_named(state)
                sums = tensor_checksums(named)
                by_name = dict(named)
                chosen = {n: by_name[n] for n in endpoint.tensors}
                return sums, await asyncio.to_thread(p2p.send, chosen, endpoint)

            async def p2p_flip(sent, version: int = version):
                sums, report = sent
                return await peer.commit(engine, version, sums, "sha256", report.bytes_sent)

            async def tensor_transfer(state: dict = state):
                named = served_named(state)
                return named, tensor_checksums(named), await asyncio.to_thread(SharedTensors, named)

            async def tensor_flip(sent, version: int = version):
                named, sums, shared = sent
                try:
                    return await tensor.update(engine, version, [shared.payload], sums, nbytes(named))
                finally:
                    shared.close()

            await direct("broadcast", broadcast_transfer, broadcast_flip)
            await direct("p2p", p2p_transfer, p2p_flip)
            await direct("tensor", tensor_transfer, tensor_flip)
            if sent is not None:
                # p2p_trainer: the trainer service's sender, the broker's plan, the store write beside it
                started = time.perf_counter()
                summary, write_s = await asyncio.to_thread(sent.send, version, state)
                (outcome,) = summary.outcomes
                assert outcome.ok and outcome.transport == sent.P2P, outcome
                row("p2p_trainer", summary.serving_s, outcome.pause_s, outcome.bytes, write_s)
                print(f"{'':>22}p2p_trainer: plan {1000 * summary.plan_s:.1f} ms, "
                      f"transfer {1000 * summary.transfer_s:.1f} ms, "
                      f"finish (verify + flip) {1000 * summary.finish_s:.1f} ms, store wait "
                      f"{1000 * summary.store_wait_s:.1f} ms, confirm {1000 * summary.confirm_s:.1f} ms; "
                      f"whole send {1000 * (time.perf_counter() - started):.1f} ms; "
                      f"sent {summary.bytes.get('p2p', 0) / 2**20:.2f} MB", flush=True)
            del state
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    finally:
        for item in reversed(stack):
            item.close()
        await pools.close()
        engine_proc.stop()
    return rows


@dataclass
class Infra:
    nats_url: str
    redis_url: str


def start_infra(workdir: Path) -> tuple[Infra, list]:
    """NATS and Redis for the trainer-driven leg's broker, over TLS with this process's run secrets."""
    from rlfleet.common import security
    from rlfleet.common.processes import start_nats, start_redis

    secrets = security.ensure_local_credentials()
    nats = start_nats(workdir / "nats", tls=security.server_tls_files(secrets, "nats"))
    try:
        redis = start_redis(workdir / "redis", tls=security.server_tls_files(secrets, "redis"))
    except BaseException:
        nats.stop()
        raise
    return Infra(nats.url, redis.url), [redis, nats]


class TrainerSent:
    """The trainer-driven P2P leg: a second CPU engine (canary) under a weight-broker process of its own
    run (`sync.transport p2p`), and the trainer service's `WeightSender` with the store write beside
    the send, as `VersionPublisher` runs it (`weight_send.beside_store`)."""

    def __init__(self, name: str, model_dir: Path, workdir: Path, infra: Infra, state: dict,
                 flip_after_stored: bool = False) -> None:
        from rlfleet.api.broker.v1 import broker_pb2
        from rlfleet.broker.testing import BrokerProcess
        from rlfleet.engine.testing import EngineProcess
        from rlfleet.trainer.service_config import WeightSendConfig
        from rlfleet.trainer.weight_sender import WeightSender
        from rlfleet.weights import DirectoryWeightStore

        self.P2P = broker_pb2.TRANSPORT_P2P
        self.run = f"t-{name}-sent"
        self.store = DirectoryWeightStore(workdir / "store", self.run, full_every=10**6,
                                          max_delta_fraction=10.0)
        self.store.write_version(0, state)
        self.engine = self.broker = self.sender = None
        try:
            self.engine = EngineProcess(model_dir, workdir / f"engine-{name}-sent",
                                        weight_store_root=workdir / "store", engine_id="sent").start(300.0)
            self.broker = BrokerProcess(
                workdir / f"broker-{name}", run_id=self.run, weight_store=str(workdir / "store"),
                auto_promote=True,
                engines=[{"engine_id": "sent", "url": self.engine.url, "pool": "canary", "kind": "cpu"}],
                reconcile_interval_s=3600,  # every version comes from the trainer here, none from the store
                **{"nats.url": infra.nats_url, "redis.url": infra.redis_url, "sync.transport": "p2p",
                   "sync.flip_before_stored": not flip_after_stored}).start(120.0)
            self.sender = WeightSender(WeightSendConfig(broker_address=self.broker.address, timeout_s=600.0))
        except BaseException:
            self.close()
            raise

    def send(self, version: int, state: dict):
        """Blocking: the send with the store write beside it; (SendSummary, the write's seconds)."""
        from concurrent.futures import Future

        from rlfleet.api.common.v1 import common_pb2
        from rlfleet.broker.testing import policy_version

        stored: Future = Future()
        write_s = [0.0]
        may_write = threading.Event()

        def write() -> None:
            if self.sender.config.store_after_flip:  # as VersionPublisher: once the engines flipped it in
                may_write.wait()
            started = time.perf_counter()
            try:
                manifest = self.store.write_version(version, state)
            except BaseException as exc:
                stored.set_exception(exc)
                return
            write_s[0] = time.perf_counter() - started
            stored.set_result(policy_version(manifest))

        writer = threading.Thread(target=write, name=f"store-v{version}")
        writer.start()
        partial = common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1, run_id=self.run,
                                           version=version, parent_version=version - 1, step=version)
        try:
            summary = self.sender.send(partial, state, stored, store_may_start=may_write)
        finally:
            writer.join()
        if summary.error:
            raise RuntimeError(f"the trainer's send of version {version} failed: {summary.error}")
        return summary, write_s[0]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        for process in (self.broker, self.engine):
            if process is not None:
                process.stop()


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


async def broadcast_update(pools, engine, named, sums, version: int):
    """The engine receives a staged broadcast (hashed, not yet served); the caller flips it in."""
    from rlfleet.broker.transports import BroadcastPlan, Distributed, VersionInfo
    from rlfleet.weights import broadcast as distributed

    port = free_port()
    plan = BroadcastPlan("127.0.0.1", port, f"bench-{port}", "gloo", [n for n, _ in named],
                         [str(t.dtype).removeprefix("torch.") for _, t in named],
                         [list(t.shape) for _, t in named],
                         checksums=sums, pause_mode="retract", staged=True)  # fmt: skip

    def send() -> None:
        group = distributed.join_group("127.0.0.1", port, 0, 2, plan.group_name, "gloo", 120.0)
        try:
            distributed.send(group, [t for _, t in named])
        finally:
            distributed.leave_group(group)

    info = VersionInfo(version, "", "", None, plan.nbytes, plan.nbytes, None)
    receiving = asyncio.create_task(Distributed(pools, plan).update([engine], info))
    sender = threading.Thread(target=send)
    sender.start()
    (outcome,) = await receiving
    await asyncio.to_thread(sender.join)
    assert outcome.ok and outcome.reply.get("staged"), outcome.message
    return outcome


TRANSPORT_HEADER = (f"{'model':>6} {'params':>7} {'v':>2} {'transport':>10} {'e2e ms':>9} {'pause ms':>9} "
                    f"{'moved MB':>9} {'store write ms':>14}")


def print_transport_row(r: TransportRow) -> None:
    print(f"{r.model:>6} {r.params_m:>6.1f}M {r.version:>2} {r.transport:>10} {r.e2e_ms:>9.1f} "
          f"{r.pause_ms:>9.2f} {r.moved_mb:>9.2f} {r.store_write_ms:>14.1f}", flush=True)


def transport_summary(rows: list[TransportRow]) -> None:
    print("\nsummary (medians per model):")
    for model in dict.fromkeys(r.model for r in rows):
        present = [t for t in TRANSPORTS if any(r.model == model and r.transport == t for r in rows)]
        med = {t: (statistics.median(r.e2e_ms for r in rows if r.model == model and r.transport == t),
                   statistics.median(r.pause_ms for r in rows if r.model == model and r.transport == t),
                   statistics.median(r.moved_mb for r in rows if r.model == model and r.transport == t))
               for t in present}  # fmt: skip
        print(f"  {model:>6}: " + "; ".join(f"{t} e2e {e:.0f} ms pause {p:.1f} ms moved {m:.1f} MB"
                                           for t, (e, p, m) in med.items()))
        dp, de = med["disk_delta"][1], med["disk_delta"][0]
        for t in (t for t in DIRECT if t in med):
            e, p, _ = med[t]
            print(f"  {'':>6}  {t}: pause {'<=' if p <= dp else '>'} delta's ({p:.1f} vs {dp:.1f} ms); "
                  f"e2e {e / de:.2f}x the delta's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="default model only, 2 steps per learning rate")
    parser.add_argument("--steps", type=int, default=3, help="updates per learning rate on the default model")
    parser.add_argument("--big-steps", type=int, default=1,
                        help="updates per learning rate on the 100M model")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--transports", action="store_true",
                        help="every transport side by side (disk full, disk delta, "
                             "broadcast, P2P, tensor), three sizes")
    parser.add_argument("--transport-steps", type=int, default=2,
                        help="updates per model size with --transports")
    parser.add_argument("--sizes", default="default,25M,100M", help="model sizes with --transports")
    parser.add_argument("--no-trainer-sent", action="store_true",
                        help="with --transports: leave out p2p_trainer (no broker, NATS or Redis started)")
    parser.add_argument("--flip-after-stored", action="store_true",
                        help="with --transports: direct transports flip only once the store write beside "
                             "them is done (the broker's sync.flip_before_stored = false)")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    torch.set_num_threads(1 if args.transports else 2)
    if args.transports:
        started = time.monotonic()
        print(TRANSPORT_HEADER)
        trows: list[TransportRow] = []
        with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
            infra, servers = start_infra(Path(tmp)) if not args.no_trainer_sent else (None, [])
            try:
                for name in args.sizes.split(","):
                    trows += asyncio.run(run_transports(name, args.transport_steps, Path(tmp), infra,
                                                        args.flip_after_stored))
            finally:
                for server in servers:
                    server.stop()
        transport_summary(trows)
        print(f"\n{len(trows)} updates in {time.monotonic() - started:.0f}s")
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in trows], indent=1))
        return
    plan = [("default", 2 if args.quick else args.steps)] + ([] if args.quick else [("100M", args.big_steps)])
    started = time.monotonic()
    print(HEADER)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        for name, steps in plan:
            rows += asyncio.run(run_model(name, steps, LRS, Path(tmp)))
    summary(rows)
    print(f"\n{len(rows)} updates in {time.monotonic() - started:.0f}s")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
