"""What megatron-core 0.16.1 and megatron-bridge 0.3.1 need to run without CUDA, in one place.

Each workaround exists because a code path of the real libraries assumes a GPU (or a GPU-only
package) even where the computation itself is device-independent. None changes the numerics: the
same model, the same conversion, the same math, on CPU tensors. `import_bridge()` is the only way
the trainer imports megatron-bridge, and `apply()` runs before any Megatron model is built.

1. transformer_engine stand-in, during the bridge's import only. megatron-bridge's LoRA modules
   (`megatron/bridge/peft/lora_layers.py`, `lora.py`) `import transformer_engine.pytorch` at the
   top, unguarded, and subclass `te.Linear`; the bridge's package `__init__` imports them, so the
   HF <-> Megatron conversion cannot be imported without TE (a CUDA-only build). The stand-in has
   the few names those modules touch at import time; each is a class that refuses to be built, so
   an accidental TE code path fails loudly instead of computing something. It is visible only
   while the bridge is imported: megatron-core's own TE probes (`HAVE_TE`) run before, see TE
   absent and choose the local (torch) layers, and `import_bridge` checks that they still do.
2. Mamba's Triton kernels, when triton is absent. The bridge's package `__init__` imports its
   Mamba provider, which imports megatron-core's Mamba mixer, which imports Triton kernels for
   Mamba *inference* (`inference/contexts/attention_context/triton/tensor_ops.py`). CUDA builds of
   torch ship triton; the CPU build does not. The stand-in module's three kernels raise if called;
   GPT models (Qwen2/Qwen3/Llama) never call them.
3. Rotary embedding. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`
   the first time it runs, which asserts without CUDA. Without CUDA, `current_device()` answers
   "cpu" for the length of that call (the tensor stays where it is); with CUDA the original runs.
4. The CUDA RNG tracker. `model_parallel_cuda_manual_seed` seeds CUDA generators; without CUDA the
   tracker (used by dropout and tensor-parallel weight init) is created directly instead. Dropout
   is off in the policies we train and weights come from the HF checkpoint, so it never draws.
5. Contiguous scatter. gloo's `dist.scatter` sends wrong bytes for non-contiguous tensors (torch
   2.13.0); the bridge splits row-parallel weights (`o_proj`, `down_proj`) with
   `torch.chunk(dim=1)`, which gives non-contiguous views, so at TP >= 2 they arrived scrambled.
   The pieces are made contiguous before the bridge's own scatter.
6. The attention scores buffer. The local (non-TE) `DotProductAttention` takes its scores buffer
   from `GlobalMemoryBuffer.get_tensor`, which allocates on `torch.cuda.current_device()`; as in 3,
   without CUDA that call allocates on the CPU. Likewise the bridge's `ReplicatedMapping.hf_to_megatron`
   (norm weights at TP >= 2) moves the weight to `torch.cuda.current_device()` before broadcasting it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

# The wrappers installed on Megatron's classes, so that a second apply() leaves them as they are.
_INSTALLED: set[Callable[..., Any]] = set()
# megatron-core modules that probe for transformer_engine at import (HAVE_TE) and that the bridge
# imports: imported before the stand-in exists, so that each records TE as absent.
_TE_PROBES = (
    "megatron.core.fp8_utils",
    "megatron.core.fp4_utils",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.transformer.heterogeneous.linear_replacements",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.T5.t5_spec",
    "megatron.core.post_training.modelopt.layers",
    "megatron.core.transformer.multi_latent_attention",
)
_MAMBA_TRITON_KERNELS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


class _NotTransformerEngine:
    """A transformer_engine class that was imported but must never be used."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{type(self).__name__} is a stand-in: transformer_engine is not installed, "
                           "and the rlfleet Megatron backend builds local (torch) layers only on CPU")


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__dict__.update(attrs)
    return module


