"""Writes rlfleet's contract with SGLang from SGLang's own package: `contracts/sglang-<version>.json`.

    python scripts/sglang_contract.py                  # installs into a throwaway venv, writes the snapshot
    python scripts/sglang_contract.py --venv DIR       # reuse (or create) that venv
    python scripts/sglang_contract.py --version 0.5.24 # a new release: regenerate one file,
                                                       # run tests/contract

SGLang's wheel pins a CUDA torch and CUDA kernels, so it cannot be installed as a dependency; it is
installed with `--no-deps` into a throwaway venv beside the pure-Python packages its HTTP server and
`io_struct` need to import on a CPU (../shared/reference/real-libraries.md). The script then runs itself
inside that venv (`--inside`) and records:

- `routes`: every HTTP route of `sglang.srt.entrypoints.http_server.app` with its methods, and the
  request type its OpenAPI schema names, when it names one;
- `structs`: the fields (name, type, default) of the `io_struct` request and response types rlfleet uses;
- `load_formats`: SGLang's `LoadFormat` values (what `update_weights_from_disk` accepts);
- `meta_info_keys`: the `meta_info` keys SGLang's tokenizer manager writes into a /generate reply;
- `model_info_keys`: the keys of the `/model_info` reply;
- `bodies`: each request body rlfleet sends (built by rlfleet.common.engine_requests, the module the
  engine client builds them with) and whether `msgspec.convert` turned it into SGLang's own struct.

`tests/contract/` then checks, without SGLang installed, that every route and field rlfleet uses is
in the snapshot and that every body converted. A body that fails to convert fails this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VERSION = "0.5.23"
# The pure-Python packages `io_struct` and `http_server` import (real-libraries.md), with torch held at
# the project's CPU build: anything that lets pip choose torch pulls a multi-GB CUDA build.
NEEDS = [
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "starlette", "msgspec", "pydantic",
    "pyzmq", "tqdm", "IPython", "aiohttp", "transformers==5.24.0", "dill", "apache-tvm-ffi==0.1.11",
    "sentencepiece", "compressed-tensors", "gguf", "openai", "partial_json_parser", "triton",
    "uvicorn", "uvloop", "fastapi", "setproctitle", "einops", "jsonschema", "xgrammar", "soundfile",
    "python-multipart", "pillow",
]
# io_struct types whose fields rlfleet reads or writes (request bodies it sends, replies it parses).
STRUCTS = [
    "GenerateReqInput",
    "AbortReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightFromDiskReqOutput",
    "InitWeightsUpdateGroupReqInput",
    "InitWeightsUpdateGroupReqOutput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromDistributedReqOutput",
    "DestroyWeightsUpdateGroupReqInput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightsFromTensorReqOutput",
    "UpdateWeightVersionReqInput",
    "GetWeightsByNameReqInput",
    "GetLoadReqOutput",
    "GetLoadsReqInput",
    "GetLoadsReqOutput",
    "LoadLoRAAdapterReqInput",
    "UnloadLoRAAdapterReqInput",
    "LoRAUpdateOutput",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=DEFAULT_VERSION)
    parser.add_argument("--venv", type=Path, help="venv to install into (default: a throwaway one)")
    parser.add_argument("--out", type=Path, help="default: contracts/sglang-<version>.json")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or ROOT / "contracts" / f"sglang-{args.version}.json"
    if args.inside:
        return write_snapshot(args.version, out)
    if args.venv is None:
        with tempfile.TemporaryDirectory(prefix="sglang-contract-") as tmp:
            return run_in_venv(Path(tmp) / "venv", args.version, out)
    return run_in_venv(args.venv, args.version, out)


def run_in_venv(venv: Path, version: str, out: Path) -> int:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("torch==2.13.0\n")
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "--no-deps", f"sglang=={version}"], check=True)
    subprocess.run([*pip, "-c", constraints.name, *NEEDS], check=True)
    os.unlink(constraints.name)
    return subprocess.run([str(python), __file__, "--inside", "--version", version, "--out",
                           str(out)]).returncode


# --- inside the venv ------------------------------------------------------------------------------
def _import_sglang():
    import transformers.utils.import_utils  # noqa: F401  -- decides torchvision is unavailable first

    # torchvision's wheel is CUDA-linked and fails to import on a CPU torch; SGLang imports it (and
    # names from it) only for multimodal processors, which the contract never runs: every
    # `torchvision.*` module is a stand-in whose every attribute is a placeholder class.
    sys.meta_path.insert(0, _StandIn("torchvision"))
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers import io_struct

    return http_server, io_struct


class _StandIn:
    """A meta-path finder that makes `<root>` and every `<root>.x.y` an empty, permissive module."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != self.root and not name.startswith(self.root + "."):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so submodules import
        module.__version__ = "0.0+stand-in"

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


