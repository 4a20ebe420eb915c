"""CPU stand-ins for the CUDA calls of megatron-core (and Megatron-LM's training code).

megatron-core and Megatron-LM's ``pretrain()`` assume a GPU: ``device="cuda"`` buffers,
``torch.cuda.current_device()``, CUDA streams and the CUDA RNG. The tests (and
``scripts/megatron-check``) run them on CPU ranks over gloo with these stand-ins; nothing
in Megatron is edited. :func:`install` must run before the model is built. The CUDA RNG
goes to a CPU generator of its own, so the tensor-parallel RNG tracker is still saved
and restored.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install"]

_INSTALLED: list[str] = []


def _cpu(device: Any) -> Any:
    if isinstance(device, bool):
        return device
    if isinstance(device, int) or (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    """Every ``device='cuda'``/int device becomes the CPU; ``Tensor.type()`` reports ``torch.cuda.*``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory"):
            return args[0]
        if name == "to" and len(args) > 1:
            args = (args[0], *tuple(a if isinstance(a, (torch.dtype, torch.Tensor)) else _cpu(a) for a in args[1:]))
        if name == "type" and args and isinstance(args[0], torch.Tensor):
            if len(args) == 1 and not kwargs:
                kind = func(*args)
                return kind if kind.startswith("torch.cuda.") else "torch.cuda." + kind[len("torch.") :]
            target = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
            if isinstance(target, str) and target.startswith("torch.cuda."):
                target = "torch." + target[len("torch.cuda.") :]
            return func(args[0], target, **kwargs)
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *a: Any, **k: Any) -> None:
        self._t = time.perf_counter()

    def record(self, *a: Any, **k: Any) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, *a: Any, **k: Any) -> None:
        pass

    def elapsed_time(self, other: _Event) -> float:
        return (other._t - self._t) * 1000.0


class _Stream:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, *a: Any, **k: Any) -> None:
        pass

    def wait_event(self, *a: Any, **k: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a: Any, **k: Any) -> _Event:
        return _Event()


def _cuda_queries() -> None:
    cuda = torch.cuda
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 1  # Megatron builds its parallel groups only when above 0
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (64 << 30, 64 << 30)
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.Event, cuda.Stream = _Event, _Stream
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    import torch.cuda.nvtx as nvtx

    nvtx.range_push = nvtx.range_pop = lambda *a, **k: None
    nvtx.range = lambda *a, **k: contextlib.nullcontext()


def _cuda_rng() -> None:
    """The CUDA RNG calls (torch's and Megatron's tracker) go to a CPU generator of their own."""
    fake = torch.Generator()
    fake.manual_seed(0)
    torch.cuda.get_rng_state = lambda *a, **k: fake.get_state()
    torch.cuda.set_rng_state = lambda s, *a, **k: fake.set_state(s)
    torch.cuda.manual_seed = torch.cuda.manual_seed_all = lambda s: fake.manual_seed(int(s))
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: fake.get_state()
    mrandom._set_cuda_rng_state = lambda s, *a, **k: fake.set_state(s)


def _moe_without_te() -> None:
    """megatron-core 0.16.1's MoE router names ``te_general_gemm`` that only a Transformer Engine import defines."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # its own fallback: torch.mm


def _training_tree() -> None:
    """Megatron-LM's training code, when it is importable (``MLM_SRC`` on the path)."""
    try:
        import megatron.training.arguments as margs
        import megatron.training.initialize as minit
        import megatron.training.training as mtrain
    except ImportError:
        return
    margs.get_device_arch_version = lambda: 9
    original = minit.initialize_megatron

    def initialize_megatron(*a: Any, **k: Any) -> Any:
        k["allow_no_cuda"] = True
        return original(*a, **k)

    minit.initialize_megatron = mtrain.initialize_megatron = initialize_megatron
    import megatron.core.datasets.utils as dsutils
    import megatron.legacy.fused_kernels as fused

    dsutils.compile_helpers = lambda: None  # the wheel ships the helpers prebuilt
    fused.load = lambda *a, **k: None  # needs nvcc; unused without the fusions


def install() -> list[str]:
    """Put the stand-ins in place (once per process); returns what was replaced."""
    if _INSTALLED:
        return _INSTALLED
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    _CudaToCpu().__enter__()  # on for the whole process
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    _cuda_queries()
    _cuda_rng()
    _moe_without_te()
    _training_tree()
    _INSTALLED.extend(
        [
            "device='cuda'|int -> cpu in every torch call; .cuda()/pin_memory() -> self; type() says torch.cuda.*",
            "torch.cuda sync/empty_cache/set_device no-ops, current_device 'cpu', device_count 1, memory stats 0",
            "torch.cuda Stream/Event/nvtx inert",
            "CUDA RNG (torch and Megatron's tracker) -> a CPU torch.Generator of its own",
            "MoE router without Transformer Engine: te_general_gemm = None (megatron-core's torch.mm fallback)",
            "initialize_megatron(allow_no_cuda=True), get_device_arch_version 9, no helper/kernel compiles",
        ]
    )
    return _INSTALLED
