"""The HTTP dialect rlfleet speaks to SGLang 0.5.23 (and to the CPU engine, which serves the same): routes
and request bodies, built in one place so the contract with SGLang can check them.

Standard library only, on purpose: `scripts/sglang_contract.py` loads this file inside a throwaway
venv holding SGLang (and not rlfleet) and converts every body from `sample_bodies()` into SGLang's own
`io_struct` type with `msgspec.convert`; `tests/contract/` checks the routes and fields against the
snapshot it writes (contracts/sglang-<version>.json).

Load formats: only SGLang's own (`auto` for a plain HF directory). rlfleet's weight-store formats
are not SGLang's: a weight store version reaches an SGLang engine as a full HF directory written by
the node-local weight agent.
"""

from __future__ import annotations

from typing import Any

SGLANG_VERSION = "0.5.23"
# Tested against: the route table and io_struct of these releases (the snapshot is of the newest).
SUPPORTED_SGLANG = ">=0.5.23,<0.6"
SGLANG_IMAGE = "lmsysorg/sglang:v0.5.23-cu130"

DEFAULT_GROUP = "weight_update_group"

# (method, path, io_struct request type or None): every SGLang route rlfleet calls.
ROUTES: dict[str, tuple[str, str, str | None]] = {
    "generate": ("POST", "/generate", "GenerateReqInput"),
    "abort": ("POST", "/abort_request", "AbortReq"),
    "health": ("GET", "/health", None),
    "health_generate": ("GET", "/health_generate", None),
    "model_info": ("GET", "/model_info", None),
    "server_info": ("GET", "/server_info", None),
    "loads": ("GET", "/v1/loads", None),
    # OpenAI's model list: the base model, and in SGLang every loaded LoRA adapter as a card with
    # `parent` set (id = lora_name, root = lora_path). The broker reads it to see what an engine holds.
    "models": ("GET", "/v1/models", None),
    "update_weight_version": ("POST", "/update_weight_version", "UpdateWeightVersionReqInput"),
    "pause": ("POST", "/pause_generation", "PauseGenerationReqInput"),
    "resume": ("POST", "/continue_generation", "ContinueGenerationReqInput"),
    "flush_cache": ("POST", "/flush_cache", None),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk", "UpdateWeightFromDiskReqInput"),
    "init_weights_update_group": ("POST", "/init_weights_update_group", "InitWeightsUpdateGroupReqInput"),
    "update_weights_from_distributed": (
        "POST", "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput"),
    "destroy_weights_update_group": (
        "POST", "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput"),
    "get_weights_by_name": ("POST", "/get_weights_by_name", "GetWeightsByNameReqInput"),
    "load_lora_adapter": ("POST", "/load_lora_adapter", "LoadLoRAAdapterReqInput"),
    "unload_lora_adapter": ("POST", "/unload_lora_adapter", "UnloadLoRAAdapterReqInput"),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput"),
    "remote_instance_transfer_engine_info": ("GET", "/remote_instance_transfer_engine_info", None),
}
# rlfleet-only routes of the CPU engine (SGLang has none of them; never sent to an SGLang engine).
RLFLEET_ROUTES: dict[str, tuple[str, str, str | None]] = {
    "update_weights_from_store": ("POST", "/rlfleet/update_weights_from_store", None),
    "update_weights_from_staging": ("POST", "/rlfleet/update_weights_from_staging", None),
    "adopt_store_version": ("POST", "/rlfleet/adopt_store_version", None),
}
STORE_KINDS = ("delta", "full")
# Routes that a server started with `--admin-api-key` guards (the key goes as `Authorization: Bearer`).
# (SGLang's ADMIN_OPTIONAL / ADMIN_FORCE levels; the contract test holds this set to the snapshot's.)
ADMIN_ROUTES = frozenset(
    name for name in ROUTES if name not in ("generate", "health", "health_generate", "model_info",
                                            "server_info", "loads", "models")
)
# The keys of a /load_lora_adapter or /unload_lora_adapter reply (SGLang's LoRAUpdateOutput) rlfleet reads.
LORA_REPLY_KEYS = ("success", "error_message", "loaded_adapters")
# The keys of a /v1/models card (OpenAI's ModelCard as SGLang writes it) rlfleet reads.
MODEL_CARD_KEYS = ("id", "root", "parent")
# How SGLang 0.5.23 (tokenizer_manager._resolve_lora_path) and the CPU engine refuse a request naming an
# adapter the engine does not hold: never loaded there (a restarted engine), or its directory is gone.
ADAPTER_MISSING_MESSAGES = ("LoRA adapter that has never been loaded",
                            "Failed to implicitly load LoRA adapter")
# The `meta_info` keys of a /generate reply rlfleet reads.
META_INFO_KEYS = ("id", "finish_reason", "prompt_tokens", "cached_tokens", "e2e_latency", "weight_version",
                  "weight_versions", "output_token_logprobs")


def generate(input_ids: list[int] | list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]],
             *, return_logprob: bool, rid: str | None = None,
             lora_path: str | list[str | None] | None = None) -> dict[str, Any]:
    """`lora_path` names a loaded adapter (its `lora_name`, not a directory), one per prompt in a batch;
    None or absent: the base model."""
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                            "return_logprob": return_logprob}
    if rid is not None:
        body["rid"] = rid
    if lora_path is not None:
        body["lora_path"] = lora_path
    return body


