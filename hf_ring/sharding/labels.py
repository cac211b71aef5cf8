"""The label of a position without a target.

``-100`` is ``torch.nn.functional.cross_entropy``'s default ``ignore_index`` and what the
Hugging Face models and TRL write for padding, prompts and a row's last token. The
collator shifts labels on the full sequence and marks such positions with it before it
shards them; every loss (the token loss, the chunked LM-head loss) skips them. Kept in
the lowest layer so that the data, memory and training code share one value.

Must not import torch.distributed or any other layer of hf_ring.
"""

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX"]
