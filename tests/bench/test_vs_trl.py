"""The pure parts of bench/vs_trl (configs, targets, ratios, tables, summaries), and the calc format it
gives TRL (chat template, tool-call parsing, tool, scoring). The TRL-specific checks skip without TRL."""

from __future__ import annotations

import json
import math
import random
import sys
import tomllib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vs_trl"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
from common import (  # noqa: E402
    Settings,
    SystemResult,
    default_target,
    from_rlfleet_summary,
    from_trl_result,
    ratios,
    rlfleet_config,
    table,
    time_to_target,
    to_toml,
    workloads,
)


def _result(system: str, workload: str, curve: list[tuple[float, float]], cps: float = 1.0,
            tps: float = 10.0):
    points = [{"elapsed_s": t, "version": i, "success": s, "label": "baseline" if i == 0 else "candidate"}
              for i, (t, s) in enumerate(curve)]
    return SystemResult(system=system, workload=workload, wall_s=curve[-1][0], completions_per_s=cps,
                        trained_tokens_per_s=tps, trainer_idle_fraction=0.5, peak_rss_mb=100.0, curve=points)


# -- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("workload", ["plain", "slow"])
def test_generated_rlfleet_config_is_a_valid_run_config_with_the_shared_settings(tmp_path, mode, workload):
    from rlfleet.cli.run_config import RunConfig

    settings = Settings(budget_s=90, heldout=50, eval_every_steps=5, lr=3e-5)
    load = workloads(slow_median_s=0.4, slow_sigma=1.5, slow_max_s=8)[workload]
    text = to_toml(rlfleet_config(settings, load, mode, f"vs-trl-{workload}-{mode}", tmp_path / "run",
                                  tmp_path / "cache"))
    config = RunConfig.model_validate(tomllib.loads(text))  # unknown keys are errors there
    assert config.mode == mode
    assert (config.group_size == settings.group_size
            and config.trainer.groups_per_step == settings.groups_per_step)
    assert config.trainer.optim.lr == 3e-5 and config.rollout.temperature == settings.temperature
    assert config.budget.max_minutes == pytest.approx(1.5)
    assert config.eval.heldout == 50 and config.gate.every_versions == 5
    assert config.model_cache_dir == str(tmp_path / "cache")
    assert config.rollout.max_staleness >= config.gate.every_versions
    latency = config.rollout.tool_latency
    if workload == "plain":
        assert latency.distribution == "none"
    else:
        assert ((latency.distribution, latency.median_s, latency.sigma, latency.max_s)
                == ("lognormal", 0.4, 1.5, 8))


def test_toml_writer_round_trips_nested_tables_and_strings_with_quotes():
    config = {"a": 1, "name": 'x "y"', "flag": False, "t": {"f": 0.25, "inner": {"s": "z"}}}
    assert tomllib.loads(to_toml(config)) == config


def test_lognormal_mean_matches_sampling_the_loops_distribution():
    rng = random.Random(1)
    draws = [min(rng.lognormvariate(math.log(0.5), 1.0), 3.0) for _ in range(200_000)]
    assert common.lognormal_mean(0.5, 1.0, 3.0) == pytest.approx(sum(draws) / len(draws), rel=0.01)


# -- targets and ratios ---------------------------------------------------------------------------


def test_time_to_target_is_the_first_evaluation_at_or_above_the_target():
    curve = [{"elapsed_s": 0.0, "success": 0.30}, {"elapsed_s": 40.0, "success": 0.38},
             {"elapsed_s": 20.0, "success": 0.41}, {"elapsed_s": 60.0, "success": 0.45}]
    assert time_to_target(curve, 0.40) == 20.0
    assert time_to_target(curve, 0.45) == 60.0
    assert time_to_target(curve, 0.30) == 0.0
    assert time_to_target(curve, 0.50) is None


def test_default_target_is_the_mean_baseline_plus_the_gain():
    runs = [_result("trl", "plain", [(0, 0.30), (10, 0.5)]),
            _result("async", "plain", [(0, 0.26), (10, 0.4)])]
    assert default_target(runs, 0.1) == pytest.approx(0.38)
    with pytest.raises(ValueError):
        default_target([SystemResult(system="trl", workload="plain", wall_s=1, completions_per_s=1,
                                     trained_tokens_per_s=1, trainer_idle_fraction=None, peak_rss_mb=None,
                                     curve=[])], 0.1)