def load_lora_adapter(lora_name: str, lora_path: str, *, pinned: bool = False) -> dict[str, Any]:
    """A peft adapter directory (adapter_config.json + adapter_model.safetensors) served as `lora_name`."""
    return {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}


def unload_lora_adapter(lora_name: str) -> dict[str, Any]:
    return {"lora_name": lora_name}


def abort(rid: str | None, abort_all: bool) -> dict[str, Any]:
    return {"rid": rid or "", "abort_all": abort_all}


def update_weight_version(new_version: str, abort_all_requests: bool) -> dict[str, Any]:
    return {"new_version": new_version, "abort_all_requests": abort_all_requests}


def pause(mode: str) -> dict[str, Any]:
    return {"mode": mode}


def update_weights_from_disk(model_path: str, *, load_format: str = "auto", weight_version: str | None,
                             flush_cache: bool, abort_all_requests: bool) -> dict[str, Any]:
    return {"model_path": model_path, "load_format": load_format, "weight_version": weight_version,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}


def init_weights_update_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
                              *, group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict[str, Any]:
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def update_weights_from_distributed(names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                    group_name: str = DEFAULT_GROUP, weight_version: str | None,
                                    flush_cache: bool, abort_all_requests: bool) -> dict[str, Any]:
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests}


def destroy_weights_update_group(group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
    return {"group_name": group_name}


def get_weights_by_name(name: str, truncate_size: int = 100) -> dict[str, Any]:
    return {"name": name, "truncate_size": truncate_size}


def update_weights_from_store(model_path: str, kind: str, *, weight_version: str,
                              pause_mode: str) -> dict[str, Any]:
    """The CPU engine's own weight-store load (kind delta | full); see its README."""
    return {"model_path": model_path, "kind": kind, "weight_version": weight_version,
            "pause_mode": pause_mode, "flush_cache": True}


def update_weights_from_tensor(serialized_named_tensors: list[str], *, weight_version: str | None,
                               flush_cache: bool, abort_all_requests: bool) -> dict[str, Any]:
    """One entry per TP rank (rlfleet.weights.tensor_ipc.serialize); load format: SGLang's default
    (direct)."""
    return {"serialized_named_tensors": serialized_named_tensors, "weight_version": weight_version,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}


def update_weights_from_staging(checksums: dict[str, str], checksum_algorithm: str, *, weight_version: str,
                                pause_mode: str, source: str = "p2p", model_path: str = "") -> dict[str, Any]:
    """The CPU engine's own commit of a staged transfer (`source` p2p: its Mooncake staging buffer;
    distributed: a broadcast received with `staged=1`): verify against the trainer's checksums, flip.
    `model_path`: the store's copy of the version (P2P): the engine then holds it, for later deltas."""
    body = {"checksums": checksums, "checksum_algorithm": checksum_algorithm,
            "weight_version": weight_version, "pause_mode": pause_mode, "source": source}
    if model_path:
        body["model_path"] = model_path
    return body


def adopt_store_version(model_path: str, *, weight_version: str) -> dict[str, Any]:
    """The CPU engine's own: it serves `weight_version`, flipped in from a transfer before the store had
    it; the store's copy is `model_path` now, and the engine holds it when the checksums agree."""
    return {"model_path": model_path, "weight_version": weight_version}


def sample_bodies() -> list[tuple[str, str | None, dict[str, Any]]]:
    """(route, io_struct type, body) for every body rlfleet sends, with realistic values."""
    params = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": -1, "stop": ["\n"],
              "stop_token_ids": [2], "sampling_seed": 7, "ignore_eos": False}
    samples = [
        ("generate", generate([1, 2, 3], params, return_logprob=True, rid="r-1")),
        ("generate", generate([[1, 2], [3]], [params, params], return_logprob=False)),
        ("abort", abort("r-1", False)),
        ("abort", abort(None, True)),
        ("update_weight_version", update_weight_version("3", False)),
        ("pause", pause("retract")),
        ("update_weights_from_disk", update_weights_from_disk(
            "/weights/run/v3-full", weight_version="3", flush_cache=True, abort_all_requests=False)),
        ("init_weights_update_group", init_weights_update_group("10.0.0.1", 29500, 1, 5)),
        ("update_weights_from_distributed", update_weights_from_distributed(
            ["model.embed_tokens.weight"], ["bfloat16"], [[32, 16]], weight_version="3", flush_cache=True,
            abort_all_requests=False)),
        ("destroy_weights_update_group", destroy_weights_update_group()),
        ("get_weights_by_name", get_weights_by_name("model.embed_tokens.weight", 4)),
        ("generate", generate([1, 2, 3], params, return_logprob=True, lora_path="7")),
        ("generate", generate([[1, 2], [3], [4]], [params, params, params], return_logprob=True,
                              lora_path=["7", None, "8"])),
        ("load_lora_adapter", load_lora_adapter("7", "/weights/run/v7-lora", pinned=False)),
        ("unload_lora_adapter", unload_lora_adapter("7")),
        ("update_weights_from_tensor", update_weights_from_tensor(
            ["gASVAAAA"], weight_version="3", flush_cache=True, abort_all_requests=False)),
    ]
    return [(ROUTES[name][1], ROUTES[name][2], body) for name, body in samples]
