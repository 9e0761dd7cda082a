"""Publishes finished trajectories on the TRAJECTORIES stream, deduplicated by trajectory ID."""

from __future__ import annotations

from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.streams import publish
from rlfleet.session.errors import PublishFailed


class TrajectoryPublisher:
    def __init__(self, js: JetStreamContext, run_id: str, timeout_s: float) -> None:
        self.js = js
        self.run_id = run_id
        self.timeout_s = timeout_s

    async def publish(self, trajectory: common_pb2.Trajectory, data: bytes = b"") -> bool:
        """True when this call stored it; False when JetStream already had it (`Nats-Msg-Id` = trajectory ID).
        `data`: the trajectory already serialized, when the caller has its bytes."""
        try:
            return await publish(self.js, "TRAJECTORIES", self.run_id, data or trajectory.SerializeToString(),
                                 msg_type="Trajectory", msg_id=trajectory.trajectory_id,
                                 timeout_s=self.timeout_s)
        except (NatsError, TimeoutError) as exc:
            raise PublishFailed(f"publishing trajectory {trajectory.trajectory_id} failed: {exc!r}; "
                                "close the session again to retry",
                                session_id=trajectory.session_id) from None
