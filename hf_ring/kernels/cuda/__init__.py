"""The CUDA block kernels: flash-attn 2 / 3 / 4 where installed, PyTorch's own flash,
cuDNN and memory-efficient ops, the glue they share (``glue``: layouts, lse shapes,
the installed ops' signatures) and ``window_bands`` (a sliding window's masked blocks cut
into the bands these kernels take).

Each module builds one ``AttentionBackend`` record from :mod:`hf_ring.kernels.base`; the
registry registers them. Must not import torch.distributed, transformers or accelerate.
"""
