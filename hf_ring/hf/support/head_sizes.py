"""Detector: attention whose value heads are of another size than its query / key heads
(multi-head latent attention, DeepSeek-V2/V3 style). The ring carries K and V blocks of one
head size, so such a model is refused under CP and on packed rows.

Owns: ``refusals``. Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator

from hf_ring.hf.support.reading import Modules, layer_configs


def refusals(config: Any, modules: Modules) -> Iterator[str]:
    """One refusal (formatted with ``{where}``) for the first V / QK head size that differ,
    from the config (per layer where it is per layer) or the attention modules' own sizes."""
    pairs = []
    names = ("v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "head_dim")
    for layer in layer_configs(config, names):
        v, nope, rope = layer.get("v_head_dim"), layer.get("qk_nope_head_dim"), layer.get("qk_rope_head_dim")
        qk = nope + rope if nope is not None and rope is not None else layer.get("qk_head_dim")
        qk = qk if qk is not None else layer.get("head_dim")
        pairs.append((v, qk, "config.v_head_dim", "the Q/K head size (qk_nope_head_dim + qk_rope_head_dim)"))
    # The attention modules' own sizes, for configs that name them otherwise.
    for path, m in modules:
        mv, mqk = getattr(m, "v_head_dim", None), getattr(m, "qk_head_dim", None)
        if isinstance(mv, int) and isinstance(mqk, int):
            pairs.append((mv, mqk, f"{path}.v_head_dim", "its qk_head_dim"))
    for v, qk, v_name, qk_name in pairs:
        if isinstance(v, int) and isinstance(qk, int) and v != qk:
            yield (
                f"multi-head latent attention (DeepSeek-V2/V3 style): {v_name}={v} differs from "
                f"{qk_name}={qk}; the ring takes K and V of one head size, so {{where}} ring_flash cannot "
                "run this model. Train it without context parallelism and without packed rows"
            )
            return
