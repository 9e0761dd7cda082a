"""Same-node weight hand-over in SGLang's `update_weights_from_tensor` shape.

SGLang's request carries `serialized_named_tensors`: one entry per TP rank, each
`MultiprocessingSerializer.serialize([(name, tensor), ...], output_str=True)` -- torch's
`ForkingPickler` pickle, base64-encoded. Pickling a tensor that way ships a handle to its memory,
not its bytes (a CUDA IPC handle on a GPU; a shared-memory file on the host), so only handles cross
the HTTP request and the receiver copies straight out of the sender's memory: the transport of a
trainer and an engine on one node.

Host tensors are shared by file name (torch's `file_system` strategy, set only while pickling):
the default `file_descriptor` strategy hands descriptors over a socket that only the sender's own
child processes can authenticate to, and an engine is no child of the trainer. The sender must keep
the tensors alive until the receiver has copied them (`SharedTensors` holds them).

The receiver unpickles with an allow-list (torch's rebuild functions and storage types only): a
weight route must not be a way to run arbitrary code, whatever key guards it.
"""

from __future__ import annotations

import base64
import builtins
import collections
import contextlib
import io
import pickle
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions  # registers torch's tensor reductions with ForkingPickler


class TensorPayloadError(ValueError):
    """`serialized_named_tensors` is not a list of named tensors this process can open."""


@contextlib.contextmanager
def _by_file_name():
    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def serialize(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One rank's entry of `serialized_named_tensors` (SGLang's MultiprocessingSerializer, as text)."""
    items = [(name, t.detach().contiguous()) for name, t in named]
    buffer = io.BytesIO()
    with _by_file_name():
        ForkingPickler(buffer).dump(items)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SharedTensors:
    """The sender's side: copies of `named` in one shared-memory buffer (one file for the receiver
    to map, not one per tensor), serialized; kept alive until closed."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = [(name, t.detach()) for name, t in named]
        offsets, cursor = [], 0
        for _, t in items:
            offsets.append(cursor)
            cursor += (t.numel() * t.element_size() + 63) // 64 * 64
        with _by_file_name():
            self._flat = torch.empty(max(cursor, 1), dtype=torch.uint8).share_memory_()
        self.tensors = []
        for (name, t), offset in zip(items, offsets, strict=True):
            view = self._flat[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)  # device-to-host here when the trainer's tensors are on a GPU
            self.tensors.append((name, view))
        self.payload = serialize(self.tensors)
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors)

    def close(self) -> None:
        self.tensors = []
        self._flat = None


_ALLOWED_MODULES = ("torch.multiprocessing.reductions", "torch._utils", "torch.storage", "torch._tensor")
_ALLOWED_BUILTINS = {"tuple", "list", "dict", "int", "float", "bool", "str", "bytes", "slice"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return getattr(builtins, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and (name.endswith("Storage") or name in ("Size", "device", "Tensor") or
                                  isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module in _ALLOWED_MODULES and (name.startswith("rebuild_") or name.startswith("_rebuild_")
                                           or name in ("TypedStorage", "UntypedStorage")):
            return getattr(__import__(module, fromlist=[name]), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor payload")


def deserialize(entry: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one entry, copied out of the sender's shared memory."""
    try:
        raw = base64.b64decode(entry, validate=True)
        items = _Unpickler(io.BytesIO(raw)).load()
    except (ValueError, TypeError, pickle.UnpicklingError, EOFError, AttributeError, RuntimeError,
            OSError) as exc:
        raise TensorPayloadError(f"serialized_named_tensors entry cannot be opened: {exc}") from exc
    if not isinstance(items, list) or not all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) and isinstance(i[1], torch.Tensor)
        for i in items
    ):
        raise TensorPayloadError("serialized_named_tensors entry is not a list of (name, tensor) pairs")
    # Copied before the reply: the sender frees its shared memory once the request is answered.
    return [(name, t.clone()) for name, t in items]