def _fields(cls) -> dict[str, dict[str, str]]:
    import dataclasses

    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        info = msgspec.structs.fields(cls)
        return {f.name: {"type": _type_name(f.type), "required": f.required} for f in info}
    if dataclasses.is_dataclass(cls):
        return {
            f.name: {
                "type": _type_name(f.type),
                "required": f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            }
            for f in dataclasses.fields(cls)
        }
    raise TypeError(f"{cls!r} is neither a msgspec Struct nor a dataclass")


def _type_name(tp) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", None) if isinstance(tp, type) else repr(tp)
    text = re.sub(r"\b(typing|sglang\.srt\.[\w.]+)\.", "", str(text))
    return re.sub(r" object at 0x[0-9a-f]+", "", text)  # an address would change the snapshot every run


def _meta_info_keys(source: str) -> list[str]:
    keys = set(re.findall(r"meta_info\[\s*[\"'](\w+)[\"']\s*\]", source))
    keys |= set(re.findall(r"meta_info\.setdefault\(\s*[\"'](\w+)[\"']", source))
    for block in re.findall(r"meta_info\.update\(\s*\{(.*?)\}\s*\)", source, flags=re.S):
        keys |= set(re.findall(r"[\"'](\w+)[\"']\s*:", block))
    for block in re.findall(r"meta_info\s*(?::[^=]+)?=\s*\{(.*?)\n\s*\}", source, flags=re.S):
        keys |= set(re.findall(r"^\s*[\"'](\w+)[\"']\s*:", block, flags=re.M))
    return sorted(keys)


