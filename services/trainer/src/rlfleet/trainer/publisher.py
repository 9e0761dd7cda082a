"""Policy versions: weights to the weight store, then a `PolicyVersion` on POLICY.

The store decides full vs delta (a full checkpoint every `full_every` versions, bf16 byte deltas
in between) and writes each version atomically; full versions carry the starting model's config
and tokenizer files so that engines and transformers load them as they are. The announcement's
`Nats-Msg-Id` is `<run>-v<version>`, so a retried publish inside JetStream's duplicate window is
dropped by the server.

With LoRA (`[trainer.lora]`), the first version is the frozen base model in full and every later
one an adapter version on it (`WEIGHT_FORMAT_ADAPTER`, `base_version` = the base): peft's
directory, a few percent of the model, which engines load beside the base by name.

With a `WeightSender` (config `weight_send.broker_address`), each version also goes straight to the
engines the broker names (broadcast, P2P, same-node tensors) while the store write runs
(`weight_send.beside_store`; the broker flips it in only once the store has it) and before the
announcement, so the broker never races the trainer to load it from the store.

Version numbers are never reused: a version announced after the last checkpoint and then lost in
a crash stays in the store (an engine may serve it), and the restarted trainer continues from the
checkpoint's weights under the next free number, with `parent_version` naming the checkpoint's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.streams import publish, subject
from rlfleet.trainer.learner import Worker

if TYPE_CHECKING:
    from rlfleet.trainer.weight_sender import SendSummary, WeightSender

log = logging.getLogger(__name__)

FORMATS = {"full": common_pb2.WEIGHT_FORMAT_FULL, "delta": common_pb2.WEIGHT_FORMAT_DELTA,
           "adapter": common_pb2.WEIGHT_FORMAT_ADAPTER}
SERVED_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
ANNOUNCE_BACKOFF_MAX_S = 2.0  # NATS back from a restart is found within this


class VersionPublisher:
    def __init__(self, store: Any, js: Any, run_id: str, worker: Worker, sender: WeightSender | None = None,
                 ) -> None:
        self.store = store
        self.js = js
        self.run_id = run_id
        self.worker = worker
        self.sender = sender  # None: the store only
        self.last_send: SendSummary | None = None
        self._shards: Callable[[list, int], list] | None = None

    async def publish(self, version: int, parent: int, export: Callable[[], dict], step: int,
                      metrics: dict[str, float], shards: Callable[[list, int], list] | None = None
                      ) -> common_pb2.PolicyVersion:
        """Writes the weights `export()` returns (called on the worker thread) as `version`, sends them
        straight to engines when a sender is set (the broker plans it), and announces the version.
        `shards` (on the worker thread): every rank writes its own P2P shards (`Learner.send_p2p_shards`)."""
        self._shards = None if shards is None else self._on_worker(shards)

        def write(state: dict) -> dict[str, Any]:
            return self.store.write_version(version, state, parent_version=parent if parent >= 0 else None)

        state = await self.worker.call(export)
        if self.sender is not None and self.sender.config.beside_store:
            manifest = await self._send_beside_store(version, parent, step, metrics, state, write)
        else:
            manifest = await self.worker.call(write, state)
            if self.sender is not None:
                await self._send(self.policy_version(manifest, parent, step, metrics), state)
        del state
        return await self.announce(manifest, parent, step, metrics)

    async def _send_beside_store(self, version: int, parent: int, step: int, metrics: dict[str, float],
                                 state: dict, write: Callable[[dict], dict[str, Any]]) -> dict[str, Any]:
        """The send and the store write side by side; the sender reports the stored version (or the
        write's error, which is raised here after the broker heard of it). With `store_after_flip`
        the write starts once the engines flipped the version in (when the broker flips before the
        store has it)."""
        stored: Future[common_pb2.PolicyVersion] = Future()
        partial = common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1, run_id=self.run_id,
                                           version=version, parent_version=parent, step=step)  # fmt: skip
        may_write = threading.Event()
        sending = asyncio.create_task(self._send(partial, state, stored, may_write))
        try:
            if self.sender is not None and self.sender.config.store_after_flip:
                await asyncio.to_thread(may_write.wait)  # set by the send at the latest when it ends
            manifest = await self.worker.call(write, state)
        except BaseException as exc:
            stored.set_exception(exc)
            await sending
            raise
        stored.set_result(self.policy_version(manifest, parent, step, metrics))
        await sending
        return manifest

    async def publish_adapter(self, version: int, parent: int, base_version: int, export: Callable[[], tuple],
                              step: int, metrics: dict[str, float]) -> common_pb2.PolicyVersion:
        """LoRA: writes the adapter `export()` returns as `version` on the full `base_version`,
        and announces it."""

        def write() -> dict[str, Any]:
            tensors, config = export()
            return self.store.write_adapter(version, tensors, config, base_version=base_version,
                                            parent_version=parent if parent >= 0 else None)

        manifest = await self.worker.call(write)
        return await self.announce(manifest, parent, step, metrics)

    def _on_worker(self, fn: Callable[[list, int], list]) -> Callable[[list, int], list]:
        """`fn` called from the sender's thread but run on the worker thread (where every collective runs)."""
        loop = asyncio.get_running_loop()

        def call(peers: list, bucket_bytes: int) -> list:
            return asyncio.run_coroutine_threadsafe(self.worker.call(fn, peers, bucket_bytes), loop).result()

        return call

    async def _send(self, msg: common_pb2.PolicyVersion, state: dict,
                    stored: Future[common_pb2.PolicyVersion] | None = None,
                    may_write: threading.Event | None = None) -> None:
        """`may_write`: set when the store write need not wait any longer (always, once this ends)."""
        assert self.sender is not None  # publish sends only when there is a sender
        try:
            summary = await asyncio.to_thread(self.sender.send, msg, state, stored, self._shards, may_write)
        except Exception as exc:  # the broker is down or refused: engines catch up from the store
            log.warning("sending version %d to engines failed: %s", msg.version, exc)
            return
        finally:
            if may_write is not None:
                may_write.set()
        self.last_send = summary
        failed = [o.engine_id for o in summary.outcomes if not o.ok]
        log.info("version %d sent straight to %d engine(s) in %.3f s (%s)%s", msg.version,
                 len(summary.outcomes), summary.seconds,
                 ", ".join(f"{k} {v} B" for k, v in summary.bytes.items()) or "nothing sent",
                 f"; {failed} fall back to the store" if failed else "",
                 extra={"version": msg.version, "send_s": round(summary.seconds, 4)})

    async def announce(self, manifest: dict[str, Any], parent: int, step: int,
                       metrics: dict[str, float]) -> common_pb2.PolicyVersion:
        msg = self.policy_version(manifest, parent, step, metrics)
        attempt = 0
        while True:
            attempt += 1
            try:
                await publish(self.js, "POLICY", self.run_id, msg.SerializeToString(),
                              msg_type="PolicyVersion", msg_id=f"{self.run_id}-v{msg.version}")
                break
            except (NatsError, TimeoutError) as exc:
                # NATS down or restarting: wait for it (the client reconnects by itself) rather than
                # exit; the message ID dedups a publish that did land. The stop cancels the wait.
                delay = min(ANNOUNCE_BACKOFF_MAX_S, 0.25 * 2 ** min(attempt, 8))
                log.warning("announcing version %d failed (%s); retrying in %.1f s (attempt %d)", msg.version,
                            exc or type(exc).__name__, delay, attempt)
                await asyncio.sleep(delay)
        log.info("published policy version %d (parent %d, %s, %d bytes)", msg.version, parent,
                 manifest["kind"], manifest["bytes"],
                 extra={"version": msg.version, "parent_version": parent})
        return msg

    def policy_version(self, manifest: dict[str, Any], parent: int, step: int,
                       metrics: dict[str, float]) -> common_pb2.PolicyVersion:
        delta = manifest["kind"] in ("delta", "adapter")  # both name the version they apply to
        return common_pb2.PolicyVersion(
            schema_version=common_pb2.SCHEMA_VERSION_1, run_id=self.run_id, version=manifest["version"],
            parent_version=parent, format=FORMATS[manifest["kind"]],
            base_version=manifest["base_version"] if delta else -1, uri=manifest["uri"],
            full_uri=self.store.uri(manifest["full_version"]), checksum=manifest["checksum"],
            num_bytes=manifest["bytes"], step=step, created_unix_ms=int(time.time() * 1000),
            metrics={k: float(v) for k, v in metrics.items()},
            served_dtype=SERVED_DTYPES.get(manifest["served_dtype"], manifest["served_dtype"]))

    async def last_announced(self) -> int | None:
        """The version of the run's newest announcement on POLICY, or None."""
        try:
            raw = await self.js.get_last_msg("POLICY", subject("POLICY", self.run_id))
        except NotFoundError:
            return None
        msg = common_pb2.PolicyVersion()
        msg.ParseFromString(raw.data)
        return msg.version
