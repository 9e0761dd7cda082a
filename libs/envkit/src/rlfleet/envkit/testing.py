"""Test helpers for environments and workers: a scripted policy behind the SGLang HTTP API, a tokenizer,
and a platform launched with `rlfleet up --detach` in a temporary run directory.

The **scripted engine** stands in for the *policy*, not for an rlfleet service: it answers `/generate`
with the token IDs of a scripted assistant turn, so an episode's path through the real gateway,
session server, sandbox manager and verifier is deterministic. The script of a task is written in
its user message, `[script: calc, answer]` (the default for a calc question, an ideal episode):

    calc     <calc>EXPR</calc>           EXPR from "What is EXPR?"
    answer   <answer>LAST TOOL OUTPUT</answer>
    wrong    <answer>-1</answer>
    bad      <calc>EXPR                  (not closed: an invalid call)
    unknown  <python>1</python>          (a tool the task does not offer)
    noop     I do not know.              (no action)
    ramble   text until max_new_tokens   (finish reason length)
    solve    <write_file>solution.py ...</write_file>   the code task's reference solution
    run      <python>import solution; print("imported")</python>
    done     <answer>done</answer>

    (repo tasks)
    read     <read_file>FILE</read_file>       FILE: the first `NAME.py` of the prompt
    fix      <edit_file>...</edit_file>        undoes the template bug found in the last tool output
    test     <run>python3 test_NAME.py</run>   the prompt's check command
    snoop    <run>...</run>                    looks everywhere the sandbox shows for the hidden tests

A code task's default script is `solve, done`; a repo task's `read, fix, test, done`.

Turn k of the episode plays the k-th entry (the last one repeats). Every turn ends with
`<|im_end|>` like a trained ChatML model's, except `ramble`. `POST /script {"delay_s": 1.5}` slows
every later turn down (for tests that kill a worker mid-episode).

    python -m rlfleet.envkit.testing --tokenizer DIR --ready-file F   (prints nothing; F gets {"url"})
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlfleet.common.chat import CHAT_TEMPLATE, IM_END, IM_START, tokenizer_config, train_tokenizer
from rlfleet.common.config import merge, nested
from rlfleet.common.processes import BIN, ServiceProcess, write_json_atomic
from rlfleet.common.service import write_ready_file
from rlfleet.envkit.corpus import default_corpus
from rlfleet.envkit.run_dir import RunDir
from rlfleet.envkit.suites.code_templates import TEMPLATES

_MESSAGE_RE = re.compile(re.escape(IM_START) + r"(?P<role>[a-z]+)\n(?P<content>.*?)"
                         + re.escape(IM_END), re.DOTALL)
_SCRIPT_RE = re.compile(r"\[script:\s*(?P<steps>[a-z, ]+)\]")
_EXPRESSION_RE = re.compile(r"What is (?P<expr>.+?)\?")


# -- the scripted policy --------------------------------------------------------------------------


def scripted_turn(conversation: str) -> str:
    """The assistant text the script gives for the conversation so far (ChatML, generation prompt open)."""
    messages = [(m["role"], m["content"]) for m in _MESSAGE_RE.finditer(conversation)]
    user = next((content for role, content in reversed(messages) if role == "user"), "")
    script = _SCRIPT_RE.search(user)
    repo_task = "Check with: python3 " in user
    default = ["read", "fix", "test", "done"] if repo_task else ["solve", "done"] if "solution.py" in user \
        else ["calc", "answer"]
    steps = [s.strip() for s in script["steps"].split(",")] if script else default
    turn = sum(1 for role, _ in messages if role == "assistant")
    step = steps[min(turn, len(steps) - 1)]
    expression = _EXPRESSION_RE.search(user)
    expr = expression["expr"] if expression else "1+1"
    last_tool = next((content for role, content in reversed(messages) if role == "tool"), "")
    return {
        "calc": f"<calc>{expr}</calc>",
        "answer": f"<answer>{last_tool}</answer>",
        "wrong": "<answer>-1</answer>",
        "bad": f"<calc>{expr}",
        "unknown": "<python>1</python>",
        "noop": "I do not know.",
        "ramble": "la " * 400,
        "solve": f"<write_file>solution.py\n{_reference_solution(user)}</write_file>",
        "run": '<python>import solution; print("imported")</python>',
        "done": "<answer>done</answer>",
        **(_repo_turns(user, last_tool) if repo_task else {}),
    }.get(step, "I do not know.")


# Where a candidate could look for the hidden tests: the workspace and every writable place the sandbox
# shows, and every process's command line and environment. Prints where it found them, or
# `hidden tests: none`. The patterns end in a bracket class (`passe[d]`) so that no argv of this
# command (the greps' own included) matches them.
SNOOP_COMMAND = ("found=$(grep -rlsI -e 'RESULT passe[d]' -e 'RLFLEET-HARNES[S]' . /tmp /dev/shm \"$HOME\";"
                 " for p in /proc/[0-9]*; do for f in cmdline environ; do tr '\\0' ' ' < $p/$f 2>/dev/null"
                 " | grep -q -e 'RESULT passe[d]' -e 'CASE[S]' && echo $p/$f; done; done 2>/dev/null);"
                 " echo \"hidden tests: ${found:-none}\"")


def _repo_turns(user: str, last_tool: str) -> dict[str, str]:
    from rlfleet.envkit.suites.repo import EDIT_SEPARATOR
    from rlfleet.envkit.suites.repo_templates import FUNCTIONS

    files = re.findall(r"(\w+)\.py", user)
    target = f"{files[0]}.py" if files else "main.py"
    test = next((f"{name}.py" for name in files if name.startswith("test_")), "test.py")
    name = user.split("()", 1)[0].split()[-1] if "()" in user else ""
    fix = "<answer>done</answer>"
    for function in FUNCTIONS:
        for bug in function.bugs:
            buggy = "    " + bug.buggy
            if function.name == name and buggy in last_tool.split("\n"):
                fix = f"<edit_file>{target}\n{buggy}{EDIT_SEPARATOR}    {bug.line}</edit_file>"
    return {"read": f"<read_file>{target}</read_file>", "fix": fix, "test": f"<run>python3 {test}</run>",
            "snoop": f"<run>{SNOOP_COMMAND}</run>"}


def _reference_solution(prompt: str) -> str:
    return next((t.solution for t in TEMPLATES if f"`{t.signature}`" in prompt), "pass\n")


class ScriptedEngine:
    """The subset of SGLang's HTTP API the gateway uses, answering from `scripted_turn`."""

    def __init__(self, tokenizer_dir: str | Path, delay_s: float = 0.0) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        end_id = self.tokenizer.token_to_id(IM_END)
        assert end_id is not None, f"the tokenizer has no {IM_END}"
        self.end_id = end_id
        self.delay_s = delay_s
        self.requests = 0

    def complete(self, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
        conversation = self.tokenizer.decode(input_ids, skip_special_tokens=False)
        text = scripted_turn(conversation)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not text.startswith("la "):
            ids.append(self.end_id)
        if len(ids) > max_new_tokens:
            return ids[:max_new_tokens], "length"
        return ids, "stop"

    def app(self):
        from aiohttp import web

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            sampling = body.get("sampling_params") or {}
            started = time.monotonic()
            ids, finish = self.complete(list(body["input_ids"]), int(sampling.get("max_new_tokens", 128)))
            meta = {"id": body.get("rid", ""), "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "0",
                    "weight_versions": [{"version": "0", "start": 0, "end": len(ids)}],
                    "finish_reason": {"type": finish,
                                      **({"matched": self.end_id} if finish == "stop" else {})},
                    "output_token_logprobs": [[-0.25, token, None] for token in ids],
                    "e2e_latency": time.monotonic() - started}
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})

        async def script(request: web.Request) -> web.Response:
            self.delay_s = float((await request.json()).get("delay_s", self.delay_s))
            return web.json_response({"delay_s": self.delay_s})

        def static(payload: Any):
            async def handler(request: web.Request) -> web.Response:
                return web.json_response(payload)
            return handler

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/script", script)
        app.router.add_get("/health", static({}))
        app.router.add_get("/health_generate", static({}))
        app.router.add_get("/model_info", static({"model_path": "scripted", "is_generation": True,
                                                  "weight_version": "0"}))
        app.router.add_get("/v1/loads", static({"loads": [{"dp_rank": 0, "num_running_reqs": 0,
                                                          "num_waiting_reqs": 0}]}))
        app.router.add_post("/flush_cache", static({}))
        return app


