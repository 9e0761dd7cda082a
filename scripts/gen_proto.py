"""Generates the Python API from proto/ into libs/common/src/rlfleet/api (the one generated package).

protoc names a module after its proto path (`rlfleet/session/v1/session.proto` ->
`rlfleet.session.v1.session_pb2`), which would collide with the services' own `rlfleet.session`
packages, so the output is moved under `rlfleet.api` and its imports are rewritten to match.
The descriptors keep their proto names; only the Python module paths change.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 when regenerating would change anything
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "libs/common/src/rlfleet/api"
DOMAINS_IMPORT = re.compile(r"^(from|import) rlfleet\.(\w+)\.v1", re.MULTILINE)


def generate(dest: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={raw}",
                f"--pyi_out={raw}", f"--grpc_python_out={raw}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for src in sorted(Path(raw, "rlfleet").rglob("*.py*")):
            rel = src.relative_to(Path(raw, "rlfleet"))
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            text = DOMAINS_IMPORT.sub(r"\1 rlfleet.api.\2.v1", src.read_text())
            target.write_text(text)
    for directory in [dest, *(p for p in dest.rglob("*") if p.is_dir())]:
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("" if directory != dest
                            else '"""Generated from proto/ by scripts/gen_proto.py. Do not edit."""\n')


def tree_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def differences(a: Path, b: Path) -> list[str]:
    files_a, files_b = tree_files(a), tree_files(b)
    diff = sorted(files_a ^ files_b)
    diff += [f for f in sorted(files_a & files_b) if not filecmp.cmp(a / f, b / f, shallow=False)]
    return diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed code, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "api"
        fresh.mkdir()
        generate(fresh)
        changed = differences(fresh, OUT_DIR) if OUT_DIR.exists() else ["(missing)"]
        if args.check:
            if changed:
                print("generated API is out of date with proto/ (run `make proto`): " + ", ".join(changed))
                return 1
            print("generated API matches proto/")
            return 0
        if OUT_DIR.exists():
            shutil.rmtree(OUT_DIR)
        shutil.copytree(fresh, OUT_DIR)
        print(f"generated {len(tree_files(OUT_DIR))} files into {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
