"""Where a local launch (`rlfleet up`) put things, read from its `<run_dir>/platform.json`.

Only the JSON is read (no import of the launcher), so the SDK, workers and `rlfleet-submit` can
find the services of a running platform from its run directory alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlfleet.common.infra_auth import run_dir_login
from rlfleet.envkit.errors import EnvkitError

STATE_FILE = "platform.json"


class RunDirError(EnvkitError):
    pass


@dataclass(frozen=True)
class RunDir:
    path: Path
    run_id: str
    nats_url: str
    session_address: str
    sandbox_address: str
    verifier_address: str
    suites_dir: Path  # where the verifier reads its suites

    def nats_login(self, user: str) -> dict[str, str]:
        """`{"user", "password_file"}` of a NATS user of this launch (its `secrets/`): `worker` to run
        rollouts, `operator` to publish tasks or watch the streams; {} when the launch has none."""
        return run_dir_login(self.path, "nats", user)

    @classmethod
    def load(cls, path: str | Path) -> RunDir:
        root = Path(path)
        state_file = root / STATE_FILE
        try:
            state = json.loads(state_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RunDirError(f"cannot read {state_file}: {exc}; was a platform "
                              "launched there (rlfleet up)?") from None
        processes = {p["name"]: p for p in state.get("processes", [])}
        if not processes:
            raise RunDirError(f"nothing is running in {root} ({state_file} lists no process)")

        def address(name: str) -> str:
            return processes.get(name, {}).get("address", "")

        verifier_cmd = processes.get("verifier", {}).get("cmdline", [])
        return cls(path=root, run_id=state["run_id"], nats_url=processes.get("nats", {}).get("url", ""),
                   session_address=address("session-server"), sandbox_address=address("sandbox-manager"),
                   verifier_address=address("verifier"),
                   suites_dir=Path(_flag(verifier_cmd, "--suites-dir") or root / "suites"))


def _flag(cmdline: list[str], name: str) -> str:
    """The value of `--name V`, `--name=V` or `--set name=V` (either spelling) on a command line."""
    key = name.removeprefix("--")
    keys = {key, key.replace("-", "_")}
    for i, arg in enumerate(cmdline):
        if arg in (name, "--" + key.replace("-", "_")) and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == "--set" and i + 1 < len(cmdline) and cmdline[i + 1].split("=", 1)[0] in keys:
            return cmdline[i + 1].split("=", 1)[1]
    return ""