def _transformer_engine_stand_in() -> dict[str, types.ModuleType]:
    names = ("Linear", "LayerNormLinear", "GroupedLinear")
    ops = _module("transformer_engine.pytorch.ops",
                  **{n: type(n, (_NotTransformerEngine,), {}) for n in
                     ("Sequential", "Linear", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput")})
    pytorch = _module("transformer_engine.pytorch", ops=ops,
                      **{n: type(n, (_NotTransformerEngine,), {}) for n in names})
    root = _module("transformer_engine", pytorch=pytorch)
    return {"transformer_engine": root, "transformer_engine.pytorch": pytorch,
            "transformer_engine.pytorch.ops": ops}


def _mamba_kernels_stand_in() -> types.ModuleType:
    def kernel(name: str):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{name}: Mamba's Triton inference kernel needs triton (absent on CPU)")
        return refuse

    names = ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge")
    return _module(_MAMBA_TRITON_KERNELS, **{n: kernel(n) for n in names})


@contextlib.contextmanager
def _visible(modules: dict[str, types.ModuleType]) -> Iterator[None]:
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in modules:
            sys.modules.pop(name, None)


def _quiet_import(name: str):
    with warnings.catch_warnings():
        # "Transformer Engine and Apex are not installed. Falling back to ...": expected on CPU.
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        return importlib.import_module(name)


@functools.cache
def import_bridge():
    """megatron.bridge.AutoBridge, imported with workarounds 1 and 2 where they are needed."""
    if "megatron.bridge" not in sys.modules:
        for name in _TE_PROBES:
            _quiet_import(name)
        stand_ins = {}
        if importlib.util.find_spec("transformer_engine") is None:
            stand_ins.update(_transformer_engine_stand_in())
            if importlib.util.find_spec("triton") is None and _MAMBA_TRITON_KERNELS not in sys.modules:
                # Stays registered: the Mamba mixer keeps its names; nothing else asks for it.
                sys.modules[_MAMBA_TRITON_KERNELS] = _mamba_kernels_stand_in()
        before = set(sys.modules)
        if importlib.util.find_spec("megatron.bridge") is None:
            raise ModuleNotFoundError("megatron-bridge is not installed (the Megatron backend's HF "
                                      "conversion); scripts/install.sh installs it")
        with _visible(stand_ins):
            _quiet_import("megatron.bridge")
        if stand_ins:
            _check_core_sees_no_transformer_engine(set(sys.modules) - before)
    return sys.modules["megatron.bridge"].AutoBridge


def _check_core_sees_no_transformer_engine(imported: set[str]) -> None:
    """No megatron-core module first imported while the stand-in was visible believes in TE."""
    fooled = sorted(name for name in imported
                    if name.startswith("megatron.core")
                    and getattr(sys.modules[name], "HAVE_TE", False) is True)
    if fooled:
        raise RuntimeError(f"megatron-core modules took the transformer_engine stand-in for the real thing: "
                           f"{fooled}; add them to megatron_cpu._TE_PROBES")


def _keep_on_cpu(cls: type, method: str) -> None:
    """Runs cls.method with torch.cuda.current_device() answering "cpu" when there is no CUDA."""
    original = getattr(cls, method)
    if original in _INSTALLED:
        return

    @functools.wraps(original)
    def on_cpu(self, *args, **kwargs):
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)
        with _current_device_is_cpu():
            return original(self, *args, **kwargs)

    _INSTALLED.add(on_cpu)
    setattr(cls, method, on_cpu)


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    # Not an int on purpose: Megatron passes current_device() on as a device, and "cpu" is one.
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


def _patch_contiguous_scatter() -> None:
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    original = MegatronParamMapping.scatter_to_tp_ranks
    if original in _INSTALLED:
        return

    @functools.wraps(original)
    def scatter_to_tp_ranks(self, splits, *args, **kwargs):
        if splits is not None:
            splits = [s.contiguous() for s in splits]
        return original(self, splits, *args, **kwargs)

    _INSTALLED.add(scatter_to_tp_ranks)
    MegatronParamMapping.scatter_to_tp_ranks = scatter_to_tp_ranks


def seed_rng_tracker(seed: int) -> None:
    """Workaround 4 on CPU; Megatron's own model_parallel_cuda_manual_seed on a GPU."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@functools.cache
def apply() -> None:
    """Workarounds 1, 2, 3, 5 and 6 (4 is per model: seed_rng_tracker). Idempotent."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.utils import GlobalMemoryBuffer

    import_bridge()
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    _keep_on_cpu(RotaryEmbedding, "get_emb")
    _keep_on_cpu(GlobalMemoryBuffer, "get_tensor")
    _keep_on_cpu(ReplicatedMapping, "hf_to_megatron")
    _patch_contiguous_scatter()
