"""An MoE router's load-balancing loss over the whole sequence of a context-parallel group.

Mixtral, Qwen2/3-MoE, OLMoE and the families that copy them add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` to their loss when ``output_router_logits`` is on. The function pools every
layer's routed tokens::

    aux = num_experts * sum_e (T_e / N) * (P_e / N)

with ``T_e`` the top-k assignments to expert ``e``, ``P_e`` the routing probabilities of
``e`` summed over tokens, and ``N`` the (masked) token rows, all summed over layers. It is
nonlinear in sums over the batch: the mean of per-shard losses is a different number (on a
tiny Qwen3-MoE, 2.239 against 2.116). Under CP every rank computes its three sums on its
own tokens, they are summed over the CP group (``P_e`` differentiably, so each token's
gradient is one process's), and every rank finishes the same formula: one process's value.

hf_ring does not import the family's function; it reproduces it. So before a model is
trained, :func:`router_balance_of` runs the family's own ``load_balancing_loss_func`` (from
the model's module) and this reproduction on the same random router logits, with and
without a mask, and refuses the model, naming it, where they differ or where the model has
no such function or names its sizes otherwise: a release that changes the formula is an
error, not a silently different loss.

Part of the transformers integration; must not import hf_ring's training layer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_ring.distributed.collectives import summed_over
from hf_ring.patches import peft as peft_patches

# Where the family's function and the sizes it is called with live (Mixtral's forward:
# load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)).
_FUNCTION = "load_balancing_loss_func"
_SIZES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
_CHECK_TOLERANCE = 1e-5  # relative; float32 sums of 24 rows in two orders differ by ~1e-7
_CHECKED = "_hf_ring_router_balance_checked"


@dataclass(frozen=True)
class RouterBalance:
    """What one model's load-balancing loss needs.

    Attributes:
        num_experts: experts per MoE layer (all of them, not one EP rank's).
        top_k: experts each token is routed to.
        coef: ``router_aux_loss_coef``: the loss the model trains is ``cross-entropy + coef * aux``.
        model: the model's class name, for messages.
    """

    num_experts: int
    top_k: int
    coef: float
    model: str

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{self.model}: num_experts={self.num_experts}, top_k={self.top_k} is no routing")


def _refuse(model_name: str, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"{model_name} adds a router auxiliary loss to its loss (output_router_logits=True, router_aux_loss_coef "
        f"!= 0), which hf_ring computes over the whole sequence only for the load-balancing loss of Mixtral's "
        f"form; {why}. Set config.output_router_logits=False (or router_aux_loss_coef=0.0) to train without it")


def router_balance_of(model: Any) -> Optional[RouterBalance]:
    """The load-balancing loss ``model`` adds to its own, or None when it adds none.

    Raises:
        NotImplementedError: it adds a router loss that :func:`router_balance_loss` does not
            reproduce (checked against the family's own function; see the module docstring).
    """
    inner = peft_patches.base_model(model)
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # FSDP2 puts a class of its own (FSDP<name>, in torch's module) over the model's.
    cls = next((c for c in type(inner).__mro__ if hasattr(sys.modules.get(c.__module__), _FUNCTION)), type(inner))
    name = cls.__name__
    coef = getattr(inner, "router_aux_loss_coef", getattr(inner, "aux_loss_coef", None))
    if coef is None:
        coef = getattr(text, "router_aux_loss_coef", 0.0)
    if not (getattr(text, "output_router_logits", False) and coef):
        return None
    missing = [a for a in _SIZES if not hasattr(inner, a)]
    family = getattr(sys.modules.get(cls.__module__), _FUNCTION, None)
    if missing or family is None:
        lacks = f"no {', '.join(missing)} attribute" if missing else f"no {_FUNCTION} in its module"
        raise _refuse(name, f"{name} has {lacks}")
    balance = RouterBalance(int(inner.num_experts), int(inner.num_experts_per_tok), float(coef), name)
    # Checked once per model and sizes (the trainer's refusals and its loss both ask).
    if inner.__dict__.get(_CHECKED) != balance:
        _check_against(family, balance)
        inner.__dict__[_CHECKED] = balance
    return balance


def _check_against(family: Any, balance: RouterBalance) -> None:
    """Refuse unless :func:`router_balance_loss` equals ``family`` on random router logits of
    two layers, with and without a mask with zeros."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, balance.num_experts, generator=g) for _ in range(2))
    mask = (torch.rand(2, 6, generator=g) > 0.3).long()
    for attention_mask in (None, mask):
        want = float(family(logits, balance.num_experts, balance.top_k, attention_mask))
        got = float(router_balance_loss(logits, balance, attention_mask, group=None, distributed=False))
        if abs(got - want) > _CHECK_TOLERANCE * max(abs(want), 1e-6):
            raise _refuse(balance.model, f"its {_FUNCTION} computes {want:.6g} where hf_ring's reproduction computes "
                                         f"{got:.6g} on the same router logits (mask: {attention_mask is not None})")


def router_balance_loss(
    router_logits: tuple[torch.Tensor, ...],
    balance: RouterBalance,
    attention_mask: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    distributed: bool = True,
) -> torch.Tensor:
    """The load-balancing loss over the whole sequence of ``group`` (without ``coef``).

    Args:
        router_logits: one per MoE layer, float ``(batch * local_seq, num_experts)``: this
            rank's tokens, row-major over ``(batch, local_seq)``.
        balance: the model's sizes (:func:`router_balance_of`).
        attention_mask: None, or int / bool ``(batch, local_seq)``: 1 where a token counts.
        group: the CP group whose ranks hold the rest of the sequence (None: the default group).
        distributed: False: this rank's tokens alone (one process).

    Returns:
        A float32 scalar, the same on every rank of ``group``; differentiable in
        ``router_logits``. Every rank must call it (and run the backward) together.
    """
    device = router_logits[0].device
    counts = torch.zeros(balance.num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(balance.num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in router_logits:
        routing = torch.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(routing, balance.top_k, dim=-1).indices.reshape(-1)
        token_weight = torch.ones(layer.shape[0], device=device) if weight is None else weight
        counts = counts.index_add(0, chosen, token_weight.repeat_interleave(balance.top_k))
        probs = probs + (routing.float() * token_weight[:, None]).sum(0)
        rows = rows + token_weight.sum()
    if distributed and dist.is_available() and dist.is_initialized():
        counts_rows = torch.cat([counts, rows[None]])
        dist.all_reduce(counts_rows, op=dist.ReduceOp.SUM, group=group)
        counts, rows = counts_rows[:-1], counts_rows[-1]
        probs = summed_over(probs, group)
    return (counts / rows * (probs / rows)).sum() * balance.num_experts


__all__ = ["RouterBalance", "router_balance_loss", "router_balance_of"]
