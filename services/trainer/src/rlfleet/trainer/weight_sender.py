"""The trainer sends each version straight to the engines the broker names, over the transport the
broker chose for each (the trainer's half of StartTrainerSync / FinishTrainerSync; the broker's half
and the whole exchange are described in `rlfleet.broker.trainer_sync`).

While the version is written to the weight store (catch-up, audit, rollback; `beside_store`), rank
0 -- holding the state FSDP2 gathered for the store -- asks the broker for a plan, then at once:

* broadcast: joins the plan's group as rank 0 (gloo for host tensors, NCCL when the weights are on
  a GPU: tensors are broadcast from where they are, never copied to the host for it) and sends every
  tensor in order; the broker has the engines join at SGLang's `rank_offset + tp_rank`;
* P2P: writes the tensors into each engine's Mooncake staging buffer, `bucket_bytes` per batch
  (or, with `shards`, every rank writes its own FSDP2 shard: `rlfleet.trainer.p2p_shards`);
* tensor: puts the tensors in shared memory and hands the handles over in the completion report,
  keeping the memory alive until the broker answers (the engines have copied by then);

then reports what went through. When the plan says `flip_before_stored` (the broker's default) it
reports at once and the engines flip the version in while the store write goes on; the write's end
follows in ConfirmTrainerSync (a failed write: the broker rejects the version and sends those
engines back). Otherwise it first waits for the write and reports the stored version with the rest
(a failed write: the broker rejects the version and flips nothing in). Checksums of every tensor go
in the request, so each engine's transfer is verified whatever the transport. A send that fails is
logged and reported; training never stops for it (the engines catch up from the store).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.grpc_server import blocking_channel
from rlfleet.common.processes import free_port
from rlfleet.trainer.service_config import WeightSendConfig

if TYPE_CHECKING:
    from rlfleet.weights.p2p import P2PSender, TransferAgent

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class SendSummary:
    version: int
    seconds: float = 0.0
    plan_s: float = 0.0  # StartTrainerSync
    transfer_s: float = 0.0  # every transfer, side by side
    finish_s: float = 0.0  # FinishTrainerSync: the engines verified and swapped
    serving_s: float = 0.0  # from the start until FinishTrainerSync answered: the engines serve it
    store_wait_s: float = 0.0  # after the transfers (or the flip), until the store write beside them was done
    confirm_s: float = 0.0  # ConfirmTrainerSync, when the engines flipped it in before it was stored
    awaits_confirm: bool = False  # the broker flipped it in before it was stored and waits for the write
    # Engines sent back: the store write failed after they flipped the version in.
    reverted: list[str] = field(default_factory=list)
    bytes: dict[str, int] = field(default_factory=dict)  # transport -> bytes sent (all engines)
    outcomes: list[Any] = field(default_factory=list)  # EngineSyncOutcome
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(o.ok for o in self.outcomes)


class WeightSender:
    def __init__(self, config: WeightSendConfig) -> None:
        self.config = config
        self._channel = blocking_channel(config.broker_address, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self._stub = broker_pb2_grpc.BrokerServiceStub(self._channel)
        self._agent: TransferAgent | None = None
        self._p2p: P2PSender | None = None

    def close(self) -> None:
        if self._p2p is not None:
            self._p2p.close()
        self._channel.close()

    # --- one version ----------------------------------------------------------------------------
    def send(self, version: common_pb2.PolicyVersion, state: Mapping[str, Any],
             stored: Future[common_pb2.PolicyVersion] | None = None,
             shards: Callable[[list, int], list] | None = None,
             store_may_start: threading.Event | None = None) -> SendSummary:
        """Blocking: plan, transfers, report. Never raises for a transfer's failure (it is reported).

        With `stored`, the store write runs beside the send: `version` need only carry its number, and
        `stored` resolves to the version as the store holds it (or raises the write's error), which
        goes in the report, or (the plan's flip_before_stored) in the confirmation that follows the
        flip. `store_may_start` is set once the write need no longer wait: when the engines flipped
        the version in (flip_before_stored), else once the plan is known, and whenever the send ends.
        With `shards`, the P2P writes are every rank's own: `shards(plan peers, bucket bytes)`
        returns one PeerResult per peer."""
        may_start = store_may_start or threading.Event()
        try:
            return self._send(version, state, stored, shards, may_start)
        finally:
            may_start.set()

    def _send(self, version: common_pb2.PolicyVersion, state: Mapping[str, Any],
              stored: Future[common_pb2.PolicyVersion] | None, shards: Callable[[list, int], list] | None,
              store_may_start: threading.Event) -> SendSummary:
        from rlfleet.weights.sent import served_named, tensor_checksums

        started = time.perf_counter()
        summary = SendSummary(version.version)
        named = served_named(state, self.config.dtype)
        request = self._plan_request(version, named, tensor_checksums(named, self.config.checksum_algorithm))
        request.store_pending = stored is not None
        plan = self._stub.StartTrainerSync(request, timeout=self.config.timeout_s)
        summary.plan_s = time.perf_counter() - started
        flip_first = stored is not None and plan.flip_before_stored
        if not flip_first:  # the broker waits for the store, or nothing is sent: no reason to hold the write
            store_may_start.set()
        if not plan.sync_id:
            summary.seconds = time.perf_counter() - started
            return summary
        finish = broker_pb2.FinishTrainerSyncRequest(sync_id=plan.sync_id)
        shared = None
        transfer = time.perf_counter()
        try:
            broadcast = self._start_broadcast(plan, request, named, summary)
            if plan.peers and shards is not None:
                finish.peers.extend(self._write_shards(plan, shards, summary))
            else:
                for peer in plan.peers:
                    finish.peers.append(self._write_peer(peer, named, plan.bucket_bytes, summary))
            if plan.tensor_engine_ids:
                from rlfleet.weights.tensor_ipc import SharedTensors

                shared = SharedTensors(named)
                finish.serialized_named_tensors.append(shared.payload)
                summary.bytes["tensor"] = shared.nbytes * len(plan.tensor_engine_ids)
            if broadcast is not None:
                broadcast.join(self.config.timeout_s)
                finish.broadcast_sent = not summary.error and not broadcast.is_alive()
            summary.transfer_s = time.perf_counter() - transfer
        except Exception as exc:  # whatever broke, the broker must hear of it to release the engines
            log.exception("sending version %d failed", version.version)
            summary.error = finish.error = f"{type(exc).__name__}: {exc}"
        if stored is not None and not flip_first:
            self._wait_stored(stored, finish, summary)
        finish.store_follows = flip_first
        try:
            finishing = time.perf_counter()
            reply = self._stub.FinishTrainerSync(finish, timeout=self.config.timeout_s)
            summary.finish_s = time.perf_counter() - finishing
            summary.serving_s = time.perf_counter() - started
            summary.outcomes = list(reply.outcomes)
            summary.awaits_confirm = reply.awaits_confirm
        finally:
            if shared is not None:
                shared.close()
            store_may_start.set()
        if flip_first and summary.awaits_confirm:
            assert stored is not None
            self._confirm(plan.sync_id, stored, summary)
        summary.seconds = time.perf_counter() - started
        return summary

    def _wait_stored(self, stored: Future[common_pb2.PolicyVersion], report: Any,
                     summary: SendSummary) -> None:
        """The store write's end into `report` (a Finish- or ConfirmTrainerSyncRequest): the stored
        version, or why the write failed (or never finished), for which the broker rejects the version."""
        waiting = time.perf_counter()
        try:
            report.stored.CopyFrom(stored.result(self.config.timeout_s))
        except Exception as exc:
            report.store_error = f"{type(exc).__name__}: {exc}"
        summary.store_wait_s = time.perf_counter() - waiting

    def _confirm(self, sync_id: str, stored: Future[common_pb2.PolicyVersion], summary: SendSummary) -> None:
        confirm = broker_pb2.ConfirmTrainerSyncRequest(sync_id=sync_id)
        self._wait_stored(stored, confirm, summary)
        confirming = time.perf_counter()
        reply = self._stub.ConfirmTrainerSync(confirm, timeout=self.config.timeout_s)
        summary.confirm_s = time.perf_counter() - confirming
        summary.reverted = list(reply.reverted_engine_ids)
        if summary.reverted:
            log.error("version %d: the store write failed after %s flipped it in (%s); "
                      "the broker sends them back", summary.version, summary.reverted,
                      confirm.store_error)

    def _plan_request(self, version, named, checksums) -> broker_pb2.StartTrainerSyncRequest:
        on_gpu = any(t.is_cuda for _, t in named)
        backend = self.config.backend or ("nccl" if on_gpu else "gloo")
        if on_gpu and backend != "nccl":
            raise ValueError(f"CUDA tensors are broadcast over nccl, not {backend}")
        return broker_pb2.StartTrainerSyncRequest(
            version=version, checksum_algorithm=self.config.checksum_algorithm,
            master_address=self.config.master_address, master_port=free_port(self.config.master_address),
            backend=backend,
            tensors=[broker_pb2.TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."),
                                           shape=list(t.shape), checksum=checksums[n]) for n, t in named],
        )  # fmt: skip

    # --- broadcast ------------------------------------------------------------------------------
    def _start_broadcast(self, plan, request, named, summary: SendSummary) -> threading.Thread | None:
        if plan.broadcast.world_size <= 1:
            return None
        from rlfleet.weights import broadcast as distributed
        from rlfleet.weights.sent import nbytes

        def run() -> None:
            try:
                group = distributed.join_group(request.master_address, request.master_port, 0,
                                               plan.broadcast.world_size, plan.broadcast.group_name,
                                               request.backend, self.config.timeout_s)  # fmt: skip
                try:
                    distributed.send(group, [t for _, t in named])
                finally:
                    distributed.leave_group(group)
                summary.bytes["distributed"] = nbytes(named) * len(plan.broadcast.engine_ids)
            except Exception as exc:
                log.exception("broadcast of version %d failed", summary.version)
                summary.error = f"broadcast: {type(exc).__name__}: {exc}"

        thread = threading.Thread(target=run, name=f"broadcast-v{summary.version}", daemon=True)
        thread.start()
        return thread

    # --- P2P ------------------------------------------------------------------------------------
    def _sender(self, bucket_bytes: int) -> P2PSender:
        from rlfleet.weights.p2p import P2PSender, TransferAgent

        if self._agent is None:
            self._agent = TransferAgent(self.config.p2p_hostname, self.config.p2p_protocol,
                                        self.config.p2p_device)
        if self._p2p is None or self._p2p.bucket_bytes != bucket_bytes:
            if self._p2p is not None:
                self._p2p.close()
            self._p2p = P2PSender(self._agent, bucket_bytes or 64 << 20, self.config.checksum_algorithm)
        return self._p2p

    def _write_shards(self, plan, shards: Callable[[list, int], list], summary: SendSummary) -> list:
        try:
            results = list(shards(list(plan.peers), plan.bucket_bytes or 64 << 20))
        except Exception as exc:  # the command channel broke: no engine got a whole version
            log.warning("P2P shard writes of version %d failed: %s", summary.version, exc)
            return [broker_pb2.PeerResult(engine_id=p.engine_id, error=f"shard writes failed: {exc}")
                    for p in plan.peers]
        summary.bytes["p2p"] = summary.bytes.get("p2p", 0) + sum(r.bytes for r in results)
        return results

    def _write_peer(self, peer, named, bucket_bytes: int, summary: SendSummary) -> broker_pb2.PeerResult:
        from rlfleet.weights.p2p import Endpoint, P2PError

        result = broker_pb2.PeerResult(engine_id=peer.engine_id)
        try:
            endpoint = Endpoint.from_json(json.loads(peer.endpoint_json))
            by_name = dict(named)
            missing = sorted(set(endpoint.tensors) - set(by_name))
            if missing:
                raise P2PError(f"the engine expects tensors the trainer does not hold: {missing[:5]}")
            report = self._sender(bucket_bytes).send({n: by_name[n] for n in endpoint.tensors}, endpoint)
            result.sent, result.bytes = True, report.bytes_sent
            summary.bytes["p2p"] = summary.bytes.get("p2p", 0) + report.bytes_sent
        except (P2PError, ValueError) as exc:
            log.warning("P2P write of version %d to %s failed: %s", summary.version, peer.engine_id, exc)
            result.error = str(exc)
        return result
