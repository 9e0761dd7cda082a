"""`rlfleet token issue|list|revoke` on a run directory's secrets."""

from __future__ import annotations

import json

import pytest

from rlfleet.cli.main import main
from rlfleet.common import security


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_issue_list_and_revoke_a_client_token(tmp_path, capsys):
    run_dir = tmp_path / "run"
    directory = security.ensure_secrets(security.run_secrets_dir(run_dir), "calc")
    code, out, _ = run(["token", "issue", "team-a-env", "--run-dir", str(run_dir)], capsys)
    assert code == 0
    token = out.strip()
    principal = security.TokenBook.load(directory).verify(token)
    assert (principal.kind, principal.name, principal.run) == ("environment", "team-a-env", "calc")

    code, out, _ = run(["token", "list", "--run-dir", str(run_dir), "--json"], capsys)
    rows = json.loads(out)
    assert [(r["id"], r["name"], r["revoked"]) for r in rows] == [(principal.token_id, "team-a-env", False)]

    assert run(["token", "revoke", principal.token_id, "--run-dir", str(run_dir)], capsys)[0] == 0
    with pytest.raises(security.Unauthenticated, match="revoked"):
        security.TokenBook.load(directory).verify(token)
    assert json.loads(run(["token", "list", "--run-dir", str(run_dir), "--json"], capsys)[1])[0]["revoked"]


def test_token_commands_explain_what_is_missing(tmp_path, capsys):
    code, _, err = run(["token", "issue", "x", "--run-dir", str(tmp_path / "nowhere")], capsys)
    assert code == 1 and "start the platform there first" in err
    security.ensure_secrets(security.run_secrets_dir(tmp_path / "run"), "calc")
    assert run(["token", "revoke", "unknown", "--run-dir", str(tmp_path / "run")], capsys)[0] == 1
    assert run(["token", "issue", "bad name", "--run-dir", str(tmp_path / "run")], capsys)[0] == 1
