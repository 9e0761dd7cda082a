"""What a Verify request must say: a session, or an answer/files/sandbox; never a session and an answer."""

from __future__ import annotations

import pytest

from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.errors import InvalidArgument
from rlfleet.verifier.verifier import VerifyInput, check, solution_files, task_id_of


@pytest.mark.parametrize(("request_", "words"), [
    (VerifyInput(task_id="t"), "nothing to verify"),
    (VerifyInput(session_id="s", final_answer="3"), "final_answer"),
    (VerifyInput(final_answer="3"), "task_id is required"),
])
def test_a_request_without_something_to_verify_or_with_a_client_answer_for_a_session_is_invalid(
        request_, words):
    with pytest.raises(InvalidArgument, match=words):
        check(request_)


def test_valid_requests_pass_the_checks():
    for request in (VerifyInput(session_id="s"), VerifyInput(task_id="t", final_answer="3"),
                    VerifyInput(task_id="t", files={"solution.py": b""}),
                    VerifyInput(task_id="t", sandbox_id="b")):
        check(request)


def test_the_task_is_the_sessions_own_and_a_different_one_is_refused():
    session = session_pb2.Session(session_id="s", task_id="t1")
    assert task_id_of(VerifyInput(session_id="s"), session) == "t1"
    assert task_id_of(VerifyInput(session_id="s", task_id="t1"), session) == "t1"
    with pytest.raises(InvalidArgument, match="not the session's task"):
        task_id_of(VerifyInput(session_id="s", task_id="t2"), session)
    assert task_id_of(VerifyInput(session_id="s", task_id="t3"), session_pb2.Session(session_id="s")) == "t3"


def test_only_the_declared_solution_files_reach_the_tests():
    task = {"verifier": {"kind": "unit_tests", "tests": "x", "solution_files": ["solution.py"]}}
    assert solution_files(task, {"solution.py": b"a", "conftest.py": b"b"}) == {"solution.py": b"a"}
    assert solution_files({"verifier": {"kind": "numeric", "answer": "1"}}, {"solution.py": b"a"}) == {}
