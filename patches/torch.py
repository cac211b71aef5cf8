"""The private internals of PyTorch that hf_ring's layers above the kernels rely on.

- ``has_forward_hooks(module)``: ``nn.Module._forward_hooks``, the hooks registered with
  ``register_forward_hook`` on one module. The chunked loss never runs the LM head (it
  swaps the head's forward for one that records its input), so a hook there would see an
  empty output and its effect on the logits would be lost; torch has no public way to ask
  whether a module has forward hooks.

Written for torch 2.13.0 (``Module.__init__`` and ``register_forward_hook`` were read
there: ``_forward_hooks`` is an ``OrderedDict`` from handle id to hook). torch is not
refused by version here, since pyproject's range (``torch>=2.5``) is what hf_ring supports;
instead each accessor checks that the attribute has the shape it was written for and
raises ``UnsupportedTorchVersion`` otherwise.

Not here: the private ATen ops the kernels call (``torch.ops.aten._flash_attention_forward``
and its kin). They are the kernels themselves; each backend in ``hf_ring.kernels`` checks
the op's schema before its first call (``cuda_glue.check_op_schema``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

WRITTEN_FOR = ("2.13.0",)


class UnsupportedTorchVersion(RuntimeError):
    """The installed torch holds an internal in another shape than the one read here."""


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward hooks of its own (``register_forward_hook``, with or
    without ``with_kwargs``); global hooks (``register_module_forward_hook``) are not counted.

    Raises:
        UnsupportedTorchVersion: a module without the ``_forward_hooks`` dict torch 2.13.0 has.
    """
    hooks = vars(module).get("_forward_hooks")
    if not isinstance(hooks, dict):
        raise UnsupportedTorchVersion(
            f"{type(module).__name__}._forward_hooks is {type(hooks).__name__}, not a dict, in torch "
            f"{torch.__version__}; hf_ring's torch accessors were written for torch {', '.join(WRITTEN_FOR)}: "
            "report this with your torch version"
        )
    return bool(hooks)
