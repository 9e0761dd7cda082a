"""Weight-delta bench: how big and how fast bf16 deltas are on a real training run.

Trains a tiny Qwen2 (and a ~100M one) with AdamW on random tokens at several
learning rates; after every step the trainer publishes the version to a
DirectoryWeightStore (encoding=auto, delta against the previously *served*
bf16 bytes) and an engine holding the previous version swaps it in place.
Per step it prints the full checkpoint size, the xor / overwrite delta sizes,
the share of bf16 values that changed, and the times of encode, fetch
(read + decompress + decode, before the pause), preverify (before the pause),
swap (the pause) and a full reload (read + copy) for comparison. Last, which
encoding wins per tensor by change density.

    .venv/bin/python bench/weight_delta.py            # small model x 5 steps, 100M x 2 steps (~3-4 min)
    .venv/bin/python bench/weight_delta.py --quick    # small model x 2 steps (~20 s)
    .venv/bin/python bench/weight_delta.py --lora     # LoRA adapter vs bf16 delta, default model (~1 min)

`--lora`: the trainer's own torch backend on the default CPU-engine model (ModelSpec's sizes), GRPO
steps on the same random groups, once fully fine-tuned and once as a rank-8 LoRA on all seven
projections; after every step the full run writes a bf16 delta and the LoRA run an adapter version
to a DirectoryWeightStore, with the previous version as its parent as the trainer does (so a delta
of the previous adapter, in the encoding full deltas use). Per step: the bytes each update ships
(the store's manifest `bytes`): the full delta, the adapter written whole (what shipped before
adapter deltas) and the adapter as stored.

The full reload reads the just-written file from the page cache straight into
an engine's buffers, unverified: the best case for a full reload, so the
swap/full ratios are conservative.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

MODELS = {
    # the default-ish CPU engine model
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    # ~100M parameters (tied 32000x768 embedding + 12 layers)
    "100M": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}
LRS = (1e-6, 1e-5, 1e-4)
DENSITY_BUCKETS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.15, 0.4, 0.7, 1.0001)


@dataclass
class Row:
    model: str
    params_m: float
    lr: float
    step: int
    kind: str
    full_mb: float
    xor_kb: float
    overwrite_kb: float
    stored_kb: float  # what the store wrote (auto: smaller per tensor)
    stored_pct_of_full: float
    changed_pct: float
    encode_xor_s: float
    encode_overwrite_s: float
    write_s: float  # store.write_version: cast, encode (auto = both), hash, write, fsync
    fetch_s: float
    preverify_s: float
    swap_s: float  # apply after preverify: the pause
    swap_verify_s: float  # apply + hash of written tensors, without preverify
    full_reload_s: float  # load_full(verify=False) read straight into an engine's tensors, page cache warm
    cold_reload_s: float  # the same after evicting the file from the page cache
    swap_vs_full: float
    swap_vs_cold: float


def drop_page_cache(path: Path) -> None:
    """Evict a file's (fsynced, clean) pages from the page cache; no root needed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def codec_sizes(prev, cur, density_log):
    """Total size and encode time of each encoding over all tensors (sequential),
    and per changed tensor the size of every candidate, for the density table."""
    from rlfleet.weights.codec import candidates, encode_tensor
    from rlfleet.weights.tensors import uint_view

    totals = {}
    for enc in ("xor", "overwrite"):
        size, t0 = 0, time.perf_counter()
        for name in cur:
            size += encode_tensor(uint_view(prev[name]), uint_view(cur[name]), enc).compressed_bytes
        totals[enc] = (size, time.perf_counter() - t0)
    for name in cur:
        cands = candidates(uint_view(prev[name]), uint_view(cur[name]), "auto")
        if cands[0].changed:
            entry = {f"{c.encoding}-{c.layout}": c.compressed_bytes for c in cands}
            entry["density"] = cands[0].changed / cands[0].numel
            density_log.append(entry)
    return totals


