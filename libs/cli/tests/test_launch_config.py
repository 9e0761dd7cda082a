"""One config resolved once: `rlfleet run`/`rlfleet up` hold every service's real config model, hand the
shared fields down, and the launcher writes each process's whole config to one file it starts it with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.cli.launcher import (
    TIERS,
    Platform,
    PlatformState,
    ProcessRecord,
    engine_pool,
    is_ours,
    mark_stopping,
    process_config,
    write_process_config,
)
from rlfleet.cli.platform_config import SECTIONS, PlatformConfig
from rlfleet.cli.run_config import RunConfig
from rlfleet.common.config import ConfigError, load_config
from rlfleet.common.processes import read_json, wait_until
from rlfleet.common.standby import waiting_pid

ROOT = Path(__file__).resolve().parents[3]


def run_config(tmp_path: Path, text: str) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(RunConfig, ["--config", str(path)], prog="rlfleet run", environ={})


def launched(tmp_path: Path) -> PlatformState:
    state = PlatformState("r1", str(tmp_path), 1)
    state.processes = [ProcessRecord("nats", 0, 0, [], "", url="nats://127.0.0.1:1", kind="nats"),
                       ProcessRecord("redis", 0, 0, [], "", url="redis://127.0.0.1:2/0", kind="redis"),
                       ProcessRecord("engine-0", 0, 0, [], "", url="http://127.0.0.1:3", kind="engine"),
                       ProcessRecord("rollout-gateway", 0, 0, [], "", address="127.0.0.1:4")]
    return state


def test_the_run_hands_its_shared_fields_down_to_every_service(tmp_path):
    config = run_config(tmp_path, 'run_id = "r1"\ngroup_size = 4\nseed = 7\n[rollout]\nmax_staleness = 9\n'
                                  'max_inflight_sessions = 12\n[trainer.loss]\nalgorithm = "gspo"\n')
    assert {s.run_id for name, s in config.sections().items() if name != "engine"} == {"r1"}
    assert (config.trainer.group_size, config.trainer.max_staleness, config.trainer.backend.seed) == (4, 9, 7)
    assert config.gateway.max_inflight_sessions == 12 and config.gateway.route_pools == ["canary"]
    assert config.trainer.loss.algorithm == "gspo"
    # Where the run starts from other defaults than the trainer service's own.
    trainer = config.trainer
    assert (trainer.groups_per_step, trainer.optim.lr, trainer.torch_threads) == (8, 5e-5, 1)


def test_a_section_that_contradicts_a_shared_field_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.group_size is 3, but 8 is set for everyone at the top"):
        run_config(tmp_path, "[trainer]\ngroup_size = 3\n")
    with pytest.raises(ConfigError, match="gateway.run_id"):
        run_config(tmp_path, 'run_id = "a"\n[gateway]\nrun_id = "b"\n')


def test_a_section_may_set_what_the_run_only_derives(tmp_path):
    derived = run_config(tmp_path, "[gate]\nenabled = true\nevery_versions = 3\n")
    # The candidate engine holds the gate's version: the canary (rollouts) takes every version.
    assert not derived.broker.auto_promote and derived.broker.sync.every_n_versions == 1
    assert derived.broker.sync.max_delta_chain == 4
    pinned = run_config(tmp_path, "[gate]\nenabled = true\nevery_versions = 5\n[engines]\ncandidate = 0\n")
    assert pinned.broker.sync.every_n_versions == 5 and pinned.broker.sync.max_delta_chain == 5
    chosen = run_config(tmp_path, "[gate]\nenabled = true\n[broker]\nauto_promote = true\n"
                                  "[broker.sync]\nevery_n_versions = 1\n")
    assert chosen.broker.auto_promote and chosen.broker.sync.every_n_versions == 1
    # The torch trainer trains in bf16 autocast unless its section says otherwise; Megatron's bf16
    # (bf16 parameters) is never switched on for it.
    assert derived.trainer.backend.bf16
    assert not run_config(tmp_path, "[trainer.backend]\nbf16 = false\n").trainer.backend.bf16
    megatron = run_config(tmp_path, '[trainer.backend]\nname = "megatron"\n')
    assert megatron.trainer.backend.name == "megatron" and not megatron.trainer.backend.bf16


def test_a_service_key_that_does_not_exist_is_an_error_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trainer.loss.clip_eps_hgih'"):
        run_config(tmp_path, "[trainer.loss]\nclip_eps_hgih = 0.3\n")


def test_the_launcher_fills_in_what_only_it_knows_unless_a_section_sets_it(tmp_path):
    config = PlatformConfig(run_id="r1", log_format="text",
                            session={"tokenizer_path": "/mine", "max_open_sessions": 7})
    state, model = launched(tmp_path), tmp_path / "model"
    session = process_config("session-server", config, state, tmp_path, tmp_path / "ready.json", model)
    assert (session.nats.url, session.redis.url) == ("nats://127.0.0.1:1", "redis://127.0.0.1:2/0")
    assert session.gateway_address == "127.0.0.1:4" and session.ready_file == str(tmp_path / "ready.json")
    assert session.tokenizer_path == "/mine" and session.max_open_sessions == 7  # the section's own
    assert session.run_id == "r1" and session.log.format == "text"
    gateway = process_config("rollout-gateway", config, state, tmp_path, tmp_path / "g.json", model)
    assert [(e.engine_id, e.url) for e in gateway.engines] == [("engine-0", "http://127.0.0.1:3")]
    sandbox = process_config("sandbox-manager", config, state, tmp_path, tmp_path / "s.json", model)
    assert sandbox.driver.root == tmp_path / "sandboxes"
    broker = process_config("weight-broker", config, state, tmp_path, tmp_path / "b.json", model)
    assert broker.auto_promote and broker.weight_store == str(tmp_path / "weights")  # no canary engines
    engine = process_config("cpu-engine", config, state, tmp_path, tmp_path / "e.json", model)
    assert engine.model_path == model and engine.weight_version == "0"


@pytest.mark.parametrize("process", sorted(SECTIONS))
def test_each_process_reads_back_exactly_the_config_the_launcher_wrote(tmp_path, process):
    config = RunConfig()
    platform = PlatformConfig(run_id=config.run_id, **config.sections())
    resolved = process_config(process, platform, launched(tmp_path), tmp_path, tmp_path / "ready.json",
                              tmp_path / "model")
    path = write_process_config(tmp_path, process, resolved)
    assert path == tmp_path / "config" / f"{process}.json"
    assert load_config(type(resolved), ["--config", str(path)], prog=process, environ={}) == resolved


def test_every_toml_the_repo_ships_loads():
    shipped = {ROOT / "examples" / "calc.toml": RunConfig,
               ROOT / "examples" / "calc-megatron.toml": RunConfig,
               ROOT / "examples" / "calc-gspo.toml": RunConfig,
               ROOT / "examples" / "calc-ppo.toml": RunConfig,
               ROOT / "examples" / "calc-lora.toml": RunConfig,
               ROOT / "examples" / "llama.toml": RunConfig,
               ROOT / "examples" / "code.toml": RunConfig,
               ROOT / "services" / "weight-broker" / "examples" / "broker.toml": WeightBrokerConfig,
               ROOT / "deploy" / "compose" / "rlfleet.toml": PlatformConfig,
               ROOT / "deploy" / "compose" / "run.toml": RunConfig}
    assert set(shipped) == {p for p in ROOT.glob("**/*.toml") if p.name != "pyproject.toml"
                            and ".venv" not in p.parts and "runs" not in p.parts}
    for path, model in shipped.items():
        load_config(model, ["--config", str(path)], prog=path.name, environ={})


def test_engine_pools_of_several_engines_by_config(tmp_path):
    from rlfleet.cli.run_client import RunClient

    pools = "[engines]\ncanary = 2\ncandidate = 2\nfleet = 3\n"
    config = run_config(tmp_path, f'run_dir = "{tmp_path}"\n{pools}')
    platform = RunClient(config).platform_config(tmp_path / "model")
    assert (platform.engines, platform.canary_engines, platform.candidate_engines) == (7, 2, 2)
    state = PlatformState("r1", str(tmp_path), 1)
    state.processes = [ProcessRecord("nats", 0, 0, [], "", url="nats://127.0.0.1:1", kind="nats"),
                       ProcessRecord("redis", 0, 0, [], "", url="redis://127.0.0.1:2/0", kind="redis")]
    state.processes += [ProcessRecord(f"engine-{i}", 0, 0, [], "",
                                      url=f"http://127.0.0.1:{10 + i}", kind="engine")
                        for i in range(7)]
    gateway = process_config("rollout-gateway", platform, state, tmp_path, tmp_path / "g.json", tmp_path)
    assert [(e.engine_id, e.pool) for e in gateway.engines] == [
        ("engine-0", "canary"), ("engine-1", "canary"), ("engine-2", "candidate"), ("engine-3", "candidate"),
        ("engine-4", "fleet"), ("engine-5", "fleet"), ("engine-6", "fleet")]
    with pytest.raises(ValueError, match=r"canary_engines \(2\) \+ candidate_engines \(1\) is more than"):
        PlatformConfig(engines=2, canary_engines=2, candidate_engines=1)
    default = RunClient(run_config(tmp_path, f'run_dir = "{tmp_path}"\n')).platform_config(tmp_path / "model")
    assert (default.engines, default.canary_engines, default.candidate_engines) == (3, 1, 1)
    assert [engine_pool(default, i) for i in range(3)] == ["canary", "candidate", "fleet"]
    # Sync mode (lock-step: the gate evaluates between steps) and LoRA runs have no candidate pool.
    for extra in ('mode = "sync"\n', '[trainer.lora]\nenabled = true\n', '[gate]\nenabled = false\n'):
        other = RunClient(run_config(tmp_path, f'run_dir = "{tmp_path}"\n{extra}')).platform_config(
            tmp_path / "model")
        assert (other.engines, other.candidate_engines) == (2, 0), extra


def test_restart_policy_reaches_the_launch_and_may_change_on_resume(tmp_path):
    from rlfleet.cli.run_client import RunClient
    from rlfleet.cli.run_state import config_changes

    config = run_config(tmp_path, f'run_dir = "{tmp_path}"\n[restart]\nenabled = false\nmax_backoff_s = 3\n')
    platform = RunClient(config).platform_config(tmp_path / "model")
    assert not platform.restart.enabled and platform.restart.max_backoff_s == 3
    before = run_config(tmp_path, f'run_dir = "{tmp_path}"\n').model_dump(mode="json")
    assert config_changes(before, config.model_dump(mode="json")) == []


def test_restarts_back_off_exponentially_up_to_a_bound_and_start_over_once_stable(tmp_path):
    platform = Platform(PlatformConfig(run_dir=str(tmp_path), services=[], engines=0,
                                       restart={"first_backoff_s": 1.0, "max_backoff_s": 4.0,
                                                "stable_after_s": 30.0}))
    record = ProcessRecord("trainer", 0, 0, [], "")
    points = (0.0, 0.5, 1.0, 2.5, 3.0, 5.0, 6.9, 7.0, 10.0, 11.0)
    tries = [t for t in points if platform._backoff_over(record, 1000 + t)]
    # At once, then 1 s, 2 s, 4 s, 4 s (the bound) after the previous try.
    assert tries == [0.0, 1.0, 3.0, 7.0, 11.0]
    assert platform._backoff_over(record, 1000 + 11.0 + 30.0), "up 30 s: the next restart is at once"
    assert not platform._backoff_over(record, 1000 + 41.5)


def test_nothing_is_restarted_while_rlfleet_down_stops_the_platform(tmp_path):
    platform = Platform(PlatformConfig(run_dir=str(tmp_path), services=[], engines=0))
    # not running
    platform.state.processes = [ProcessRecord("trainer", 0, 0, ["/bin/true"], str(tmp_path / "t.log"))]
    mark_stopping(tmp_path)
    assert platform.stopping()
    assert platform.restart_dead() == [] and platform.state.processes[0].restarts == 0


@pytest.mark.parametrize("transport", ["disk_delta", "distributed", "p2p", "tensor"])
def test_one_switch_makes_the_trainer_send_to_the_broker_it_starts_after(tmp_path, transport):
    config = PlatformConfig(run_id="r1", broker={"sync": {"transport": transport}})
    state = launched(tmp_path)
    state.processes.append(ProcessRecord("weight-broker", 0, 0, [], "", address="127.0.0.1:5"))
    trainer = process_config("trainer", config, state, tmp_path, tmp_path / "t.json", tmp_path / "model")
    sends = transport != "disk_delta"
    assert trainer.weight_send.broker_address == ("127.0.0.1:5" if sends else "")
    tier = {name: i for i, names in enumerate(TIERS) for name in names}
    assert tier["trainer"] > tier["weight-broker"]


def test_the_repo_suite_needs_sandboxed_tools_and_gets_a_warm_pool_sized_to_its_concurrency(tmp_path):
    with pytest.raises(Exception, match="tool_runtime"):
        run_config(tmp_path, 'suite = "repo"\n')
    config = run_config(tmp_path, 'suite = "repo"\n[rollout]\ntool_runtime = "sandbox"\nconcurrency = 12\n')
    assert config.sandbox.driver.pool_size == 14
    pinned = run_config(tmp_path, '[rollout]\ntool_runtime = "sandbox"\n[sandbox.driver]\npool_size = 3\n')
    assert pinned.sandbox.driver.pool_size == 3


FAKE_SERVICE = """
import json, os, signal, sys, time
from rlfleet.common import standby
config = json.load(open(sys.argv[sys.argv.index("--config") + 1]))
if standby.requested(sys.argv):  # as a service's script does
    standby.wait_for_promotion(config["ready_file"], lambda: time.sleep(0.2))