def _walk(routes, prefix: str = ""):
    """(path, route) for every route, through included routers: FastAPI 0.16x keeps an included
    router as one `_IncludedRouter` entry of `app.routes` (e.g. SGLang's `/v1/loads`)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            context = getattr(route, "include_context", None)
            yield from _walk(inner.routes, prefix + (getattr(context, "prefix", "") or ""))
        elif getattr(route, "path", None) is not None:
            yield prefix + route.path, route


def _convert(body: dict, cls, fields: dict) -> str | None:
    """None when SGLang would take `body` as `cls` with every field kept; else why not.

    `msgspec.convert` checks the field types. SGLang's BaseReq structs are `array_like` (their IPC
    form), so over HTTP FastAPI validates the JSON object against the fields (pydantic, through
    SGLang's own core schema) and builds the struct with `cls(**body)`: both are tried, and a key
    the struct does not have is an error too, because SGLang drops unknown fields silently.
    """
    import msgspec
    import pydantic

    unknown = sorted(set(body) - set(fields))
    if unknown:
        return f"fields SGLang would drop: {unknown}"
    if cls.__name__ == "GenerateReqInput":  # its sampling_params become SGLang's SamplingParams
        from sglang.srt.sampling.sampling_params import SamplingParams

        for params in (body["sampling_params"] if isinstance(body["sampling_params"], list)
                       else [body["sampling_params"]]):
            try:
                SamplingParams(**params)
            except TypeError as exc:
                return f"sampling_params: {exc}"
    try:
        if getattr(cls, "__struct_config__", None) is not None and cls.__struct_config__.array_like:
            msgspec.convert(body, msgspec.defstruct(cls.__name__, [
                (f.name, f.type, f.default if f.default is not msgspec.NODEFAULT else msgspec.field(
                    default_factory=f.default_factory) if f.default_factory is not msgspec.NODEFAULT
                 else msgspec.NODEFAULT)
                for f in msgspec.structs.fields(cls)], kw_only=True))
            pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
        else:  # GenerateReqInput is a dataclass with pydantic validators: FastAPI's path is the check
            pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
    except Exception as exc:  # msgspec.ValidationError, pydantic.ValidationError, TypeError
        return f"{type(exc).__name__}: {exc}"
    return None


def _load_engine_requests():
    path = ROOT / "libs" / "common" / "src" / "rlfleet" / "common" / "engine_requests.py"
    spec = importlib.util.spec_from_file_location("rlfleet_engine_requests", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # stdlib only, by design: it runs here without rlfleet installed
    return module


def write_snapshot(version: str, out: Path) -> int:

    import warnings

    import sglang

    # FastAPI's duplicate-operation-id warnings for SGLang's GET|POST routes
    warnings.filterwarnings("ignore")
    http_server, io_struct = _import_sglang()
    assert sglang.__version__ == version, (sglang.__version__, version)
    app = http_server.app
    openapi = app.openapi()
    routes: dict[str, dict] = {}
    for path, route in _walk(app.routes):
        methods = sorted(getattr(route, "methods", None) or [])
        if not methods:
            continue
        entry = routes.setdefault(path, {"methods": [], "request": None, "auth": "normal"})
        entry["methods"] = sorted(set(entry["methods"]) | set(methods))
        level = getattr(getattr(route, "endpoint", None), "_auth_level", None)
        if level is not None:
            entry["auth"] = str(getattr(level, "value", level))
        for method in methods:
            op = openapi.get("paths", {}).get(path, {}).get(method.lower(), {})
            ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
                   .get("schema", {}).get("$ref"))
            if ref:
                entry["request"] = ref.rsplit("/", 1)[-1]
    structs = {}
    for name in STRUCTS:
        cls = getattr(io_struct, name, None)
        if cls is not None:
            structs[name] = _fields(cls)
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    structs["LoadSnapshot"] = _fields(LoadSnapshot)  # one entry of /v1/loads' `loads`
    from sglang.srt.sampling.sampling_params import SamplingParams

    structs["SamplingParams"] = _fields(SamplingParams)  # what GenerateReqInput.sampling_params becomes
    from sglang.srt.configs.load_config import LoadFormat

    load_formats = sorted(member.value for member in LoadFormat)
    # The tokenizer manager fills meta_info; per-token versions are added by a helper module.
    meta_keys = sorted({key for module in ("sglang.srt.managers.tokenizer_manager",
                                           "sglang.srt.utils.weight_versions")
                        for key in _meta_info_keys(inspect.getsource(importlib.import_module(module)))})

    # The keys of `/model_info`'s reply, from its handler (rlfleet reads weight_version there).
    model_info_keys = sorted(set(re.findall(r"^\s*[\"'](\w+)[\"']\s*:",
                                            inspect.getsource(http_server.model_info), flags=re.M)))
    requests = _load_engine_requests()
    bodies = []
    failures = []
    for route, struct_name, body in requests.sample_bodies():
        error = _convert(body, getattr(io_struct, struct_name), structs[struct_name])
        bodies.append({"route": route, "type": struct_name, "body": body, "converts": error is None,
                       **({"error": error} if error else {})})
        if error:
            failures.append(f"{route}: {error}")
    snapshot = {
        "sglang_version": sglang.__version__,
        "generated_by": "scripts/sglang_contract.py",
        "routes": dict(sorted(routes.items())),
        "structs": structs,
        "load_formats": load_formats,
        "meta_info_keys": meta_keys,
        "model_info_keys": model_info_keys,
        "bodies": bodies,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(snapshot, indent=1, sort_keys=False, default=str) + "\n")
    print(f"wrote {out}: {len(routes)} routes, {len(structs)} structs, {len(bodies)} bodies")
    for failure in failures:
        print(f"body does not convert: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
