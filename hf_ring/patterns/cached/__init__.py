"""Attention against a key/value cache held by a context-parallel group: a decode step's
queries against every rank's entries, merged exactly (``decode``), and the entries gathered
onto every rank in global order (``gather``).

Must not import transformers, accelerate, or hf_ring's integration, memory or training
layers.
"""

from hf_ring.patterns.cached.decode import cached_attention, visible_entries
from hf_ring.patterns.cached.gather import columns_of_rows, gathered_in_order

__all__ = ["cached_attention", "columns_of_rows", "gathered_in_order", "visible_entries"]