how = "standby" if "--standby" in sys.argv else "cold"
with open(config["ready_file"] + ".tmp", "w") as f:
    json.dump({"grpc_address": config["address"], "how": how}, f)
os.rename(config["ready_file"] + ".tmp", config["ready_file"])
time.sleep(600)
"""


def platform_with_a_dead_trainer(tmp_path: Path, service_script: str) -> tuple[Platform, ProcessRecord, Path]:
    """A launch of one trainer (`service_script`, FAKE_SERVICE or a variant) with a standby, whose
    trainer is already dead; and the trainer's ready file."""
    script, config_file = tmp_path / "fake.py", tmp_path / "trainer.json"
    ready = tmp_path / "trainer.ready.json"
    script.write_text(service_script)
    config_file.write_text(json.dumps({"ready_file": str(ready), "address": "127.0.0.1:7"}))
    gone = subprocess.Popen(["/bin/true"])
    gone.wait()  # a PID that is no longer ours
    platform = Platform(PlatformConfig(run_dir=str(tmp_path), services=["trainer"], engines=0,
                                       restart={"standby": ["trainer"]}))
    trainer = ProcessRecord("trainer", gone.pid, 1,
                            [sys.executable, str(script), "--config", str(config_file)],
                            str(tmp_path / "trainer.log"), address="127.0.0.1:7")
    platform.state.processes = [trainer]
    return platform, trainer, ready


