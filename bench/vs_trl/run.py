"""rlfleet vs TRL's GRPOTrainer: the same model, task, held-out split, GRPO settings and wall budget.

    .venv/bin/python bench/vs_trl/run.py                                  # 2 workloads x 3 systems
    .venv/bin/python bench/vs_trl/run.py --budget-s 60 --workloads plain --systems trl

Systems: `trl` (TRL's GRPOTrainer, its own generation loop and multi-turn tool support, in one
process), `sync` and `async` (`rlfleet run` in each mode). Workloads: `plain` (the calc task) and
`slow` (every tool call sleeps a lognormal draw, median/sigma/cap configurable; inside TRL's tool
function, inside rlfleet's rollout workers). Every run starts from the one cached base policy that
rlfleet's warm start builds (built first if missing, not counted). Each run trains for `--budget-s`
seconds of wall time; TRL's clock stops while it evaluates held-out success (rlfleet's evaluations
run on its own engines and are counted), so the comparison favours TRL there.

Prints a table per system and workload, the ratios rlfleet-async / TRL and rlfleet-async /
rlfleet-sync, and writes `results.json` and `heldout_vs_time.png` to `--out`
(default bench/vs_trl/results/); each run's config, log and run directory go to runs/vs-trl/.
Total time is about (number of runs) x (budget + ~90 s of start-up and evaluations), plus up to
one TRL step past the budget (TRL stops only between steps); `--plan` prints it and runs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    SYSTEMS,
    WORKLOADS,
    Settings,
    SystemResult,
    TrlJob,
    Workload,
    default_target,
    from_rlfleet_summary,
    from_trl_result,
    on_trl_clock,
    plot,
    ratio_lines,
    ratios,
    rlfleet_config,
    table,
    to_toml,
    workloads,
    write_results,
)

STARTUP_ALLOWANCE_S = 90  # platform start, baseline/final evaluations, shutdown, per run (measured roughly)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/vs_trl/run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="training wall budget of each run (default 120)")
    p.add_argument("--workloads", default="plain,slow", help="comma list of plain, slow")
    p.add_argument("--systems", default="trl,sync,async", help="comma list of trl, sync, async")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "vs-trl",
                   help="run directories, generated configs and logs (default runs/vs-trl)")
    p.add_argument("--heldout", type=int, default=100, help="held-out tasks per evaluation (all systems)")
    p.add_argument("--eval-every", type=int, default=5,
                   help="held-out evaluation every N versions (all systems)")
    p.add_argument("--target", type=float, default=None,
                   help="held-out success target (default: mean baseline + --target-gain)")
    p.add_argument("--target-gain", type=float, default=0.10,
                   help="target above the mean baseline (default 0.10)")
    p.add_argument("--latency-median", type=float, default=0.5, help="slow workload: lognormal median, s")
    p.add_argument("--latency-sigma", type=float, default=1.0, help="slow workload: lognormal sigma")
    p.add_argument("--latency-max", type=float, default=20.0, help="slow workload: cap on one draw, s")
    p.add_argument("--trl-threads", type=int, default=2,
                   help="torch threads of the TRL process (default 2: the machine)")
    p.add_argument("--trl-clock", choices=("train", "wall"), default="train",
                   help="TRL's times: train = its clock stops while it evaluates (default, in its favour); "
                        "wall = not")
    p.add_argument("--concurrency", type=int, default=Settings().concurrency,
                   help=f"rlfleet: rollout episodes at once (default {Settings().concurrency})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp32", action="store_true",
                   help="train in fp32 (both systems); default: bf16 autocast for both")
    p.add_argument("--plan", action="store_true",
                   help="print the runs and the expected total time, run nothing")
    p.add_argument("--report-from", type=Path, default=None,
                   help="run nothing: print the table and ratios again from a results.json "
                        "(e.g. with another --target)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen_workloads = _pick(args.workloads, WORKLOADS, "workload")
    chosen_systems = _pick(args.systems, SYSTEMS, "system")
    settings = Settings(seed=args.seed, heldout=args.heldout, eval_every_steps=args.eval_every,
                        budget_s=args.budget_s, concurrency=args.concurrency, bf16=not args.fp32)
    loads = workloads(args.latency_median, args.latency_sigma, args.latency_max)
    runs = [(loads[w], s) for w in chosen_workloads for s in chosen_systems]
    estimate = len(runs) * (args.budget_s + STARTUP_ALLOWANCE_S)
    precision = "bf16 autocast" if settings.bf16 else "fp32"
    print(f"vs TRL: {len(runs)} runs x {args.budget_s:.0f} s budget, about {estimate / 60:.0f} min in all "
          f"(plus the warm start if it is not cached); training in {precision}")
    for workload, system in runs:
        print(f"  {workload.name:6s} {system:6s} {workload.describe()}")
    if args.plan:
        return 0
    if args.report_from is not None:
        saved = json.loads(args.report_from.read_text())
        results = [SystemResult.model_validate({k: v for k, v in r.items()
                                                if k not in ("baseline", "final", "best")})
                   for r in saved["results"]]
        report(results, Settings.model_validate(saved["settings"]), loads, args, args.out.resolve(),
               saved.get("failures", []))
        return 0
    if "trl" in chosen_systems and importlib.util.find_spec("trl") is None:
        print("SKIP trl: TRL is not installed (a benchmark-only dependency): "
              ".venv/bin/pip install -r requirements/bench.txt -c requirements/lock.txt", file=sys.stderr)
        chosen_systems = [s for s in chosen_systems if s != "trl"]
        runs = [(w, s) for w, s in runs if s != "trl"]
        if not runs:
            return 0

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = REPO / "runs" / ".cache"
    work_root = args.work_dir.resolve()  # run directories, configs and logs (weights: not for git)
    policy = base_policy(cache)
    results: list[SystemResult] = []
    failures: list[str] = []
    for workload, system in runs:
        print(f"\n== {workload.name} / {system} ==", flush=True)
        started = time.monotonic()
        try:
            if system == "trl":
                result = run_trl(settings, workload, policy, work_root, args.trl_threads, args.trl_clock)
            else:
                result = run_rlfleet(settings, workload, system, work_root, cache)
        except (RuntimeError, KeyError, OSError, subprocess.SubprocessError) as exc:
            failures.append(f"{workload.name}/{system}: {exc}")
            print(f"FAILED {workload.name}/{system}: {exc}", flush=True)
            continue
        print(f"   done in {time.monotonic() - started:.0f} s", flush=True)
        results.append(result)
    if not results:
        print("no run finished", file=sys.stderr)
        return 1
    report(results, settings, loads, args, out, failures)
    return 1 if failures else 0


def _pick(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"unknown {what} {unknown or text!r}; choose from {', '.join(allowed)}")
    return names


def base_policy(cache: Path) -> Path:
    """The base policy every run starts from: rlfleet's warm start with examples/calc.toml's model and
    warm-start settings (the defaults), built once and cached under runs/.cache."""
    from rlfleet.cli.warm_start import ModelSpec, WarmStartConfig, ensure_base_policy

    return ensure_base_policy(cache, ModelSpec(), WarmStartConfig(), False,
                              say=lambda t: print(t, flush=True))


# ---------------------------------------------------------------------------------------------


def run_trl(settings: Settings, workload: Workload, policy: Path, work_root: Path, threads: int,
            clock: str = "train") -> SystemResult:
    work = work_root / f"{workload.name}-trl"
    work.mkdir(parents=True, exist_ok=True)
    job = TrlJob(settings=settings, tool_latency=workload.tool_latency(), policy_dir=str(policy),
                 work_dir=work, torch_threads=threads)
    (work / "job.json").write_text(job.model_dump_json(indent=2))
    result_path = work / "result.json"
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    code = _child([sys.executable, str(HERE / "trl_grpo.py"), "--settings", str(work / "job.json"),
                   "--out", str(result_path)], work / "trl.log", env, settings.budget_s)
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"TRL exited with {code}; see {work / 'trl.log'}")
    return from_trl_result(json.loads(result_path.read_text()), workload.name, clock)


def run_rlfleet(settings: Settings, workload: Workload, mode: str, work_root: Path, cache: Path,
                rlfleet: str | None = None) -> SystemResult:
    """`rlfleet run` on a generated config; the result is read from the run's summary.json."""
    run_id = f"vs-trl-{workload.name}-{mode}"
    run_dir = work_root / f"{workload.name}-{mode}"
    config = rlfleet_config(settings, workload, mode, run_id, run_dir, cache)
    cfg = work_root / f"{run_id}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(to_toml(config))
    summary_path = run_dir / "summary.json"
    summary_path.unlink(missing_ok=True)
    log = work_root / f"{run_id}.log"
    command = [rlfleet or str(Path(sys.executable).parent / "rlfleet"), "run", str(cfg)]
    code = _child(command, log, dict(os.environ), settings.budget_s)
    if code != 0 or not summary_path.exists():
        raise RuntimeError(f"rlfleet run exited with {code}; see {log}")
    return from_rlfleet_summary(json.loads(summary_path.read_text()), mode, workload.name)


