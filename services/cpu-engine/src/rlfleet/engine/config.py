"""The CPU engine's configuration. Importable without torch; field descriptions are the CLI help."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from rlfleet.common.config import ProcessConfig


class EngineConfig(ProcessConfig):
    """rlfleet's built-in CPU engine (SGLang HTTP API)."""

    model_path: Path | None = Field(None, description="HF model directory: config.json, *.safetensors, "
                                    "tokenizer.json (required to start)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(0, ge=0, le=65535, description="port to listen on; 0 picks a free port")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads for the model")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="what the model computes in: float32 (outputs bit-identical whatever the "
        "batch), or bfloat16 as SGLang serves (weights, activations and KV in bf16; faster on AMX CPUs, "
        "bench/engine_dtype.py)")
    max_running_requests: int = Field(64, ge=1, description="most requests decoded together in one batch")
    max_total_tokens: int = Field(
        65536,
        ge=1,
        description="KV budget: sum over running requests of prompt + max_new_tokens; "
        "requests wait in the queue until they fit",
    )
    context_length: int | None = Field(
        None,
        ge=1,
        description="most prompt + new tokens per request; default: the model's max_position_embeddings",
    )
    max_request_bytes: int = Field(8 * 1024**2, ge=1024, description="largest request body; beyond: HTTP 413 "
                                   "(the JSON is parsed on the event loop, about 0.1 s per MiB of token ids)")
    max_text_chars: int = Field(1_000_000, ge=1, description="characters of 'text' one /generate request may "
                                "carry (all prompts together), refused with 413 before tokenizing")
    max_prefill_tokens: int = Field(
        4096, ge=1, description="prompt tokens prefilled between two decode steps (at least one request)"
    )
    max_prefix_cache_tokens: int = Field(
        32768,
        ge=0,
        description="tokens of finished requests whose KV is kept for reuse by later requests that "
        "start with the same tokens (least recently used out first); each costs 2 x layers x kv_heads x "
        "head_dim x 4 bytes; 0 turns the prefix cache off",
    )
    engine_id: str | None = Field(
        None, description="name reported by /model_info; default cpu-engine-<pid>"
    )
    api_key: str | None = Field(
        None, description="as SGLang's --api-key: every route but health wants `Authorization: Bearer <key>`")
    admin_api_key: str | None = Field(
        None, description="as SGLang's --admin-api-key: the admin routes (weights, pause, flush, abort) want "
        "this key instead")
    weight_version: str = Field("default", description="weight version reported until the first update")
    weight_store_root: Path | None = Field(
        None,
        description="weight store root that /rlfleet/update_weights_from_store may read from; a model_path "
        "outside it is refused (default: any store, the version directory's grandparent)",
    )
    weight_store_workers: int = Field(
        1, ge=1, description="threads that decode and hash weight-store versions (outside the pause)"
    )
    p2p_hostname: str = Field(
        "127.0.0.1", description="address the Mooncake TransferEngine of the P2P receive buffer listens on "
        "(a trainer must reach it; P2PHANDSHAKE mode: no metadata server)")
    p2p_protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transport protocol: tcp, or "
                                                 "rdma on a fleet with RDMA NICs")
    p2p_device: str = Field("", description="Mooncake device name(s) for rdma (e.g. mlx5_0); empty = auto")
    dist_timeout_s: float = Field(
        300.0, gt=0, description="timeout of torch.distributed weight-update groups"
    )