def test_ratios_divide_async_by_each_other_system_per_workload():
    runs = [
        _result("trl", "slow", [(0, 0.3), (100, 0.35), (300, 0.42)], cps=1.0, tps=50.0),
        _result("sync", "slow", [(0, 0.3), (150, 0.41)], cps=2.0, tps=100.0),
        _result("async", "slow", [(0, 0.3), (50, 0.40), (90, 0.5)], cps=6.0, tps=240.0),
        _result("trl", "plain", [(0, 0.3), (60, 0.45)], cps=4.0, tps=100.0),
    ]
    rat = ratios(runs, target=0.40)
    assert set(rat) == {"slow"}  # no async run on plain: nothing to divide
    vs_trl, vs_sync = rat["slow"]["async/trl"], rat["slow"]["async/sync"]
    assert vs_trl["completions_per_s"] == pytest.approx(6.0)
    assert vs_trl["trained_tokens_per_s"] == pytest.approx(4.8)
    assert vs_trl["time_to_target_speedup"] == pytest.approx(300 / 50)
    assert vs_sync["time_to_target_speedup"] == pytest.approx(150 / 50)
    assert vs_trl["final_success_gain"] == pytest.approx(0.5 - 0.42)  # last evaluations, no "final" label


def test_a_system_that_never_reaches_the_target_has_no_speedup_and_shows_not_reached():
    runs = [_result("trl", "plain", [(0, 0.3), (100, 0.32)]),
            _result("async", "plain", [(0, 0.3), (50, 0.45)])]
    row = ratios(runs, 0.4)["plain"]["async/trl"]
    assert row["time_to_target_speedup"] is None
    assert row["time_to_target_speedup_at_least"] == pytest.approx(100 / 50)  # TRL's whole run / async's time
    assert "at least x2.00 sooner" in common.ratio_lines(ratios(runs, 0.4))
    text = table(runs, 0.4)
    trl_row = next(line for line in text.splitlines() if " trl " in line)
    assert "not reached" in trl_row
    assert "50s" in next(line for line in text.splitlines() if " async " in line)


# -- reading results ------------------------------------------------------------------------------


def _fake_summary() -> dict:
    return {
        "run_id": "vs-trl-slow-async", "mode": "async", "wall_s": 151.2, "trained_tokens_per_s": 812.5,
        "trainer_idle_fraction": 0.31, "peak_rss_mb": 2210.0,
        "trajectories": {"per_second": 9.5, "count": 1430},
        "heldout_curve": [{"elapsed_s": 0.4, "version": 0, "success": 0.27, "label": "baseline"},
                          {"elapsed_s": 61.0, "version": 5, "success": 0.36, "label": "candidate"},
                          {"elapsed_s": 150.0, "version": 12, "success": 0.41, "label": "final"}],
    }


def test_an_rlfleet_summary_becomes_a_result_row(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(_fake_summary()))
    row = from_rlfleet_summary(json.loads(path.read_text()), "async", "slow")
    assert (row.completions_per_s, row.trained_tokens_per_s, row.trainer_idle_fraction, row.peak_rss_mb) == \
        (9.5, 812.5, 0.31, 2210.0)
    assert (row.baseline, row.final, row.best) == (0.27, 0.41, 0.41)
    assert time_to_target(row.curve, 0.35) == 61.0


def test_a_summary_without_the_bench_fields_is_refused_with_their_names():
    summary = _fake_summary()
    del summary["heldout_curve"], summary["trained_tokens_per_s"]
    with pytest.raises(KeyError, match="heldout_curve, trained_tokens_per_s"):
        from_rlfleet_summary(summary, "sync", "plain")
    summary = _fake_summary()
    summary["trajectories"] = {"count": 3}
    with pytest.raises(KeyError, match="per_second"):
        from_rlfleet_summary(summary, "sync", "plain")


def test_a_trl_result_keeps_its_training_clock_and_says_evaluation_was_excluded():
    result = {"wall_s": 120.0, "wall_with_eval_s": 150.0, "eval_s": 30.0, "completions_per_s": 3.0,
              "trained_tokens_per_s": 90.0, "trainer_idle_fraction": 0.8, "peak_rss_mb": 700.0,
              "heldout_curve": [{"elapsed_s": 0.0, "wall_s": 0.0, "version": 0, "success": 0.25,
                                 "label": "baseline", "eval_s": 3.0},
                                {"elapsed_s": 120.0, "wall_s": 150.0, "version": 9, "success": 0.3,
                                 "label": "final", "eval_s": 3.0}]}
    row = from_trl_result(result, "plain")
    assert row.system == "trl" and row.wall_s == 120.0 and row.final == 0.3
    assert row.completions_per_s == 3.0 and time_to_target(row.curve, 0.3) == 120.0
    assert any("excludes held-out evaluation" in note for note in row.notes)
    wall = from_trl_result(result, "plain", clock="wall")
    assert wall.wall_s == 150.0 and time_to_target(wall.curve, 0.3) == 150.0
    assert wall.completions_per_s == pytest.approx(3.0 * 120 / 150)


