"""What `rlfleet run` keeps to resume a run, and how it decides between a new run and a resume."""

import asyncio
import os
import types

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.cli.report import (
    EpisodeRecord,
    EvalResult,
    GateDecision,
    RunRecord,
    StepRecord,
    TrajectoryRecord,
    summarize,
)
from rlfleet.cli.rl_loop import RLRun, RunOptions
from rlfleet.cli.run_client import main
from rlfleet.cli.run_config import RunConfig
from rlfleet.cli.run_state import (
    RUN_OUTPUTS,
    RecordJSON,
    RunState,
    clear_run_outputs,
    config_changes,
    host_identity,
    record_from_dict,
)
from rlfleet.common.errors import StartupError


def _record() -> RunRecord:
    record = RunRecord("r", "async", {"a": 1}, 1.0, wall_s=12.0)
    record.steps.append(StepRecord(1, 1, 3.0, 0.5, {"tokens": 600.0}))
    record.evals.append(EvalResult(0, "heldout", 10, 0.3, 0.1, 0.0, 1.2, 2.0, 0.5, "baseline"))
    record.gate.append(GateDecision(1, False, ["no gain"], 4.0))
    record.trajectories.append(TrajectoryRecord(2.0, 40, 12, 1.0, True, "completed", "train",
                                                0, 1, 0.2, [0.1]))
    record.cpu.append((2.0, 80.0))
    record.memory_mb.append((2.0, 900.0))
    record.episodes.append(EpisodeRecord(3.0, False, ["WRONG_ANSWER"], {"read_file": 1}, 0, 0.5, 0.1,
                                         0.05, 0.9, 1.6))
    return record


def test_a_record_survives_the_state_file(tmp_path):
    from dataclasses import asdict

    state = RunState("interrupted", {"run_id": "r"}, "abc", loop_s=12.0, tasks_published=7,
                     record=asdict(_record()))
    state.save(tmp_path)
    back = RunState.load(tmp_path)
    assert back.tasks_published == 7 and back.attempt == "abc"
    record = record_from_dict(back.record)
    assert summarize(record) == summarize(_record())


def test_the_saved_record_encodes_each_trajectory_once_and_reads_as_the_whole_record_would():
    import json
    from dataclasses import asdict

    encoder, record = RecordJSON(), _record()
    first = encoder.encode(record)
    assert first == json.dumps(asdict(record), default=str)
    cached = encoder._encoded["trajectories"][1][0]
    record.trajectories.append(TrajectoryRecord(5.0, 44, 10, 0.0, False, "completed", "train", 1, 0, 0.1, []))
    record.gate.append(GateDecision(2, True, [], 6.0))  # a list that is not append-only: encoded whole
    record.notes.append("more")
    second = encoder.encode(record)
    assert second == json.dumps(asdict(record), default=str)
    assert encoder._encoded["trajectories"][1][0] is cached  # the first trajectory was not encoded again
    resumed = record_from_dict(json.loads(second))  # a resume brings new lists: encoded from the start
    resumed.episodes.clear()
    assert encoder.encode(resumed) == json.dumps(asdict(resumed), default=str)

    state = RunState("running", {"run_id": "r"}, "abc", record_json=encoder.encode(resumed))
    back = RunState.from_json(state.to_json(), "test")
    assert back.record == json.loads(json.dumps(asdict(resumed), default=str)) and back.record_json is None
    assert back.to_json() == state.to_json()


def test_summary_has_the_figures_benchmarks_compare():
    summary = summarize(_record())
    assert summary["trained_tokens_per_s"] == pytest.approx(600 / 12)
    assert summary["peak_rss_mb"] == 900.0
    assert summary["heldout_curve"] == [{"elapsed_s": 0.5, "version": 0, "success": 0.3, "label": "baseline"}]


def test_a_damaged_state_file_is_reported(tmp_path):
    (tmp_path / "run_state.json").write_text("{not json")
    with pytest.raises(StartupError, match="damaged"):
        RunState.load(tmp_path)


def test_only_budget_and_eval_concurrency_may_change_on_resume():
    before = RunConfig().model_dump(mode="json")
    longer = RunConfig(budget={"max_steps": 99, "max_minutes": 30},
                       eval={"concurrency": 8}).model_dump(mode="json")
    assert config_changes(before, longer) == []
    other = RunConfig(trainer={"optim": {"lr": 1e-3}}).model_dump(mode="json")
    assert config_changes(before, other) == ["trainer.optim.lr: 5e-05 -> 0.001"]


