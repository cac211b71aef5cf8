"""Data for TRL's vision-language SFT with the tiny image-text models, made on the spot: a real
Qwen2.5-VL processor (a word-level tokenizer with a chat template, transformers' PIL image
processor at the tiny model's patch sizes) and datasets in TRL's formats, whose images are
the shapes of examples/vlm_data.py (nothing is downloaded).

TRL runs the processor on every batch itself (``DataCollatorForVisionLanguageModeling``), so
what it needs is a ``ProcessorMixin``: ``Qwen2_5_VLProcessor`` (as examples/shapes_processor.py's
``ShapesProcessor``, without a video processor) of a ``PreTrainedTokenizerFast`` and a
``Qwen2VLImageProcessorPil`` (patches of 4 pixels merged 2 x 2: a 32 x 32 image is 16
placeholder tokens). Its chat template marks the assistant's turns with ``{% generation %}``
(TRL's ``assistant_only_loss``). A sample: 1 to 3 images in the user's turn, which asks
``what is shown ?``; the assistant answers with each image's caption (``a red circle on the
left .``), which can be read off the images only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import datasets
import numpy as np
import PIL.Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from shapes_processor import ShapesProcessor
from vlm_data import COLORS, PLACES, SHAPES, WORDS, draw
from vlm_models import IMAGE

SPECIAL_TOKENS = ("<pad>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|image_pad|>", "<|video_pad|>",
                  "<|vision_start|>", "<|vision_end|>")
QUESTION = "what is shown ?"
FORMATS = ("messages", "prompt_completion")
# TRL's prepare_multimodal_messages turns every content into parts: {"type": "image"} or {"type": "text"}.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %} {{ part['text'] }}{% endif %}{% endfor %}"
    " <|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %} {{ part['text'] }}{% endif %}"
    "{% endfor %} <|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def shapes_processor() -> ShapesProcessor:
    """The tiny processor: special tokens, then the captions' words (split on spaces)."""
    words = dict.fromkeys((*WORDS, *QUESTION.split()))
    vocab = {w: i for i, w in enumerate((*SPECIAL_TOKENS, *words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|end|>")
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, do_resize=False)
    return ShapesProcessor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


@dataclass(frozen=True)
class TokenIds:
    """The processor's token ids under the names examples/vlm_models.py's configs read."""

    vocab_size: int
    pad_token_id: int
    eos_token_id: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    bos_token_id: None = None

    def __len__(self) -> int:
        return self.vocab_size


def token_ids(processor: ShapesProcessor) -> TokenIds:
    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    return TokenIds(len(tok), tok.pad_token_id, tok.eos_token_id, processor.image_token_id, processor.video_token_id,
                    ids("<|vision_start|>"), ids("<|vision_end|>"))


def _image(shape: str, color: str, place: str) -> PIL.Image.Image:
    pixels = draw(shape, color, PLACES[place], IMAGE).permute(1, 2, 0).numpy()  # (H, W, 3) in [0, 1]
    return PIL.Image.fromarray((pixels * 255).round().astype(np.uint8))


def sft_vlm_dataset(fmt: str, num_examples: int, seed: int) -> datasets.Dataset:
    """``num_examples`` samples of 1 to 3 images in one of TRL's vision formats.

    ``messages``: conversations (the images go into the user's turn); ``prompt_completion``:
    the user's turn as prompt, the assistant's as completion (completion-only loss by TRL's
    default). Both keep the images in an ``images`` column of PIL images.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; use one of {FORMATS}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        drawn = [(rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(list(PLACES)))
                 for _ in range(rng.randint(1, 3))]
        answer = " ".join(f"a {color} {shape} on the {place} ." for shape, color, place in drawn)
        user, assistant = {"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}
        row = {"images": [_image(*d) for d in drawn]}
        turns = {"messages": [user, assistant]} if fmt == "messages" else {"prompt": [user], "completion": [assistant]}
        row.update(turns)
        rows.append(row)
    return datasets.Dataset.from_list(rows)
