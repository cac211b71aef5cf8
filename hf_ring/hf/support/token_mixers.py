"""Detector: modules that mix tokens along the sequence without attention (causal
convolutions, Mamba / SSM mixers, linear attention, RWKV, xLSTM, RG-LRU, ...). The ring
computes only attention across ranks, so under CP such a module sees only its rank's shard
(on packed rows: the whole row across documents). Refused under CP and on packed rows,
except the layers of a guarded model that hf_ring routes to its context-parallel mixers
(``hf_ring.hf.mixers``: on transformers 5.24 the gated delta nets, Mamba-1 and -2 mixers,
Kimi delta attention and short convolutions of ``patches/transformers/mixers.py``'s
``ROUTES``), with what they hold.

Read from the modules themselves: a convolution over the sequence, the parameters of a
state-space or linear-recurrence mixer, a mixer's class name or the attribute it is held
under.

Owns: the mixer names and parameters, ``refusals``. Must not import: Trainer, TRL, hf_ring's
training or memory layers.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional

import torch.nn as nn

from hf_ring.hf.support.reading import Modules, in_tower, listed
from hf_ring.patches.transformers.mixers import is_routed_layer

# Names of sequence mixers that are not attention: a further signal next to the
# structural ones below (a convolution over time, SSM parameters). Matched on the class
# name without the family's prefix (every class of MambaModel is "Mamba...", its norms
# too), case-sensitive so that "GptOssModel" is no SSM; and on the start of the attribute
# a module is held under (xLSTM's `mlstm_layer`, not its `norm_mlstm`). "Conv" alone is
# not among them: transformers' GPT-2 style `Conv1D` is a per-token linear layer.
_MIXER_CLASS = re.compile(
    r"Mamba|SSM|Ssm(?![a-z])|SelectiveScan|LinearAttention|LinearAttn|Lightning|DeltaNet|GatedDelta"
    r"|DeltaAttention|Rwkv|RWKV|Retention|LSTM|Lstm|Hyena|ShortConv|CausalConv|Rglru|RGLRU"
    r"|RecurrentBlock|TimeMix|TokenShift|Griffin"
)
_MIXER_ATTRIBUTE = re.compile(
    r"mamba|ssm|mlstm|slstm|linear_attn|linear_attention|rwkv|short_conv|shortconv|time_mix|rg_lru"
    r"|deltanet|retention"
)
_FAMILY_SUFFIX = re.compile(r"(Text)?(Model|ForCausalLM|LMHeadModel)$")
# Parameters of state-space / linear-recurrence mixers: Mamba's A_log and dt_bias, RWKV's
# time decay and time-mix coefficients.
_SSM_PARAMETERS = frozenset({"A_log", "dt_bias", "time_decay", "time_first", "time_faaaa"})
_SSM_PARAMETER_PREFIXES = ("time_mix_", "time_maa")
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _token_mixer_reason(path: str, module: nn.Module, family: str) -> Optional[str]:
    if isinstance(module, _CONVOLUTIONS):
        kernel, stride = tuple(module.kernel_size), tuple(module.stride)
        if all(k == 1 for k in kernel):
            return None  # a pointwise convolution is per token
        if isinstance(module, (nn.Conv2d, nn.Conv3d)) and kernel == stride and not any(module.padding):
            return None  # an image / video patch embedding: disjoint patches, not along the tokens
        return f"a convolution over the sequence (kernel {kernel[0] if len(kernel) == 1 else kernel})"
    own = {name for name, _ in module.named_parameters(recurse=False)}
    ssm = sorted(n for n in own if n in _SSM_PARAMETERS or n.startswith(_SSM_PARAMETER_PREFIXES))
    if ssm:
        return f"a state-space / recurrent mixer (parameters {', '.join(ssm)})"
    name = type(module).__name__
    if _MIXER_CLASS.search(name[len(family):] if family and name.startswith(family) else name) or (
        _MIXER_ATTRIBUTE.match(path.rsplit(".", 1)[-1].lower())
    ):
        return "a sequence mixer that is not attention (Mamba / SSM / linear attention / RWKV / xLSTM style)"
    return None


def refusals(config: Any, modules: Modules) -> Iterator[str]:
    """One refusal (formatted with ``{where}``) listing every token mixer, or none."""
    family = _FAMILY_SUFFIX.sub("", type(modules[0][1]).__name__) if modules else ""
    # A routed layer runs exactly under CP and on packed rows, its convolution included; the
    # decoder layer around it is named after it (OLMo hybrid's ...LinearAttentionDecoderLayer).
    routed = [p for p, m in modules if is_routed_layer(m)]
    reasons = {
        path: reason
        for path, m in modules
        if not in_tower(path) and not any(path == r or path.startswith(r + ".") for r in routed)
        and (reason := _token_mixer_reason(path, m, family)) is not None
        and not (reason.startswith("a sequence mixer") and any(r.startswith(path + ".") for r in routed))
    }
    # One entry per mixer, the innermost that says why: a Jamba Mamba layer's mixer, not
    # the layer around it; a convolution inside a reported mixer is part of it.
    named = [p for p in reasons if not reasons[p].startswith("a convolution")]
    named = [p for p in named if not any(q.startswith(p + ".") or (p == "" and q) for q in named if q != p)]
    convs = [p for p in reasons if reasons[p].startswith("a convolution")]
    convs = [p for p in convs if not any(p.startswith(q + ".") or q == "" for q in named)]
    classes = dict(modules)
    kept = [p for p in reasons if p in named or p in convs]
    found = [f"{p or '<model>'} ({type(classes[p]).__name__}: {reasons[p]})" for p in kept]
    if found:
        yield (
            f"{listed(found)} mix tokens along the sequence without attention; hf_ring computes only "
            "attention across the sequence, so {where} these would see only the tokens this rank "
            "holds (in packed rows: across document boundaries) and the model would train a "
            "different function without a word. Train this model without context parallelism and "
            "without packed rows, or use a model whose only token-mixing layers are attention"
        )