def test_clearing_a_run_removes_only_what_runs_write(tmp_path):
    for name in ("nats", "weights", "logs"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text("x")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "my-notes.txt").write_text("keep me")
    removed = clear_run_outputs(tmp_path)
    assert sorted(removed) == ["logs", "nats", "summary.json", "weights"]
    assert set(removed) <= set(RUN_OUTPUTS)
    assert [p.name for p in tmp_path.iterdir()] == ["my-notes.txt"]


def _run(tmp_path, **options) -> RLRun:
    return RLRun(RunConfig(run_dir=str(tmp_path)), RunOptions(**options))


def test_resume_needs_a_run_to_resume(tmp_path):
    with pytest.raises(StartupError, match="nothing to resume"):
        _run(tmp_path, resume=True).take_over_run_dir()


def test_an_interrupted_run_is_not_silently_replaced(tmp_path):
    RunState("interrupted", RunConfig(run_dir=str(tmp_path)).model_dump(mode="json"), "a", loop_s=40,
             reason="trainer stopped running").save(tmp_path)
    with pytest.raises(StartupError, match="--resume.*--fresh"):
        _run(tmp_path).take_over_run_dir()
    _run(tmp_path, fresh=True).take_over_run_dir()  # discarding it is a choice


def test_a_finished_run_is_replaced_by_a_new_one(tmp_path):
    RunState("finished", RunConfig(run_dir=str(tmp_path)).model_dump(mode="json"), "a").save(tmp_path)
    run = _run(tmp_path)
    run.take_over_run_dir()
    assert not run.resuming


def test_resuming_with_a_different_training_config_is_refused(tmp_path):
    RunState("interrupted", RunConfig(run_dir=str(tmp_path)).model_dump(mode="json"), "a").save(tmp_path)
    run = RLRun(RunConfig(run_dir=str(tmp_path), group_size=4), RunOptions(resume=True))
    with pytest.raises(StartupError, match="group_size: 8 -> 4"):
        run.take_over_run_dir()


def test_resume_restores_the_accepted_version_the_gate_and_the_budget_spent(tmp_path):
    from dataclasses import asdict

    config = RunConfig(run_dir=str(tmp_path))
    accepted = EvalResult(5, "heldout", 10, 0.6, 0.1, 0.0, 1.2, 2.0, 80.0, "candidate")
    RunState("interrupted", config.model_dump(mode="json"), "att", loop_s=95.0,
             tasks_published=40, last_gated=5, accepted_version=5, accepted_eval=asdict(accepted),
             record=asdict(_record())).save(tmp_path)
    run = RLRun(RunConfig(run_dir=str(tmp_path), budget={"max_minutes": 20}), RunOptions(resume=True))
    run.take_over_run_dir()
    assert run.resuming and run.last_gated == 5 and run.record.accepted_version == 5
    assert run.accepted_eval == accepted
    assert run.state.attempt == "att" and run.state.resumes == [95.0]
    assert run.record.config["budget"]["max_minutes"] == 20


def test_each_run_draws_its_own_evaluation_seed_and_keeps_it_across_resumes(tmp_path):
    from rlfleet.cli.loop_parts import eval_sampling

    first, second = (RLRun(RunConfig(run_dir=str(tmp_path / name))) for name in ("a", "b"))
    assert first.state.eval_seed != second.state.eval_seed  # 1 in 2**31 to fail by chance
    task = common_pb2.Task(task_id="calc-1", sampling=common_pb2.SamplingParams(max_new_tokens=8))
    assert eval_sampling(task, first.state.eval_seed).seed != eval_sampling(task, second.state.eval_seed).seed
    assert RLRun(RunConfig(run_dir=str(tmp_path / "c"), eval={"seed": 7})).state.eval_seed == 7

    from dataclasses import asdict

    def resumed_from(saved_seed: int | None, seed: int = 0) -> RLRun:
        run_dir = tmp_path / f"resumed-{saved_seed}"
        run_dir.mkdir()
        config = RunConfig(run_dir=str(run_dir), seed=seed)
        RunState("interrupted", config.model_dump(mode="json"), "att", eval_seed=saved_seed,
                 record=asdict(_record())).save(run_dir)
        run = RLRun(config, RunOptions(resume=True))
        run.take_over_run_dir()
        return run

    assert resumed_from(first.state.eval_seed).state.eval_seed == first.state.eval_seed  # still paired
    # A state saved before runs had seeds of their own: its evaluations were seeded by `seed`.
    assert resumed_from(None, seed=3).state.eval_seed == 3


