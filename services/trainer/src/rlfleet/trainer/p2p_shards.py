"""Every rank writes its own FSDP2 shard of the version into the engines' P2P staging
(`weight_send.p2p_every_rank`, torch backend under torchrun).

Rank 0 still gathers the whole state for the weight store and for the per-tensor checksums the
broker's plan carries, and it still asks for the plan and reports the outcome (one code path with
the other transports: `WeightSender.send`). Only the P2P writes differ: instead of rank 0 writing
every byte, each rank writes the dim-0 rows it holds (`rlfleet.weights.p2p.local_shards`), at their
byte offsets inside the engine's tensors, so on a fleet the transfer uses every rank's link. The
engine's checksum check covers the assembled tensors, so a rank that wrote nothing (or wrote wrong
bytes) fails the check and the engine falls back to the store.

The command runs on every rank through the learner's command channel, on the worker thread: it
follows the store write there rather than running beside it.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfleet.weights.p2p import P2PSender, TransferAgent

log = logging.getLogger(__name__)


class ShardWriter:
    """One rank's Mooncake agent and sender, kept for the process (agents are expensive)."""

    def __init__(self) -> None:
        self._agent: TransferAgent | None = None
        self._sender: P2PSender | None = None

    def write(self, state: dict[str, Any], prefix: str, peers: list[tuple[str, str]], bucket_bytes: int,
              options: Any, rank: int) -> dict[str, tuple[bool, int, str]]:
        """engine id -> (written, bytes, error) for this rank's shards of `state` (names under `prefix`)."""
        import torch

        from rlfleet.weights.p2p import Endpoint, P2PSender, TransferAgent, local_shards

        hf = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
        results: dict[str, tuple[bool, int, str]] = {}
        for engine_id, endpoint_json in peers:
            try:
                endpoint = Endpoint.from_json(json.loads(endpoint_json))
                missing = sorted(set(endpoint.tensors) - set(hf))
                if missing:
                    raise ValueError(f"the engine expects tensors the trainer does not hold: {missing[:5]}")
                if self._agent is None:
                    self._agent = TransferAgent(options.p2p_hostname, options.p2p_protocol,
                                                options.p2p_device)
                sender = self._sender
                if sender is None or sender.bucket_bytes != bucket_bytes:
                    if sender is not None:
                        sender.close()
                    sender = self._sender = P2PSender(self._agent, bucket_bytes, options.checksum_algorithm)
                shards = local_shards(hf, endpoint.tensors, dtype=getattr(torch, options.dtype), rank=rank)
                report = sender.send_shards(shards, endpoint)
                results[engine_id] = (True, report.bytes_sent, "")
            except Exception as exc:  # every rank must reach the gather below, whatever broke here
                log.warning("rank %d: P2P shard write to %s failed: %s", rank, engine_id, exc)
                results[engine_id] = (False, 0, f"rank {rank}: {type(exc).__name__}: {exc}")
        return results

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


def write_and_gather(writer: ShardWriter, backend: Any, peers: list[tuple[str, str]], bucket_bytes: int,
                     options: Any) -> list[dict[str, tuple[bool, int, str]]] | None:
    """Collective: every rank writes its shards, then rank 0 gets every rank's results (None elsewhere)."""
    import torch.distributed as dist

    from rlfleet.trainer.torch_backend import LM_PREFIX

    results = writer.write(backend.model.state_dict(), LM_PREFIX, peers, bucket_bytes, options, backend.rank)
    gathered: list[Any] = [None] * backend.world_size
    dist.all_gather_object(gathered, results)
    return gathered if backend.rank == 0 else None


def merged(peers: list[tuple[str, str]], gathered: list[dict[str, tuple[bool, int, str]]]) -> list[Any]:
    """One PeerResult per engine: sent only when every rank wrote its shards."""
    from rlfleet.api.broker.v1 import broker_pb2

    out = []
    for engine_id, _ in peers:
        by_rank = [g.get(engine_id, (False, 0, "no report")) for g in gathered]
        errors = [e for ok, _, e in by_rank if not ok]
        out.append(broker_pb2.PeerResult(engine_id=engine_id, sent=not errors,
                                         bytes=sum(b for _, b, _ in by_rank), error="; ".join(errors)))
    return out