def test_a_dead_trainer_is_taken_over_by_its_standby_then_cold_started_once_the_standby_is_gone(tmp_path):
    platform, trainer, ready = platform_with_a_dead_trainer(tmp_path, FAKE_SERVICE)
    try:
        platform.start_standbys()
        (standby,) = platform.state.standbys
        assert standby.kind == "standby" and standby.cmdline[-1] == "--standby" and is_ours(standby)
        wait_until(lambda: waiting_pid(ready) == standby.pid, 30, "the standby waiting")

        (event,) = platform.restart_dead()
        assert "trainer restarted from its standby" in event and trainer.restarts == 1
        assert trainer.pid == standby.pid and is_ours(trainer) and read_json(ready)["how"] == "standby"
        assert "--standby" not in trainer.cmdline, \
            "its record keeps the plain command line for a cold restart"
        (second,) = platform.state.standbys
        assert second.pid != standby.pid and is_ours(second), "a new standby once the promoted one serves"

        os.killpg(second.pid, signal.SIGKILL)
        os.killpg(trainer.pid, signal.SIGKILL)
        wait_until(lambda: not is_ours(trainer) and not is_ours(second), 10, "both gone")
        platform._restart_tries.clear()  # no backoff: this is a test of who restarts it, not when
        (event,) = platform.restart_dead()
        assert "from its standby" not in event and read_json(ready)["how"] == "cold" and is_ours(trainer)
        (third,) = platform.state.standbys
        assert is_ours(third)
    finally:
        started = [*platform.state.processes, *platform.state.standbys]
        platform.down()
    assert not any(is_ours(r) for r in started), "`down` stops the standby too"


def test_a_standby_still_importing_is_not_promoted_the_restart_is_a_cold_start(tmp_path):
    importing_a_minute = FAKE_SERVICE.replace("time.sleep(0.2)", "time.sleep(60)")
    platform, trainer, ready = platform_with_a_dead_trainer(tmp_path, importing_a_minute)
    try:
        platform.start_standbys()
        (importing,) = platform.state.standbys
        (event,) = platform.restart_dead()
        assert "from its standby" not in event and read_json(ready)["how"] == "cold" and is_ours(trainer)
        wait_until(lambda: not is_ours(importing), 10, "the standby that was not ready stopped")
    finally:
        platform.down()
