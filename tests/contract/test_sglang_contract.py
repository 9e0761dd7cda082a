"""rlfleet's dialect against SGLang's own package, as recorded in contracts/sglang-<version>.json.

The snapshot is written by `scripts/sglang_contract.py` from the SGLang wheel (route table, io_struct
fields, load formats, reply keys) and with it the result of converting each body rlfleet sends into
SGLang's struct. These tests need no SGLang: they check that every route, method, field and reply key
the engine client (gateway, broker, weight agent) and the CPU engine use is in the snapshot. A new
SGLang release is checked by regenerating one file and running this directory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlfleet.common import engine_requests as wire

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT_PATH = ROOT / "contracts" / f"sglang-{wire.SGLANG_VERSION}.json"
REGENERATE = "regenerate it: python scripts/sglang_contract.py"


@pytest.fixture(scope="module")
def snapshot() -> dict:
    return json.loads(SNAPSHOT_PATH.read_text())


def test_the_snapshot_is_of_the_pinned_release(snapshot):
    assert snapshot["sglang_version"] == wire.SGLANG_VERSION
    assert wire.SGLANG_IMAGE.endswith(f":v{wire.SGLANG_VERSION}-cu130")


def test_every_route_the_client_calls_exists_with_its_method_and_request_type(snapshot):
    for name, (method, path, request_type) in wire.ROUTES.items():
        route = snapshot["routes"].get(path)
        assert route is not None, f"{name}: SGLang {wire.SGLANG_VERSION} has no {path}"
        assert method in route["methods"], f"{name}: {path} takes {route['methods']}, not {method}"
        if request_type is not None:
            assert route["request"] == request_type, (name, route)
            assert request_type in snapshot["structs"], f"{request_type} not recorded; {REGENERATE}"


def test_routes_sglang_dropped_are_never_called(snapshot):
    """The routes issue 15 found broken: gone in 0.5.23, or deprecated aliases."""
    for gone in ("/get_weight_version", "/get_load"):
        assert gone not in snapshot["routes"]
    used = {path for _, path, _ in wire.ROUTES.values()}
    assert not used & {"/get_weight_version", "/get_load", "/get_model_info", "/get_server_info"}


def test_every_body_field_is_a_field_of_sglangs_struct(snapshot):
    """SGLang drops unknown JSON fields silently (so `pause_mode` was lost): none may be sent."""
    for path, request_type, body in wire.sample_bodies():
        fields = snapshot["structs"][request_type]
        assert set(body) <= set(fields), \
            f"{path}: {sorted(set(body) - set(fields))} are not {request_type} fields"
        required = {name for name, spec in fields.items() if spec["required"]}
        assert required <= set(body), f"{path}: {request_type} requires {sorted(required - set(body))}"


def test_every_sampling_parameter_the_gateway_sends_is_one_of_sglangs(snapshot):
    """The gateway's proto -> sampling_params translation, with every field set."""
    pytest.importorskip("rlfleet.gateway.engine_io", reason="needs the rlfleet-rollout-gateway package")
    from rlfleet.api.common.v1 import common_pb2
    from rlfleet.gateway.engine_io import sampling_params

    proto = common_pb2.SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, stop=["x"],
                                      stop_token_ids=[2], seed=3, ignore_eos=True)
    sent = sampling_params(proto)
    fields = snapshot["structs"]["SamplingParams"]
    assert set(sent) <= set(fields), sorted(set(sent) - set(fields))
    # effective only with --enable-deterministic-inference (the k8s overlay sets it)
    assert "sampling_seed" in sent


def test_every_body_converted_into_sglangs_struct_when_the_snapshot_was_written(snapshot):
    recorded = [[b["route"], b["type"], b["body"]] for b in snapshot["bodies"]]
    assert recorded == json.loads(json.dumps(wire.sample_bodies())), (
        f"the bodies rlfleet sends changed since the snapshot; {REGENERATE}")
    failed = [(b["route"], b.get("error")) for b in snapshot["bodies"] if not b["converts"]]
    assert not failed


def test_load_formats_sent_are_sglangs_own(snapshot):
    formats = {body["load_format"] for path, _, body in wire.sample_bodies() if "load_format" in body}
    assert formats and formats <= set(snapshot["load_formats"])
    assert not {"rlfleet_delta", "rlfleet_full"} & set(snapshot["load_formats"])


def test_reply_keys_read_are_ones_sglang_writes(snapshot):
    assert set(wire.META_INFO_KEYS) <= set(snapshot["meta_info_keys"])
    assert "weight_version" in snapshot["model_info_keys"]
    load_fields = set(snapshot["structs"]["LoadSnapshot"])
    assert {"num_running_reqs", "num_waiting_reqs", "dp_rank"} <= load_fields


def test_lora_reply_keys_read_are_sglangs_lora_update_output(snapshot):
    assert set(wire.LORA_REPLY_KEYS) <= set(snapshot["structs"]["LoRAUpdateOutput"])
    # lora_path per request names a loaded adapter; a batch may give one per prompt (None: the base model).
    assert "lora_path" in snapshot["structs"]["GenerateReqInput"]
    assert "List[Optional[str]]" in snapshot["structs"]["GenerateReqInput"]["lora_path"]["type"]


def test_admin_routes_match_sglangs_auth_levels(snapshot):
    """The admin key goes exactly where SGLang's `--admin-api-key` guards a route."""
    for name, (_, path, _) in wire.ROUTES.items():
        admin = snapshot["routes"][path]["auth"] != "normal"
        assert (name in wire.ADMIN_ROUTES) == admin, (name, path, snapshot["routes"][path]["auth"])


def test_nothing_calls_an_engine_route_outside_the_wire_module():
    """Every engine call goes through rlfleet.common.engine_requests, so the checks above cover all of
    them."""
    offenders = []
    pattern = re.compile(r"_request\(\s*\"(GET|POST)\"")
    for source in [*ROOT.glob("libs/*/src/**/*.py"), *ROOT.glob("services/*/src/**/*.py")]:
        if source.name == "engine_client.py":
            continue
        if pattern.search(source.read_text()):
            offenders.append(str(source.relative_to(ROOT)))
    assert not offenders


def test_the_cpu_engine_serves_sglangs_routes_and_methods(snapshot, tmp_path):
    """The stand-in's routes are SGLang's (same path, same methods), except its own under /rlfleet/."""
    pytest.importorskip("rlfleet.engine.server", reason="needs the rlfleet-cpu-engine package")
    from rlfleet.engine.testing import served_routes

    for path, methods in served_routes().items():
        if path.startswith("/rlfleet/"):
            continue
        assert path in snapshot["routes"], f"the CPU engine serves {path}, which SGLang does not"
        assert set(methods) <= set(snapshot["routes"][path]["methods"]), (path, methods)
    served = served_routes()
    for _name, (method, path, _) in wire.ROUTES.items():
        assert method in served.get(path, ()), f"the CPU engine does not serve {method} {path}"


def test_the_cpu_engine_accepts_only_sglang_load_formats(snapshot):
    pytest.importorskip("rlfleet.engine.server", reason="needs the rlfleet-cpu-engine package")
    from rlfleet.engine.model_runner import LOAD_FORMATS

    assert set(LOAD_FORMATS) <= set(snapshot["load_formats"])


def test_the_remote_instance_route_is_sglangs(snapshot):
    info = snapshot["routes"]["/remote_instance_transfer_engine_info"]
    assert info["methods"] == ["GET"]
