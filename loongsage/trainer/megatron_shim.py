"""Megatron-Core on a machine without CUDA: the few redirections it needs, applied only then.

Megatron-Core's CPU-capable code paths (local layer spec, gloo collectives, FP32 optimizer) still
assume CUDA in a few ways; each line below redirects one of them and nothing else:

1. `torch.cuda.current_device()` names the device for buffers Megatron allocates itself (rotary
   tables, grad buffers, the global memory buffer): it answers "cpu".
2. The model-parallel CUDA RNG tracker forks CUDA generator states around initialisation and
   dropout: a tracker with the same interface forks the CPU generator instead (the seeds are kept,
   so tensor-parallel ranks still draw different dropout masks from distinct, reproducible seeds).
3. Explicit `device="cuda"` in factory calls of a few modules (listed in PATCHED_MODULES): those modules see
   a `torch` whose factory functions build on the CPU when asked for CUDA. No other module, and not `torch` itself, changes.
4. `Tensor.cuda()` (tied embeddings across pipeline stages are synchronised after `.cuda()`) leaves
   the tensor where it is, and `torch.cuda.synchronize()` (pipeline p2p shape exchange) returns at
   once: without CUDA both could only raise, so nothing that works changes.
5. Grad clipping asserts that every grad is a `torch.cuda.FloatTensor` before scaling: the optimizer
   gets the same scaling (grad *= max_norm / (norm + 1e-6) when below 1) without the assertion; the
   norm itself is still Megatron's (`get_grad_norm_fp32`, reduced over the model-parallel groups).

Not redirected (they need CUDA kernels; the backend refuses them on CPU with a clear error): the
distributed optimizer, sequence parallelism, Transformer Engine layer specs, fp16/bf16 optimizers.
"""
from __future__ import annotations

import contextlib
import importlib
import types

import torch

PATCHED_MODULES = (  # modules with explicit device="cuda" allocations on the CPU-capable path
    "megatron.core.optimizer.optimizer",  # loss-scale / overflow buffers of the FP32 optimizer
    "megatron.core.optimizer.clip_grads",  # grad-norm all-reduce buffer
    "megatron.core.utils",  # local multi-tensor L2 norm (no apex)
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers
    "megatron.core.transformer.utils",  # default causal mask
    "megatron.core.pipeline_parallel.schedules",  # loss / tensor-shape buffers of the schedules
    "megatron.core.pipeline_parallel.p2p_communication",  # shape and activation buffers between stages
)
_FACTORIES = ("tensor", "ones", "zeros", "empty", "full", "arange", "rand", "randn")
_applied = False


def _on_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class _CpuFactoryTorch(types.ModuleType):
    """`torch` as seen by a patched module: factory calls asked for CUDA build on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._redirect(getattr(torch, name)))

    @staticmethod
    def _redirect(factory):
        def build(*args, **kwargs):
            if _on_cpu(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return build

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters):
        grad = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if grad is not None:
            grad.detach().mul_(coeff)


def apply_cpu_shim() -> bool:
    """Applies the redirections once when CUDA is absent; returns whether they are in effect."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    torch.cuda.current_device = lambda: "cpu"  # (1)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # (4)
    torch.cuda.synchronize = lambda device=None: None  # (4)

    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):  # (2)
        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"rng state {name!r} / seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            gen = torch.Generator()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise KeyError(f"rng state {name!r} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    for name in PATCHED_MODULES:  # (3)
        importlib.import_module(name).torch = _CpuFactoryTorch()
    importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 = _clip_by_total_norm  # (5)
    _applied = True
    return True