def run_model(name: str, steps: int, lrs, workdir: Path, density_log: list) -> list[Row]:
    import torch
    import transformers

    from rlfleet.weights import DirectoryWeightStore, apply_delta, preverify_delta, to_served

    rows = []
    for lr in lrs:
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            tie_word_embeddings=True, max_position_embeddings=256, **MODELS[name]
        )
        model = transformers.Qwen2ForCausalLM(config)
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        store = DirectoryWeightStore(
            workdir / f"{name}-{lr:g}", "bench", full_every=1000, max_delta_fraction=10.0
        )
        store.write_version(0, model.state_dict())
        engine = store.load_full(0)  # an engine holding v0 (numpy byte views)
        engine_checked = engine.copy()  # a second engine that verifies inside the pause
        reload_target = engine.copy()  # a third that does full reloads
        prev = to_served(model.state_dict())
        seq = 64 if name == "small" else 32
        for step in range(1, steps + 1):
            ids = torch.randint(0, config.vocab_size, (4, seq))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            cur = to_served(model.state_dict())
            sizes = codec_sizes(prev, cur, density_log)
            manifest, write_s = timed(store.write_version, step, model.state_dict())
            decoded, fetch_s = timed(store.fetch_delta, step)
            _, preverify_s = timed(preverify_delta, engine, decoded, workers=store.config.workers)
            res, swap_s = timed(apply_delta, engine, decoded, current_version=step - 1)
            assert res.verified == "preverified"
            # The preverified swap is idempotent (new values, not xor masks): the
            # machine is shared, so take the best of three, as for the reload.
            swap_s = min([swap_s] + [timed(apply_delta, engine, decoded)[1] for _ in range(2)])
            _, swap_verify_s = timed(
                apply_delta,
                engine_checked,
                store.fetch_delta(step),
                current_version=step - 1,
                verify="written",
            )
            # The cheapest full reload: the file read straight into an engine's
            # (already faulted-in) buffers, no checksum.
            full_reload_s = min(
                timed(store.load_full, 0, verify=False, into=reload_target)[1] for _ in range(3)
            )
            drop_page_cache(store.path(0) / "model.safetensors")
            _, cold_reload_s = timed(store.load_full, 0, verify=False, into=reload_target)
            full_bytes = manifest["full_bytes"]
            rows.append(
                Row(
                    model=name,
                    params_m=round(params_m, 1),
                    lr=lr,
                    step=step,
                    kind=manifest["kind"],
                    full_mb=full_bytes / 1e6,
                    xor_kb=sizes["xor"][0] / 1e3,
                    overwrite_kb=sizes["overwrite"][0] / 1e3,
                    stored_kb=manifest["bytes"] / 1e3,
                    stored_pct_of_full=100 * manifest["bytes"] / full_bytes,
                    changed_pct=100 * manifest["changed_values"] / manifest["total_values"],
                    encode_xor_s=sizes["xor"][1],
                    encode_overwrite_s=sizes["overwrite"][1],
                    write_s=write_s,
                    fetch_s=fetch_s,
                    preverify_s=preverify_s,
                    swap_s=swap_s,
                    swap_verify_s=swap_verify_s,
                    full_reload_s=full_reload_s,
                    cold_reload_s=cold_reload_s,
                    swap_vs_full=swap_s / full_reload_s,
                    swap_vs_cold=swap_s / cold_reload_s,
                )
            )
            print_row(rows[-1])
            prev = cur
        # The engines ended exactly where the trainer is.
        final = to_served(model.state_dict())
        assert all(engine[k].tobytes() == final[k].tobytes() == engine_checked[k].tobytes() for k in final)
        del model, opt, engine, engine_checked, reload_target, prev, store
    return rows


HEADER = (
    f"{'model':>5} {'lr':>6} {'st':>2} {'full MB':>7} {'xor KB':>8} {'ovw KB':>8} "
    f"{'stored KB':>9} {'%full':>6} "
    f"{'chg%':>6} | {'enc xor':>7} {'enc ovw':>7} {'write':>6} | {'fetch':>6} {'prever':>6} | {'swap':>6} "
    f"{'swap+v':>6} | {'reload':>6} {'cold':>6} | {'swap/reload':>11} {'swap/cold':>9}"
)


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:6.1f}"