async def _serve(tokenizer_dir: str, ready_file: str, delay_s: float) -> None:
    from aiohttp import web

    runner = web.AppRunner(ScriptedEngine(tokenizer_dir, delay_s).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    write_ready_file(ready_file, {"url": f"http://127.0.0.1:{port}", "pid": os.getpid()})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.envkit.testing",
                                     description="the scripted engine")
    parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.tokenizer, args.ready_file, args.delay_s))


# -- fixtures' building blocks --------------------------------------------------------------------


def build_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """The default tokenizer format (ChatML special tokens at 0, 1, 2) trained on a small calc corpus."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(default_corpus(seed=0, n=300), vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    config = tokenizer_config(4096)
    assert config["chat_template"] == CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # What a launcher checks a model directory by; the scripted engine needs no weights.
    (out / "config.json").write_text(json.dumps({"model_type": "scripted", "max_position_embeddings": 4096}))
    return out


def start_scripted_engine(tokenizer_dir: Path, workdir: Path,
                          delay_s: float = 0.0) -> tuple[ServiceProcess, str]:
    argv = [sys.executable, "-m", "rlfleet.envkit.testing", "--tokenizer", str(tokenizer_dir),
            "--delay-s", str(delay_s)]
    engine = ServiceProcess(argv, workdir, name="scripted-engine").start(30.0)
    return engine, engine.url


class LaunchedPlatform:
    """`rlfleet up --detach` in `run_dir` with the rollout services; `down()` stops exactly what it started.

    With `engine_url` the gateway gets that one engine (e.g. the scripted one) and the launcher starts
    none; without, the launcher starts `engines` CPU engines serving `model_dir`.
    """

    SERVICES = ("sandbox-manager", "rollout-gateway", "session-server", "verifier")

    def __init__(self, run_dir: Path, run_id: str, model_dir: Path, engine_url: str = "", engines: int = 1,
                 services: tuple[str, ...] = SERVICES, sections: dict[str, dict] | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.run_dir = Path(run_dir)
        self.start_timeout_s = start_timeout_s  # generous: shared CPUs make a cold start slow
        self.run_id = run_id
        self.model_dir = Path(model_dir)
        self.engine_url = engine_url
        self.engines = 0 if engine_url else engines
        self.services = services
        # By section name (`session`, `trainer`, `engine`, ...); keys may be dotted.
        self.sections = sections or {}
        self.info: RunDir | None = None

    def config(self) -> dict:
        """The `rlfleet up` config of this launch."""
        model = str(self.model_dir)
        launch = {"run_id": self.run_id, "run_dir": str(self.run_dir), "services": list(self.services),
                  "log_format": "json", "start_timeout_s": self.start_timeout_s, "engines": self.engines,
                  "model_path": model, "session.tokenizer_path": model, "verifier.tokenizer_path": model}
        if self.engine_url:
            launch["gateway.engines"] = [{"engine_id": "e0", "url": self.engine_url}]
        return merge(nested(launch), nested(self.sections))

    def up(self, timeout_s: float = 300.0) -> LaunchedPlatform:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = write_json_atomic(self.run_dir.parent / f"{self.run_dir.name}-platform.json", self.config())
        result = subprocess.run([str(BIN / "rlfleet"), "up", "--detach", "--config", str(config)],
                                capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            self.down()
            raise RuntimeError(f"rlfleet up failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        self.info = RunDir.load(self.run_dir)
        return self

    def down(self) -> None:
        if (self.run_dir / "platform.json").exists():
            subprocess.run([str(BIN / "rlfleet"), "down", "--run-dir", str(self.run_dir)],
                           capture_output=True, timeout=60)

    def __enter__(self) -> LaunchedPlatform:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()


if __name__ == "__main__":
    main()
