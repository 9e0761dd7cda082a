"""A trainer's tensors, numpy or torch, as their served bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfleet.weights.tensors import ServedTensors, is_torch_tensor, numpy_to_served, served_dtype_name


def to_served(tensors: Mapping[str, Any], served_dtype: str = "BF16") -> ServedTensors:
    """Convert a trainer's tensors to their served bytes.

    Floating tensors are cast to ``served_dtype`` (fp32 master weights become
    the bf16 the engines serve); integer and bool tensors keep their dtype.
    ``ServedTensors`` are taken as already served (copied). Plain numpy ``uint16`` arrays are
    integers, not bf16: wrap bf16 bit patterns in ``ServedTensors``.

    The arrays returned are always fresh (never views of the input): the
    store keeps them as the previously served bytes while the trainer goes on
    updating its own tensors in place.
    """
    if isinstance(tensors, ServedTensors):
        return tensors.copy()
    served = served_dtype_name(served_dtype)
    if any(is_torch_tensor(v) for v in tensors.values()):
        # Imported here: the light services (the broker) use this package without torch.
        from rlfleet.weights import torch_io

        return torch_io.state_dict_to_served(tensors, served)
    return numpy_to_served(tensors, served)