def print_row(r: Row) -> None:
    print(
        f"{r.model:>5} {r.lr:>6.0e} {r.step:>2} {r.full_mb:>7.1f} {r.xor_kb:>8.0f} {r.overwrite_kb:>8.0f} "
        f"{r.stored_kb:>9.0f} {r.stored_pct_of_full:>5.1f}% {r.changed_pct:>5.1f}% | {ms(r.encode_xor_s):>7} "
        f"{ms(r.encode_overwrite_s):>7} {ms(r.write_s)} | {ms(r.fetch_s)} "
        f"{ms(r.preverify_s)} | {ms(r.swap_s)} "
        f"{ms(r.swap_verify_s)} | {ms(r.full_reload_s)} {ms(r.cold_reload_s)} | {r.swap_vs_full:>11.2f} "
        f"{r.swap_vs_cold:>9.3f}",
        flush=True,
    )


def print_crossover(density_log: list) -> None:
    """Per changed tensor: which candidate is smallest, by its change density."""
    kinds = ("xor-dense", "xor-sparse", "overwrite-sparse")
    print(
        "\nsmallest encoding per tensor, by share of its bf16 values changed (bytes relative to xor-dense):"
    )
    print(
        f"{'density':>13} {'tensors':>7} "
        + " ".join(f"{k + ' wins':>21}" for k in kinds)
        + " "
        + " ".join(f"{k:>16}" for k in kinds)
    )
    for lo, hi in itertools.pairwise(DENSITY_BUCKETS):
        bucket = [d for d in density_log if lo <= d["density"] < hi]
        if not bucket:
            continue
        wins = {k: sum(min(kinds, key=lambda k2: d[k2]) == k for d in bucket) for k in kinds}
        total = {k: sum(d[k] for d in bucket) for k in kinds}
        print(
            f"{lo:>6.0%}-{min(hi, 1):<6.0%} {len(bucket):>7} "
            + " ".join(f"{wins[k]:>21}" for k in kinds)
            + " "
            + " ".join(f"{total[k] / total['xor-dense']:>16.2f}" for k in kinds)
        )