def test_the_plot_is_written(tmp_path):
    runs = [_result("trl", "plain", [(0, 0.3), (100, 0.35)]),
            _result("async", "plain", [(0, 0.3), (50, 0.45)])]
    path = common.plot(runs, 0.4, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the calc format given to TRL -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from rlfleet.engine.build_model import tokenizer_config, train_tokenizer
    from rlfleet.envkit.corpus import default_corpus

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(default_corpus(seed=0, n=300), 512).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(1024)))
    return AutoTokenizer.from_pretrained(str(out))


def test_trl_accepts_the_calc_chat_template_for_tool_calling(tokenizer):
    pytest.importorskip("trl", reason="TRL is a benchmark-only dependency (requirements/bench.txt)")
    from calc_format import configure_tokenizer_for_trl
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    configure_tokenizer_for_trl(tokenizer)
    assert supports_tool_calling(tokenizer)
    assert is_chat_template_prefix_preserving(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"


def test_a_calc_call_renders_and_parses_as_the_suite_writes_it(tokenizer):
    pytest.importorskip("trl", reason="TRL is a benchmark-only dependency (requirements/bench.txt)")
    from calc_format import configure_tokenizer_for_trl
    from trl.chat_template_utils import parse_response

    from rlfleet.common.chat import render_messages

    configure_tokenizer_for_trl(tokenizer)
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "37*48+5"}}}
    messages = [{"role": "user", "content": "What is 37*48+5?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calc", "content": "1781"},
                {"role": "assistant", "content": "<answer>1781</answer>"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    plain = [{"role": m["role"], "content": m["content"] or "<calc>37*48+5</calc>"} for m in messages]
    assert rendered == render_messages(plain, add_generation_prompt=False)  # what rlfleet's sessions hold
    prompt = tokenizer(render_messages(plain[:1], add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    ids = tokenizer("<calc>37*48+5</calc><|im_end|>", add_special_tokens=False)["input_ids"]
    parsed = parse_response(tokenizer, ids, prefix=prompt)
    assert parsed["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"expression": "37*48+5"}}
    answer = tokenizer("<answer>1781</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    assert not parse_response(tokenizer, answer, prefix=prompt).get("tool_calls")


def test_the_calc_tool_answers_like_the_sandboxed_script_and_sleeps_the_drawn_latency():
    from calc_format import UNCLOSED_CALC_ERROR, make_calc_tool

    slept, counter = [], {}
    tool = make_calc_tool(lambda: 0.25, slept.append, counter)
    assert tool("37*48+5") == "1781"
    assert tool("1/0") == "error: division by zero"
    assert tool("12+3<|im_end|>") == UNCLOSED_CALC_ERROR
    assert slept == [0.25, 0.25, 0.25] and counter == {"calls": 3, "latency_s": 0.75}
    assert tool.__name__ == "calc"


def test_the_verifier_scores_a_trl_completion_transcript():
    from calc_format import CalcScorer

    from rlfleet.envkit.suites import calc

    task = calc.make_task("37*48+5", 1)
    scorer = CalcScorer([task])
    good = ("<|im_start|>assistant\n<calc>37*48+5</calc><|im_end|>\n<|im_start|>tool\n1781<|im_end|>\n"
            "<|im_start|>assistant\n<answer>1781</answer><|im_end|>")
    wrong = "<|im_start|>assistant\n<answer>1780</answer><|im_end|>"
    bad_call = ("<|im_start|>assistant\n<calc>37*48+5<|im_end|>\n<|im_start|>tool\nerror: x<|im_end|>\n"
                "<|im_start|>assistant\n<answer>1781</answer><|im_end|>")
    assert scorer.score(task.task_id, good, truncated=False) == (1.0, True)
    assert scorer.score(task.task_id, wrong, truncated=False) == (0.0, False)
    reward, passed = scorer.score(task.task_id, bad_call, truncated=False)
    assert passed and reward == pytest.approx(0.95)  # the malformed call costs its penalty


# -- the driver -----------------------------------------------------------------------------------

FAKE_RLFLEET = '''#!{python}
import json, sys, tomllib
from pathlib import Path
assert sys.argv[1] == "run"
config = tomllib.loads(Path(sys.argv[2]).read_text())
run_dir = Path(config["run_dir"])
run_dir.mkdir(parents=True, exist_ok=True)
print("gate: version 5 accepted: held-out success 0.2 -> 0.4", flush=True)
speed = 4.0 if config["mode"] == "async" else 1.0
latency = config["rollout"]["tool_latency"]["distribution"]
(run_dir / "summary.json").write_text(json.dumps({{
    "wall_s": config["budget"]["max_minutes"] * 60, "trained_tokens_per_s": 100 * speed,
    "trajectories": {{"per_second": speed}}, "trainer_idle_fraction": 0.1, "peak_rss_mb": 900.0,
    "heldout_curve": [{{"elapsed_s": 0.5, "version": 0, "success": 0.3, "label": "baseline"}},
                      {{"elapsed_s": 60 / speed, "version": 5, "success": 0.5, "label": "candidate"}}],
    "latency": latency}}))
'''


def test_an_rlfleet_run_is_started_on_the_generated_config_and_read_back(tmp_path):
    import run

    fake = tmp_path / "rlfleet"
    fake.write_text(FAKE_RLFLEET.format(python=sys.executable))
    fake.chmod(0o755)
    settings = Settings(budget_s=30)
    rows = [run.run_rlfleet(settings, workloads()["slow"], mode, tmp_path / "work",
                            tmp_path / "cache", str(fake))
            for mode in ("sync", "async")]
    assert ([(r.system, r.workload, r.completions_per_s) for r in rows]
            == [("sync", "slow", 1.0), ("async", "slow", 4.0)])
    assert (json.loads((tmp_path / "work" / "slow-async" / "summary.json").read_text())["latency"]
            == "lognormal")
    assert "gate: version 5" in (tmp_path / "work" / "vs-trl-slow-async.log").read_text()
    assert ratios(rows, 0.45)["slow"]["async/sync"]["time_to_target_speedup"] == pytest.approx(4.0)


def test_a_failed_rlfleet_run_is_an_error_naming_its_log(tmp_path):
    import run

    fake = tmp_path / "rlfleet"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('boom')\nsys.exit(3)\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with 3; see .*vs-trl-plain-sync\.log"):
        run.run_rlfleet(Settings(budget_s=30), workloads()["plain"], "sync", tmp_path,
                        tmp_path / "cache", str(fake))


def test_without_trl_the_trl_runs_are_skipped_with_a_message(monkeypatch, capsys):
    import run

    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)
    assert run.main(["--systems", "trl", "--workloads", "plain"]) == 0
    assert "SKIP trl: TRL is not installed" in capsys.readouterr().err


def test_plan_prints_the_runs_and_the_total_time(capsys):
    import run

    assert run.main(["--plan", "--budget-s", "100", "--workloads", "plain,slow", "--systems",
                     "trl,async"]) == 0
    out = capsys.readouterr().out
    assert "4 runs x 100 s budget" in out and "lognormal(median 0.5 s, sigma 1, cap 20 s)" in out


def test_trl_frames_a_tool_result_exactly_as_rlfleet_sessions_do(tokenizer, tmp_path):
    pytest.importorskip("trl", reason="TRL is a benchmark-only dependency (requirements/bench.txt)")
    from calc_format import configure_tokenizer_for_trl, make_calc_tool
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlfleet.engine.build_model import ModelSpec, build_model

    configure_tokenizer_for_trl(tokenizer)
    spec = ModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=256)
    model = build_model(spec, len(tokenizer), seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=2,
                      num_generations=2, max_steps=1, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=args, train_dataset=Dataset.from_list(
                              [{"prompt": [{"role": "user", "content": "What is 1+2?"}]}] * 2),
                          processing_class=tokenizer, tools=[make_calc_tool(lambda: 0.0, lambda s: None)])
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": "calc", "content": "1781"}])
    # rlfleet's ChatMLFraming after a turn that ended with <|im_end|>:
    assert (tokenizer.decode(suffix, skip_special_tokens=False)
            == "\n<|im_start|>tool\n1781<|im_end|>\n<|im_start|>assistant\n")


class _ScriptedPolicy:
    """A stand-in causal LM for `calc_format.evaluate_success`: it replays a scripted reply per turn,
    reading the conversation so far (it keeps each row's tokens itself; the cache it returns is a token)."""

    def __init__(self, tokenizer, reply) -> None:
        import torch

        self.torch, self.tokenizer, self.reply = torch, tokenizer, reply
        self.training = False
        self.rows: list[list[int]] = []

    def eval(self):
        return self

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def __call__(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None):
        from types import SimpleNamespace

        ids = input_ids.tolist()
        if past_key_values is None:
            self.rows = [[t for t, m in zip(row, mask, strict=True) if m]
                         for row, mask in zip(ids, attention_mask.tolist(), strict=True)]
        else:
            for row, new in zip(self.rows, ids, strict=True):
                row.extend(new)
        logits = self.torch.full((len(self.rows), 1, len(self.tokenizer)), -1e9)
        for i, row in enumerate(self.rows):
            text = self.tokenizer.decode(row, skip_special_tokens=False)
            turn_start = text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
            target = self.tokenizer(self.reply(text[:turn_start]) + "<|im_end|>",
                                    add_special_tokens=False)["input_ids"]
            done = (len(self.tokenizer(text[turn_start:], add_special_tokens=False)["input_ids"])
                    if text[turn_start:] else 0)
            logits[i, 0, target[min(done, len(target) - 1)]] = 0.0
        return SimpleNamespace(logits=logits, past_key_values="kept by the stand-in")


def _ideal_reply(context: str, wrong_by: int = 0) -> str:
    import re

    from rlfleet.envkit.suites import calc

    expression = re.search(r"What is (.+?)\?", context).group(1)
    if "<|im_start|>tool\n" not in context:
        return f"<calc>{expression}</calc>"
    return f"<answer>{int(calc.tool_observation(expression)) + wrong_by}</answer>"


def test_heldout_evaluation_runs_the_agent_loop_and_scores_with_the_verifier(tokenizer):
    pytest.importorskip("torch")
    from calc_format import evaluate_success

    from rlfleet.envkit.suites import calc

    tasks = calc.generate_tasks("heldout", 6, seed=0)
    right = evaluate_success(_ScriptedPolicy(tokenizer, _ideal_reply), tokenizer, tasks,
                             temperature=0.0, seed=0, batch_size=4)
    wrong = evaluate_success(_ScriptedPolicy(tokenizer, lambda c: _ideal_reply(c, wrong_by=1)),
                             tokenizer, tasks, temperature=0.0, seed=0)
    chatty = evaluate_success(_ScriptedPolicy(tokenizer, lambda c: "<calc>1+1</calc>"), tokenizer, tasks,
                              temperature=0.0, seed=0)  # calls the tool every turn, never answers
    assert (right, wrong, chatty) == (1.0, 0.0, 0.0)


def test_a_saved_results_file_is_reported_again_with_ratios_on_both_trl_clocks(tmp_path, capsys):
    import run

    trl = {"wall_s": 120.0, "wall_with_eval_s": 150.0, "eval_s": 30.0, "completions_per_s": 3.0,
           "trained_tokens_per_s": 90.0, "trainer_idle_fraction": 0.8, "peak_rss_mb": 700.0,
           "heldout_curve": [{"elapsed_s": 0.0, "wall_s": 0.0, "version": 0, "success": 0.25,
                              "label": "baseline"},
                             {"elapsed_s": 100.0, "wall_s": 125.0, "version": 9, "success": 0.4,
                              "label": "final"}]}
    rows = [from_trl_result(trl, "plain"), _result("async", "plain", [(0, 0.25), (110, 0.4)], cps=2.7)]
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"settings": {}, "results": [r.model_dump() for r in rows], "failures": []}))
    assert run.main(["--report-from", str(saved), "--target", "0.35", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    # On TRL's training clock async is slower (2.7 vs 3.0/s, 110 vs 100 s); with TRL's evaluations on
    # its clock it is 2.7 vs 2.4/s and sooner (110 vs 125 s).
    assert "completions/s x0.90" in out and "time to target x1.10 later " in out
    assert "with TRL on its wall clock" in out
    assert "completions/s x1.12" in out
    assert "time to target x1.14 sooner (async's time x0.88 the other's)" in out
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert (written["ratios_trl_wall_clock"]["plain"]["async/trl"]["completions_per_s"]
            == pytest.approx(2.7 / 2.4))
