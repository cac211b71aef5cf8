"""Kernels layer: one blockwise attention call and its backward, over several backends.

Depends on nothing else in hf_ring; never imports torch.distributed or transformers.
"""

from hf_ring.kernels.backends import AttentionBackend, available_backends, get_backend

__all__ = ["AttentionBackend", "available_backends", "get_backend"]
