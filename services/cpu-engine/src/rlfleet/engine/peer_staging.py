"""The CPU engine's peer-to-peer receive side: one Mooncake-registered staging buffer shaped like the
model's served tensors (bf16, tied tensors once), published the way SGLang publishes its
remote-instance endpoint (`GET /remote_instance_transfer_engine_info?rank=0`).

A trainer writes a version straight into staging while the engine keeps generating (staging is not
the live weights); `/rlfleet/update_weights_from_staging` then checks every tensor against the
trainer's checksums and only then copies staging into the model, inside the weight-update pause.
The TransferEngine is created on the first endpoint request, so an engine that never takes P2P
never loads Mooncake (nor needs libibverbs).
"""

from __future__ import annotations

import threading

import torch

from rlfleet.weights.p2p import Endpoint, StagingBuffers, TransferAgent
from rlfleet.weights.sent import served_named


class PeerStaging:
    def __init__(self, parameters: dict[str, torch.Tensor], hostname: str, protocol: str,
                 device: str = "") -> None:
        self._parameters = parameters
        self.hostname, self.protocol, self.device = hostname, protocol, device
        self._staging: StagingBuffers | None = None
        self._lock = threading.Lock()

    def endpoint(self) -> Endpoint:
        """Sets up the agent and staging on first use (raises P2PError when Mooncake is unusable)."""
        with self._lock:
            if self._staging is None:
                template = {name: torch.empty(t.shape, dtype=t.dtype)
                            for name, t in served_named(self._parameters.items())}
                agent = TransferAgent(self.hostname, self.protocol, self.device)
                self._staging = StagingBuffers(agent, template)
            return self._staging.endpoint()

    @property
    def ready(self) -> bool:
        return self._staging is not None

    def verify(self, checksums: dict[str, str], algorithm: str) -> None:
        """Every staged tensor against the sender's checksum (the sender may list more: a tied copy
        the engine holds once); a staged tensor without one fails."""
        assert self._staging is not None
        self._staging.verify({n: checksums[n] for n in self._staging.tensors if n in checksums}, algorithm)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """Staging's tensors (views: the swap copies them into the model)."""
        assert self._staging is not None
        return list(self._staging.tensors.items())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named())

    def close(self) -> None:
        with self._lock:
            if self._staging is not None:
                self._staging.close()
                self._staging = None
