"""Rewrites the megatron-bridge 0.3.1 wheel's declared dependencies to what rlfleet's trainer uses.

    python scripts/megatron_bridge_wheel.py DOWNLOADED.whl OUT_DIR   # prints the new wheel's path

Why: megatron-bridge declares the dependencies of its whole training stack — transformers < 5
(rlfleet locks 5.24.0, with which the Qwen2/Qwen3/Llama conversion works: see the trainer's tests),
transformer-engine (CUDA-only builds), and recipe, logging and multimodal packages (wandb, mlflow,
hydra, timm, open-clip, mamba-ssm, nvidia-resiliency-ext, ...) that the HF <-> Megatron conversion
never imports. Installed with `--no-deps` as it is, `pip check` reports every one of them. The
wheel's code is installed byte for byte; only METADATA changes: its Requires-Dist list becomes
`REQUIRES` below, and its version gets the local label `+rlfleet` so that `pip list` says the
metadata is not the upstream one. The input must be the upstream wheel (its sha256 is checked).
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

NAME, VERSION, LOCAL = "megatron_bridge", "0.3.1", "0.3.1+rlfleet"
UPSTREAM_SHA256 = "4d9a9ad679bd927a84f923e5239512d72af7fa47331b749a8f275592c2920616"
# What the conversion path imports (checked by the trainer's megatron tests importing it).
REQUIRES = ("torch", "transformers", "megatron-core==0.16.1", "omegaconf", "einops", "pyyaml", "tqdm",
            "regex", "rich", "typing-extensions")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _metadata(text: str) -> str:
    head, _, body = text.partition("\n\n")
    lines = [line for line in head.splitlines() if not line.startswith("Requires-Dist:")]
    lines = [f"Version: {LOCAL}" if line.startswith("Version:") else line for line in lines]
    lines += [f"Requires-Dist: {r}" for r in REQUIRES]
    return "\n".join(lines) + "\n\n" + body


def rewrite(wheel: Path, out_dir: Path) -> Path:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != UPSTREAM_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest} is not megatron-bridge {VERSION}'s ({UPSTREAM_SHA256})")
    old_info, new_info = f"{NAME}-{VERSION}.dist-info", f"{NAME}-{LOCAL}.dist-info"
    out = out_dir / f"{NAME}-{LOCAL}-py3-none-any.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            name = item.filename.replace(old_info, new_info, 1)
            if name == f"{new_info}/RECORD":
                continue
            data = src.read(item)
            if name == f"{new_info}/METADATA":
                data = _metadata(data.decode()).encode()
            dst.writestr(name, data)
            records.append(f"{name},{_record_hash(data)},{len(data)}")
        records.append(f"{new_info}/RECORD,,")
        dst.writestr(f"{new_info}/RECORD", "\n".join(records) + "\n")
    return out


if __name__ == "__main__":
    print(rewrite(Path(sys.argv[1]), Path(sys.argv[2])))
