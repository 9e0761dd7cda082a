"""The base policy: the default model, warm-started by SFT on generated demonstrations, cached.

The cache key is everything that decides the result (model seed and shape, demonstrations, SFT
settings), so a second run with the same config reuses the policy and a changed knob rebuilds it.
Both steps run as child processes (`rlfleet-build-model`, `python -m rlfleet.trainer.sft`), so this
CLI never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from rlfleet.common.config import StrictModel
from rlfleet.common.errors import StartupError
from rlfleet.common.processes import find_binary
from rlfleet.envkit import demos as calc_demos
from rlfleet.envkit import repo_demos
from rlfleet.envkit.corpus import default_corpus, write_corpus
from rlfleet.envkit.demos import write_demos

DEMONSTRATIONS = {"calc": calc_demos.generate_demos, "repo": repo_demos.generate_demos}


class ModelSpec(StrictModel):
    seed: int = Field(0, ge=0, description="seed of the tokenizer corpus and the initial weights")
    hidden_size: int = Field(256, ge=32, description="width of the default Qwen2 model")
    num_hidden_layers: int = Field(4, ge=1, description="layers of the default model")
    family: Literal["qwen2", "qwen3", "llama", "mistral"] = Field(
        "qwen2",
        description="architecture and chat format of the model built here (rlfleet-build-model --family)")
    path: str = Field("", description="an HF causal-LM directory to start from instead of building one (any "
                      "family: its own tokenizer and chat template); warm-started unless "
                      "warm_start.enabled = false")

    def key_fields(self) -> dict:
        """What names the base policy; the fields added after the first cached policies only when set, so
        those stay valid."""
        fields = self.model_dump()
        for name, default in (("family", "qwen2"), ("path", "")):
            if fields[name] == default:
                del fields[name]
        if self.path:
            fields["path"] = str(Path(self.path).resolve())
        return fields


class WarmStartConfig(StrictModel):
    enabled: bool = Field(True, description="SFT the model on demonstrations before RL")
    demonstrations: int = Field(4000, ge=10,
                                description="demonstrations of the run's suite generated for SFT")
    imperfection: float = Field(0.5, ge=0, le=1, description="share of flawed demonstrations (envkit.demos, "
                                "envkit.repo_demos)")
    difficulty: int = Field(1, ge=1, le=3,
                            description="difficulty (calc) or level (repo) of the demonstrations")
    epochs: int = Field(3, ge=1, description="SFT epochs")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate")
    batch_size: int = Field(32, ge=1, description="SFT batch size (sequences)")
    torch_threads: int = Field(2, ge=1, description="torch threads for SFT (nothing else runs then)")


def cache_key(model: ModelSpec, warm: WarmStartConfig, system_prompt: bool, suite: str = "calc") -> str:
    fields = {"model": model.key_fields(), "warm": warm.model_dump(exclude={"torch_threads"}),
              "system_prompt": system_prompt, "format": 1}
    if suite != "calc":  # named only for the suites added later, so calc's cached policies stay valid
        fields["suite"] = suite
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _run(cmd: list[str], log: Path, what: str, threads: int, say=None) -> None:
    """Runs a build step into `log`; with `say`, the step's progress lines (`{"progress": ...}`, the
    SFT's) are told as they come, so a long warm start shows how far it is."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RLFLEET_TORCH_THREADS": str(threads)}
    with open(log, "ab") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   env=env) as child:
        assert child.stdout is not None
        for line in child.stdout:
            out.write(line)
            out.flush()
            if say is not None and line.startswith(b'{"progress"'):
                say(f"base policy: {_progress_line(line)}")
        code = child.wait()
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise StartupError(f"{what} failed (exit {code}): {' | '.join(tail)} (see {log})")


def _progress_line(line: bytes) -> str:
    try:
        record = json.loads(line)["progress"]
        return (f"SFT epoch {record['epoch']}/{record['epochs']}, step {record['step']}/{record['steps']}, "
                f"loss {record['loss']:.3f}, {record['elapsed_s']:.0f} s")
    except (ValueError, KeyError, TypeError):
        return line.decode(errors="replace").strip()


def build_model_command(out: Path, seed: int, suite: str = "calc") -> list[str]:
    """`rlfleet-build-model` for the default model into `out`, with the default tokenizer corpus
    of `suite` (its texts, which the engine package does not know) written beside it."""
    corpus = write_corpus(out.with_name(f"{out.name}.corpus.txt"), default_corpus(seed, suite=suite))
    return [find_binary("rlfleet-build-model"), "--out", str(out), "--seed", str(seed),
            "--corpus", str(corpus)]


def ensure_base_policy(cache_root: Path, model: ModelSpec, warm: WarmStartConfig, system_prompt: bool,
                       say=print, suite: str = "calc") -> Path:
    """Returns the base policy directory, building and warm-starting it once per cache key."""
    key = cache_key(model, warm, system_prompt, suite)
    target = cache_root / f"policy-{key}"
    if (target / "model.safetensors").exists():
        say(f"base policy: cached {target}")
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    building = cache_root / f".building-{key}-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    log = building / "warm-start.log"
    start = time.monotonic()
    initial = building / "initial"
    if model.path:
        source = Path(model.path).resolve()
        if not (source / "config.json").is_file() or not (source / "tokenizer.json").is_file():
            raise StartupError(f"model.path {source} is not a model directory "
                               "(config.json and tokenizer.json)")
        shutil.copytree(source, initial)
        say(f"base policy: starting from {source}")
    else:
        _run([*build_model_command(initial, model.seed, suite), "--hidden-size", str(model.hidden_size),
              "--num-hidden-layers", str(model.num_hidden_layers), "--family", model.family], log,
             "building the default model", warm.torch_threads)
        say(f"base policy: built the initial {model.family} model ({time.monotonic() - start:.0f} s)")
    policy = building / "policy"
    if warm.enabled:
        demos = DEMONSTRATIONS[suite](warm.demonstrations, seed=model.seed, imperfection=warm.imperfection,
                                      difficulty=warm.difficulty)
        if not system_prompt:
            for demo in demos:
                demo["messages"] = [m for m in demo["messages"] if m["role"] != "system"]
        data = building / "demos.jsonl"
        write_demos(demos, data)
        say(f"base policy: SFT warm start on {len(demos)} demonstrations "
            f"({warm.imperfection:.0%} flawed), {warm.epochs} epochs ...")
        _run([sys.executable, "-m", "rlfleet.trainer.sft", "--model-dir", str(initial), "--data", str(data),
              "--out", str(policy), "--epochs", str(warm.epochs), "--lr", str(warm.lr),
              "--batch-size", str(warm.batch_size), "--seed", str(model.seed)],
             log, "the SFT warm start", warm.torch_threads, say=say)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "generation_config.json"):
            if (initial / name).exists() and not (policy / name).exists():
                shutil.copy2(initial / name, policy / name)
    else:
        initial.rename(policy)
    (policy / "rlfleet_warm_start.json").write_text(json.dumps(
        {"key": key, "suite": suite, "model": model.model_dump(), "warm_start": warm.model_dump(),
         "system_prompt": system_prompt, "seconds": round(time.monotonic() - start, 1)}, indent=2))
    shutil.copy2(log, policy / "warm-start.log")
    try:
        policy.rename(target)  # atomic: a concurrent run that finished first wins, ours is dropped
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    shutil.rmtree(building, ignore_errors=True)
    say(f"base policy: ready in {time.monotonic() - start:.0f} s -> {target}")
    return target
