"""Qwen2.5-VL's processor without a video processor, in a module of its own so that a saved
checkpoint can carry it as its processor code.

transformers' video processors need torchvision, which the examples do not; a checkpoint whose
processor is this class names it in ``auto_map`` with this file beside it, and
``AutoProcessor.from_pretrained(dir, trust_remote_code=True)`` loads it from there (the
example's ``--trust_remote_code``). Because transformers copies only this file into its
module cache, it must import nothing but transformers: no sibling example module.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLProcessor


class ShapesProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor of a tokenizer and an image processor only: its ``__init__`` names
    no video processor, so neither ``from_pretrained`` nor ``save_pretrained`` looks for one."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
