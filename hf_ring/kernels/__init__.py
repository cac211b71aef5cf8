"""Kernels layer: one blockwise attention call and its backward, over several backends.

``base`` holds the backend record and its checks, one module per backend family holds
the kernels (``reference``, ``torch_cpu``, ``flash_attn2``, ``flash_attn3``,
``flash_attn4``, ``torch_flash``, ``torch_cudnn``, ``torch_efficient``, with
``cuda_glue`` and ``window_bands`` shared by the CUDA ones), and ``registry`` chooses
among them. Depends on nothing else in hf_ring; never imports torch.distributed or
transformers.
"""

from hf_ring.kernels.base import AttentionBackend
from hf_ring.kernels.registry import available_backends, get_backend, register_backend

__all__ = ["AttentionBackend", "available_backends", "get_backend", "register_backend"]
