"""PeersApp's typed peers (a component that needs Redis or JetStream gets a client, or a named error),
and redis_store's readers of the replies redis-py types loosely."""

from __future__ import annotations

import pytest

from rlfleet.common.config import ServiceConfig
from rlfleet.common.peers import PeersApp
from rlfleet.common.redis_store import binary_hash, members, text


class _App(PeersApp):
    async def start(self, server: object) -> None:  # never served: only the peers are under test
        raise NotImplementedError


def test_a_peer_not_connected_is_an_error_naming_the_app_not_a_none_passed_on():
    app = _App(ServiceConfig(), "rlfleet-test")
    with pytest.raises(RuntimeError, match="rlfleet-test: Redis is not connected"):
        app.connected_redis()
    with pytest.raises(RuntimeError, match="rlfleet-test: NATS is not connected"):
        app.connected_js()
    sentinel_redis, sentinel_js = object(), object()
    app.redis, app.js = sentinel_redis, sentinel_js  # stand-ins: only identity is checked
    assert app.connected_redis() is sentinel_redis and app.connected_js() is sentinel_js


def test_redis_replies_read_back_as_text():
    assert text(b"engine-1") == "engine-1" and text("engine-1") == "engine-1"
    assert binary_hash({b"owner": b"alice", "rev": "2"}) == {b"owner": b"alice", b"rev": b"2"}


def test_a_sorted_set_range_reads_back_as_members_and_a_scored_one_is_refused():
    assert members([b"s-1", "s-2"]) == ["s-1", "s-2"]
    with pytest.raises(TypeError, match="without scores"):
        members([(b"s-1", 1.0)])
