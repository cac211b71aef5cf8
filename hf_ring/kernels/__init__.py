"""Kernels layer: one blockwise attention call and its backward, over several backends.

``base`` holds the backend record, its checks and what a call needs of a kernel
(``KernelNeeds``); ``reference`` and ``torch_cpu`` are the CPU-capable kernels, ``cuda/``
the CUDA ones; ``registry`` looks them up by name and makes the kernel policy
(``backend="auto"``: the first that runs here and computes what the call needs);
``autocast`` settles one dtype for q, k, v.

Depends on nothing else in hf_ring. Must not import torch.distributed, transformers,
accelerate, or any other layer of hf_ring.
"""

from hf_ring.kernels.base import AttentionBackend
from hf_ring.kernels.registry import available_backends, get_backend, register_backend

__all__ = ["AttentionBackend", "available_backends", "get_backend", "register_backend"]