def test_a_live_driver_keeps_its_run_dir(tmp_path):
    from rlfleet.cli.launcher import start_ticks

    RunState("running", RunConfig(run_dir=str(tmp_path)).model_dump(mode="json"), "a", driver_pid=os.getpid(),
             driver_start=start_ticks(os.getpid())).save(tmp_path)
    with pytest.raises(StartupError, match="another `rlfleet run`"):
        _run(tmp_path, resume=True).take_over_run_dir()


def test_a_driver_on_another_machine_is_left_to_the_store_s_lease(tmp_path):
    """A PID is only checked where it lives: the controller's store decides the rest by its lease."""
    from dataclasses import asdict

    from rlfleet.cli.launcher import start_ticks

    RunState("running", RunConfig(run_dir=str(tmp_path)).model_dump(mode="json"), "a", driver_pid=os.getpid(),
             driver_start=start_ticks(os.getpid()), driver_host="node-7/boot/pid:[1]",
             record=asdict(_record())).save(tmp_path)
    run = _run(tmp_path, resume=True)
    run.take_over_run_dir()
    assert run.resuming and run.current_state().driver_host == host_identity()


def test_a_resumed_run_may_go_on_in_another_run_directory(tmp_path):
    # A controller started on another machine continues the run in a run directory of its own.
    before = RunConfig(run_dir=str(tmp_path / "a")).model_dump(mode="json")
    assert config_changes(before, RunConfig(run_dir=str(tmp_path / "b")).model_dump(mode="json")) == []


def test_contradicting_flags_are_refused(tmp_path):
    with pytest.raises(StartupError, match="contradict"):
        main([str(tmp_path / "x.toml"), "--resume", "--fresh"])


def test_sync_mode_hands_out_more_groups_when_the_trainer_dropped_some(tmp_path):
    """Lock-step waits for a step; groups with equal rewards never reach one, so more are handed out."""
    from types import SimpleNamespace

    run = RLRun(RunConfig(run_dir=str(tmp_path), mode="sync", trainer={"groups_per_step": 2},
                          budget={"max_steps": 1}, gate={"enabled": False}))
    published: list[int] = []
    observer = SimpleNamespace(latest_version=0, groups_done=0, trainable_groups_done=0)

    handed_out = asyncio.Queue()

    class FakeFeeder:
        published = 0

        async def publish(self, n):
            published.append(n)
            self.published += n
            handed_out.put_nowait(n)

        async def in_flight(self):
            return self.published - observer.groups_done

    run.feeder = FakeFeeder()

    async def platform():
        # The first two groups complete with equal rewards (dropped), then the next two are learnable.
        await handed_out.get()
        observer.groups_done = 2
        await handed_out.get()
        observer.groups_done, observer.trainable_groups_done = 4, 2
        await asyncio.sleep(0.1)
        observer.latest_version = 1

    async def served(*args, **kwargs):
        return True

    run._wait_served = served

    async def go():
        await asyncio.gather(run._sync_steps(None, observer, None), platform())

    asyncio.run(asyncio.wait_for(go(), 10))
    assert published == [2, 2]


def test_a_background_part_that_fails_is_said_and_started_again_and_a_stop_abandons_a_wait(tmp_path, capsys):
    from rlfleet.cli.rl_loop import Stopped

    run = RLRun(RunConfig(run_dir=str(tmp_path)))
    calls = []

    async def flaky() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise ConnectionError("broker went away")

    async def scenario() -> None:
        await asyncio.wait_for(run._supervised("the promotion gate", flaky), 10)
        assert calls == [0, 1], "started again after its failure, then it ended normally"
        assert any("the promotion gate failed (ConnectionError: broker went away)" in n
                   for n in run.record.notes)
        never = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(run.ctx.unless_stopped(never))
        await asyncio.sleep(0.1)
        run.stop.set()
        with pytest.raises(Stopped):
            await asyncio.wait_for(waiting, 10)
        assert never.cancelled(), "the abandoned work is cancelled, not left running"

    asyncio.run(scenario())
    assert "the promotion gate failed" in capsys.readouterr().out


def test_a_step_the_trainer_publishes_past_the_step_budget_is_not_counted(tmp_path):
    # calc-lora's fast steps: version 61 of a 60-step budget arrived before the trainer was stopped,
    # and the run reported (and evaluated) 61 steps against full fine-tuning's 60.
    run = _run(tmp_path)
    run.config.budget.max_steps = 3
    run.state.start_version = 2
    version = lambda v: types.SimpleNamespace(version=v, step=v, metrics={"reward_mean": 0.5})  # noqa: E731
    for v in (3, 4, 4, 5, 6):
        run._note_step(version(v))
    assert [s.version for s in run.record.steps] == [3, 4, 5]
