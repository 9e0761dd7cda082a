"""What one save of the run's state costs the driver as the run's record grows, the whole record
encoded at every save (as before `RecordJSON`) against each trajectory, episode and step encoded
once (`RecordJSON`, what the controller does), side by side.

    .venv/bin/python bench/run_state_save.py [--sizes 1000,4000,16000] [--repeats 3]

A RunRecord gets calc-like trajectories, one episode each and a step every 64 (as the vs-TRL loop
records them); at each size the milliseconds of one save's encoding (the best of `--repeats`):
`json.dumps(asdict(record))`, and `RecordJSON.encode` after one new trajectory, its earlier items
encoded by the saves before. The controller saves every 10 s and at every gate decision, on the
event loop its rollout workers run on. Both encodings are checked equal at every size.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from rlfleet.cli.report import EpisodeRecord, RunRecord, StepRecord, TrajectoryRecord
from rlfleet.cli.run_state import RecordJSON


def grow(record: RunRecord, size: int) -> None:
    while len(record.trajectories) < size:
        i = len(record.trajectories)
        record.trajectories.append(TrajectoryRecord(i * 0.01, 40 + i % 30, 12, float(i % 2), bool(i % 2),
                                                    "completed", "train", i // 64, i % 3, 0.002, [0.1, 0.2]))
        record.episodes.append(EpisodeRecord(i * 0.01, bool(i % 2), [] if i % 2 else ["WRONG_ANSWER"],
                                             {"calc": 1}, 0, 0.5, 0.001, 0.0, 0.002, 0.6))
        if i % 64 == 0:
            record.steps.append(StepRecord(i // 64, i // 64, i * 0.01, 0.5,
                                           {"tokens": 3000.0, "loss": 0.01, "reward_mean": 0.5}))


def best_ms(encode, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        encode()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4000,16000", help="trajectories in the record, comma list")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    record = RunRecord("bench", "async", {"run_id": "bench"}, time.time())
    encoder = RecordJSON()
    print(f"{'trajectories':>12} {'whole record ms':>16} {'RecordJSON ms':>14} {'JSON MB':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        grow(record, size)
        whole = best_ms(lambda: json.dumps(asdict(record), default=str), args.repeats)
        encoder.encode(record)  # the saves so far
        times = []
        for _ in range(args.repeats):
            grow(record, len(record.trajectories) + 1)  # one more trajectory since the last save
            times.append(best_ms(lambda: encoder.encode(record), 1))
        text = encoder.encode(record)
        assert text == json.dumps(asdict(record), default=str), "RecordJSON differs from the whole encoding"
        print(f"{size:12d} {whole:16.1f} {min(times):14.2f} {len(text) / 1e6:8.1f}")


if __name__ == "__main__":
    main()
