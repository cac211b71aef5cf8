"""The runners put in place of the modeling modules' mixing functions (the short causal
convolution, the gated delta rule, Kimi delta attention, the Mamba-2 and Mamba-1 scans):
under CP the ops of :mod:`hf_ring.mixers` on this rank's tokens, on packed rows without CP
the original once per document, otherwise the original unchanged.

Part of :mod:`hf_ring.hf.mixers` (whose docstring says why); the layers' forwards are in
``layers.py``. Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hf_ring.hf.forward_context import ForwardContext
from hf_ring.hf.mixers.layers import _ACTIVE, _active, _where
from hf_ring.mixers import (
    context_parallel_causal_conv1d,
    context_parallel_gated_delta_rule,
    context_parallel_kimi_delta_attention,
    context_parallel_selective_scan,
    context_parallel_ssd,
)
from hf_ring.patterns.cached import columns_of_rows


def _local_docs(context: ForwardContext) -> Optional[list[int]]:
    if context.placement is not None:  # the sharded documents alone: the front of the row
        return [n // context.cp_size for n in context.placement.sharded_lens]
    return None if context.doc_lens is None else [n // context.cp_size for n in context.doc_lens]


def _cp_args(context: ForwardContext) -> dict:
    # Packed rows are zigzag-sharded per document whatever the state's layout (as the ring).
    layout = "zigzag" if context.doc_lens is not None else context.state.layout
    return dict(group=context.state.cp_group, layout=layout, local_doc_lens=_local_docs(context))


def _cp_or_placed(context: ForwardContext, dim: int, cp_call: Callable[[Callable], torch.Tensor],
                  alone: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """Under CP: ``cp_call(cut)`` runs the CP op (``cut(t)``: ``t`` as the op takes it). On a
    row placed by length (hf_ring.sharding.placement) the op takes the front only (``cut``
    narrows along ``dim`` to the sharded documents' tokens), and each document this rank
    holds whole runs alone, ``alone(start, end)`` on its tokens of the row: its convolution
    and recurrent state never leave the rank. Concatenated along ``dim``."""
    placement = context.placement
    if placement is None:
        return cp_call(lambda t: t)
    front = placement.sharded_local_len
    parts = [cp_call(lambda t: None if t is None else t.narrow(dim, 0, front))] if front else []
    start = front
    for n in placement.whole_lens(context.state.cp_rank):
        parts.append(alone(start, start + n))
        start += n
    return torch.cat(parts, dim=dim)


def _per_document(context: ForwardContext, run: Callable[[int, int], torch.Tensor], dim: int) -> torch.Tensor:
    """Packed rows without CP: ``run(start, end)`` on each document's tokens, concatenated."""
    starts = [sum(context.doc_lens[:i]) for i in range(len(context.doc_lens))]
    return torch.cat([run(s, s + n) for s, n in zip(starts, context.doc_lens)], dim=dim)


def _refuse_state(context: ForwardContext, what: str, given: bool) -> None:
    if given:
        raise NotImplementedError(
            f"{what} got a recurrent state {_where(context)}; hf_ring runs it from a zero state per "
            "row (per document on packed rows): pass use_cache=False"
        )


def run_conv(original, hidden_states: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **kwargs):
    """``causal_conv1d_fn``: hidden_states ``(batch, channels, local_seq)``, weight
    ``(channels, width)``; returns ``(batch, channels, local_seq)``."""
    active = _active("causal_conv1d_fn", kwargs)
    if active is None:
        return original(hidden_states, weight, bias, activation=activation, **kwargs)
    context, layer = active
    if context.generation is not None and hidden_states.shape[-1] != context.generation.cache.step.columns.numel():
        # The cache padded a shard shorter than the kernel on its left (every rank alike: all raise).
        raise NotImplementedError(
            f"a convolution of width {weight.shape[-1]} under generation {_where(context)} got a shard of "
            f"{context.generation.cache.step.columns.numel()} tokens, shorter than its width; generate from a "
            "longer prompt or with fewer ranks"
        )
    if context.state is not None:
        out = _cp_or_placed(
            context, -1,
            lambda cut: context_parallel_causal_conv1d(cut(hidden_states), weight, bias, activation=activation,
                                                       **_cp_args(context)),
            lambda s, e: original(hidden_states[..., s:e], weight, bias, activation=activation))
        if context.generation is not None:
            context.generation.conv_tails[layer] = _rows_tail(context, hidden_states, weight.shape[-1])
    else:
        out = _per_document(context, lambda s, e: original(hidden_states[..., s:e], weight, bias,
                                                           activation=activation), -1)
    context.ran_mixers.add((layer, "causal_conv1d_fn"))
    return out


def _rows_tail(context: ForwardContext, x: torch.Tensor, width: int) -> torch.Tensor:
    """A generation prefill's convolution state: each row's last ``width`` inputs, ``(batch,
    channels, width)``, put together on every rank (one all-reduce: each column is held by
    one rank, zero elsewhere; before a row's start, zero, as the model pads a short row). ``x``:
    this rank's inputs ``(batch, channels, local_seq)``, whose columns the cache's step names."""
    step = context.generation.cache.step
    tail = columns_of_rows(x.transpose(1, 2), step.columns, step.row_lengths - width, width, context.state.cp_group)
    return tail.transpose(1, 2)


def _delta_rule_runner(name: str, what: str, cp_op: Callable) -> Callable:
    """The runner of a delta-rule function (``name``: the gated delta rule, Kimi delta
    attention): query, key ``(batch, local_seq, heads, k_dim)``, value ``(batch, local_seq,
    heads, v_dim)``, beta ``(batch, local_seq, heads)``, g ``(batch, local_seq, heads)`` (one
    decay per head) or ``(..., heads, k_dim)`` (per channel); returns ``(out (batch,
    local_seq, heads, v_dim), None)``."""

    def run(original, query, key, value, g=None, beta=None, chunk_size=64, initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        active = _active(name, kwargs)
        if active is None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        context, layer = active
        prefill = context.generation is not None and name == "torch_chunk_gated_delta_rule"
        _refuse_state(context, what, initial_state is not None or (output_final_state and not prefill))
        if prefill:
            # A generation prefill: each row's padding columns (behind its prompt) leave the state
            # as it is (no decay, no write), so the state after the row is its prompt's.
            valid = context.generation.cache.step.valid.to(g.device)  # (batch, local_seq)
            g = g * valid.view(*valid.shape, *([1] * (g.dim() - 2)))
            beta = beta * valid.view(*valid.shape, *([1] * (beta.dim() - 2)))
        if kwargs.get("cu_seqlens") is not None and context.doc_lens is None:
            raise NotImplementedError(
                f"{what} got cu_seqlens {_where(context)} on a row hf_ring's guard did not validate as "
                "packed; pass packed rows as RingDataCollator makes them (cu_seq_lens_q/k, "
                "max_length_q/k and per-document position_ids)"
            )
        if context.state is not None and context.placement is not None:
            out = _cp_or_placed(
                context, 1,
                lambda cut: cp_op(cut(query), cut(key), cut(value), cut(g), cut(beta), chunk_size=chunk_size,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **_cp_args(context))[0],
                lambda s, e: original(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                      chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0])
        elif context.state is not None:
            out, final = cp_op(query, key, value, g, beta, chunk_size=chunk_size,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output_final_state=prefill,
                               **_cp_args(context))
            if prefill:
                context.ran_mixers.add((layer, name))
                return out, final  # float32, as transformers' own chunked rule returns it
        else:
            out = _per_document(context, lambda s, e: original(
                query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], chunk_size=chunk_size,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0], 1)
        context.ran_mixers.add((layer, name))
        return out, None

    return run


def run_ssd(original, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """``mamba2_chunk_scan``: hidden_states ``(batch, local_seq, heads, head_dim)``, dt
    ``(batch, local_seq, heads)``, A ``(heads,)``, B and C ``(batch, local_seq, groups,
    state)``; returns float32 ``(batch, local_seq, heads, head_dim)``."""
    active = _active("mamba2_chunk_scan", kwargs)
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if active is None:
        return original(hidden_states, dt, A, B, C, chunk_size, initial_states=initial_states,
                        return_final_states=return_final_states, **options, **kwargs)
    context, layer = active
    _refuse_state(context, "the Mamba-2 scan", initial_states is not None or return_final_states)
    if kwargs.get("z") is not None:
        raise NotImplementedError(
            f"the Mamba-2 scan got a gate z {_where(context)}: transformers' torch scan ignores it while "
            "the mamba-ssm kernel applies it, so hf_ring cannot tell which one the model means; report the model"
        )
    if context.state is not None:
        out = _cp_or_placed(
            context, 1,
            lambda cut: context_parallel_ssd(cut(hidden_states), cut(dt), A, cut(B), cut(C), chunk_size=chunk_size,
                                             **options, **_cp_args(context))[0],
            lambda s, e: original(hidden_states[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], chunk_size, **options))
    else:
        out = _per_document(context, lambda s, e: original(
            hidden_states[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], chunk_size, **options), 1)
    context.ran_mixers.add((layer, "mamba2_chunk_scan"))
    return out


def run_selective_scan(original, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                       delta_softplus=False, return_last_state=False, **kwargs):
    """``mamba_selective_scan`` (Mamba-1), channels first: hidden_states, dt and z ``(batch,
    channels, local_seq)``, A ``(channels, state)``, B and C ``(batch, state, local_seq)``;
    returns ``(batch, channels, local_seq)``."""
    active = _active("mamba_selective_scan", kwargs)
    options = dict(D=D, delta_bias=delta_bias, delta_softplus=delta_softplus)
    if active is None:
        return original(hidden_states, dt, A, B, C, z=z, return_last_state=return_last_state, **options, **kwargs)
    context, layer = active
    _refuse_state(context, "the Mamba selective scan", return_last_state)
    if context.state is not None:
        out = _cp_or_placed(
            context, -1,
            lambda cut: context_parallel_selective_scan(cut(hidden_states), cut(dt), A, cut(B), cut(C), z=cut(z),
                                                        **options, **_cp_args(context))[0],
            lambda s, e: original(hidden_states[..., s:e], dt[..., s:e], A, B[..., s:e], C[..., s:e],
                                  z=None if z is None else z[..., s:e], **options, **kwargs))
    else:
        out = _per_document(context, lambda s, e: original(
            hidden_states[..., s:e], dt[..., s:e], A, B[..., s:e], C[..., s:e],
            z=None if z is None else z[..., s:e], **options, **kwargs), -1)
    context.ran_mixers.add((layer, "mamba_selective_scan"))
    return out


def run_fused(original, *args, **kwargs):
    """A fused whole-layer GPU shortcut: declined (None) under CP and on packed rows, so the
    layer takes its split path through the functions above."""
    if _ACTIVE.get() is not None:
        return None
    return original(*args, **kwargs)


# The runner of each routed module function.
RUNNERS: dict[str, Callable] = {
    "causal_conv1d_fn": run_conv,
    "torch_chunk_gated_delta_rule": _delta_rule_runner(
        "torch_chunk_gated_delta_rule", "the gated delta rule", context_parallel_gated_delta_rule),
    "chunk_kimi_delta_attention": _delta_rule_runner(
        "chunk_kimi_delta_attention", "Kimi delta attention", context_parallel_kimi_delta_attention),
    "mamba2_chunk_scan": run_ssd,
    "mamba_selective_scan": run_selective_scan,
    "mamba2_split_conv1d_scan_combined": run_fused,
    "mamba_inner_fn": run_fused,
}