# The default CPU-engine model (rlfleet.engine.build_model.ModelSpec), as the trainer builds it.
DEFAULT_MODEL = dict(model_type="qwen2", vocab_size=768, hidden_size=256, intermediate_size=704,
                     num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LORA_LRS = ((5e-5, 5e-4), (1e-6, 1e-5))  # (full, LoRA): calc.toml vs calc-lora.toml; a 50x smaller step


def run_lora(steps: int, workdir: Path, model: str = "default", lrs=LORA_LRS, rank: int = 8) -> None:
    from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
    from rlfleet.trainer.objectives import rl_step
    from rlfleet.trainer.testing import make_samples
    from rlfleet.trainer.torch_backend import TorchBackend
    from rlfleet.weights import DirectoryWeightStore

    spec = DEFAULT_MODEL if model == "default" else {**DEFAULT_MODEL, **MODELS[model],
                                                     "max_position_embeddings": 256}
    print(f"model {model}, LoRA rank {rank} (alpha {2 * rank}) on all seven projections")
    print(f"{'full lr':>8} {'lora lr':>8} {'st':>2} {'model MB':>8} {'delta KB':>9} "
          f"{'chg%':>6} {'whole KB':>9} "
          f"{'whole/delta':>11} {'adapter KB':>10} {'adapter/delta':>13} {'adapter chg%':>12}")
    step_cfg = (LossConfig(), BatchConfig(pack_length=256, micro_batch_rows=4))
    for full_lr, lora_lr in lrs:
        runs = {}
        for name, lr, lora in (("full", full_lr, {}), ("lora", lora_lr, {"enabled": True, "rank": rank,
                                                                           "alpha": 2.0 * rank})):
            backend = TorchBackend(TorchBackendConfig(model_config_dict=spec, seed=0, lora=lora,
                                                      optim={"lr": lr}, batch={"pack_length": 256}))
            store = DirectoryWeightStore(workdir / f"{name}-{full_lr:g}-{lora_lr:g}", "bench",
                                         full_every=1000, max_delta_fraction=10.0)
            base = backend.base_state_for_export() if lora else backend.state_dict_for_export()
            store.write_version(0, base)
            runs[name] = (backend, store)
            if lora:  # the same adapters written whole (no parent): what each update shipped before deltas
                whole = DirectoryWeightStore(workdir / f"whole-{full_lr:g}-{lora_lr:g}", "bench")
                whole.write_version(0, base)
        for step in range(1, steps + 1):
            samples = make_samples(4, 8, lengths=(64, 128), vocab_size=spec["vocab_size"], seed=step)
            manifests = {}
            for name, (backend, store) in runs.items():
                rl_step(backend, samples, *step_cfg)
                if name == "full":
                    manifests[name] = store.write_version(step, backend.state_dict_for_export())
                else:
                    tensors, config = backend.adapter_for_export()
                    # As the trainer publishes: the parent is the previous version (the base for the first).
                    manifests[name] = store.write_adapter(step, tensors, config, base_version=0,
                                                          parent_version=step - 1)
                    manifests["whole"] = whole.write_adapter(step, tensors, config, base_version=0)
            delta, adapter, plain = manifests["full"], manifests["lora"], manifests["whole"]
            changed = 100 * delta["changed_values"] / delta["total_values"]
            index = runs["lora"][1].index(step)
            adapter_changed = ("-" if index.changed_values is None
                               else f"{index.changed_values / index.total_values:.1%}")
            print(f"{full_lr:>8.0e} {lora_lr:>8.0e} {step:>2} {delta['full_bytes'] / 1e6:>8.2f} "
                  f"{delta['bytes'] / 1e3:>9.1f} {changed:>5.1f}% {plain['bytes'] / 1e3:>9.1f} "
                  f"{plain['bytes'] / delta['bytes']:>10.1%} {adapter['bytes'] / 1e3:>10.1f} "
                  f"{adapter['bytes'] / delta['bytes']:>12.1%} {adapter_changed:>12}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model only, 2 steps per learning rate")
    ap.add_argument("--json", type=Path, help="also write the rows to this file")
    ap.add_argument("--lora", action="store_true", help="only the LoRA adapter vs bf16 delta rows")
    ap.add_argument("--lora-steps", type=int, default=3)
    shipped = tomllib.loads((Path(__file__).resolve().parents[1] / "examples" / "calc-lora.toml").read_text())
    ap.add_argument("--lora-rank", type=int, default=shipped["trainer"]["lora"]["rank"],
                    help="--lora: the adapter's rank (alpha = 2 x rank; default: examples/calc-lora.toml's)")
    ap.add_argument("--lora-model", choices=["default", *MODELS], default="default",
                    help="--lora: the default CPU-engine model, "
                         "or one of this bench's (100M: calc.toml's lrs only)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # the bench machine's cores are shared
    if args.lora:
        with tempfile.TemporaryDirectory(prefix="weight-delta-bench-") as tmp:
            run_lora(args.lora_steps, Path(tmp), args.lora_model,
                     LORA_LRS if args.lora_model == "default" else LORA_LRS[:1], args.lora_rank)
        return
    plan = [("small", 2)] if args.quick else [("small", 5), ("100M", 2)]
    rows: list[Row] = []
    density_log: list = []
    t0 = time.perf_counter()
    print(HEADER)
    with tempfile.TemporaryDirectory(prefix="weight-delta-bench-") as tmp:
        for name, steps in plan:
            rows += run_model(name, steps, LRS, Path(tmp), density_log)
    print_crossover(density_log)
    print(
        f"\ntotal {time.perf_counter() - t0:.0f} s. Times in ms. fetch, prever: "
        "before the pause. swap: the pause "
        "after a preverify (best of 3); swap+v: the pause without one (apply, then hash what it wrote); "
        "reload: full checkpoint read into the engine's buffers (best of 3, page cache warm); cold: the same "
        "after evicting the file from the page cache."
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