def _child(cmd: list[str], log: Path, env: dict, budget_s: float) -> int:
    """Runs one system, its output to `log` with our progress lines echoed; stopped (by its PID, with
    SIGINT then SIGKILL) if it overruns its budget by a wide margin."""
    deadline = time.monotonic() + budget_s + 600
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, text=True, bufsize=1)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sink.write(line)
                if _interesting(line):
                    print("   " + line.rstrip(), flush=True)
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, budget_s + 600)
            return proc.wait()
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.send_signal(2)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


def _interesting(line: str) -> bool:
    return line.startswith(("[trl", "base policy", "baseline:", "gate:", "final:", "run ", "loop:",
                            "platform:")) \
        or ("held-out" in line and line.startswith("["))


# ---------------------------------------------------------------------------------------------


def report(results: list[SystemResult], settings: Settings, loads: dict[str, Workload], args, out: Path,
           failures: list[str]) -> None:
    target = args.target if args.target is not None else default_target(results, args.target_gain)
    rat = ratios(results, target)
    print(f"\nheld-out target success {target:.3f} "
          f"({'given' if args.target is not None else f'mean baseline + {args.target_gain:g}'}); "
          f"budget {settings.budget_s:.0f} s per run; "
          f"{settings.heldout} held-out tasks every {settings.eval_every_steps} versions")
    print(table(results, target))
    other_clock = "wall" if args.trl_clock == "train" else "train"
    rat_other = ratios(on_trl_clock(results, other_clock), target)
    if rat:
        print(f"\nratios (rlfleet async / other; TRL on its {args.trl_clock} clock):")
        print(ratio_lines(rat))
        why = ("its evaluations included, as rlfleet's are" if other_clock == "wall"
               else "its evaluations excluded")
        print(f"with TRL on its {other_clock} clock ({why}):")
        print(ratio_lines({w: {k: v for k, v in rows.items() if k == "async/trl"}
                           for w, rows in rat_other.items()}))
    for r in results:
        for note in r.notes:
            print(f"note: {r.workload}/{r.system}: {note}")
    for failure in failures:
        print(f"FAILED: {failure}")
    payload = {
        "created_unix": time.time(), "settings": settings.model_dump(), "target": target,
        "workloads": {name: w.model_dump() | {"describe": w.describe()} for name, w in loads.items()},
        "results": [r.model_dump() | {"baseline": r.baseline, "final": r.final, "best": r.best}
                    for r in results],
        "trl_clock": args.trl_clock, "ratios": rat, f"ratios_trl_{other_clock}_clock": rat_other,
        "failures": failures,
    }
    write_results(out / "results.json", payload)
    png = plot(results, target, out / "heldout_vs_time.png")
    print(f"\nresults: {out / 'results.json'}  plot: {png}")


if __name__ == "__main__":
    raise SystemExit(main())
