"""Tokenizers written locally for the tiny pipelines: nothing is downloaded.

Each is the real transformers class the family's pipeline expects, over a vocabulary of single
characters (CLIP and Qwen2: the 256 bytes, as byte-level BPE sees them; T5: printable characters),
so any prompt tokenizes and the real `from_pretrained` code reads them back.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"
QWEN_PAD = "<|endoftext|>"
# The chat markers of Qwen-Image's prompt template (QwenImagePipeline.prompt_template_encode).
QWEN_CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# The vision markers Qwen2.5-VL's processor expands an image into (Qwen-Image-Edit's prompt template).
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# A chat template (Jinja) with the layout of Qwen3's for text messages: each message between the
# chat markers, then the assistant's turn when asked for; `enable_thinking=False` adds the empty
# thinking block, as Qwen3's own template does. Z-Image's pipeline calls it with thinking enabled.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

# A chat template (Jinja) over messages whose content is a string or a list of text parts (joined),
# as FLUX.2 [dev]'s and Qwen-Image 2.1's pipelines build their messages; each message between the
# chat markers, then the assistant's turn when asked for.
CONTENT_LIST_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    """The byte-to-printable-character table that byte-level BPE vocabularies (GPT-2, CLIP) use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def clip_tokenizer():
    """A `CLIPTokenizer` whose tokens are single bytes (no merges); 77 tokens long, as CLIP's."""
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for char in _byte_to_unicode().values():
        vocab[char] = len(vocab)
    for char in _byte_to_unicode().values():
        vocab[char + "</w>"] = len(vocab)  # CLIP marks the last character of a word
    vocab[CLIP_BOS] = len(vocab)
    vocab[CLIP_EOS] = len(vocab)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "vocab.json").write_text(json.dumps(vocab))
        (Path(folder) / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(
            str(Path(folder) / "vocab.json"),
            str(Path(folder) / "merges.txt"),
            bos_token=CLIP_BOS,
            eos_token=CLIP_EOS,
            pad_token=CLIP_EOS,
            unk_token=CLIP_EOS,
            model_max_length=77,
        )


def t5_tokenizer():
    """A `T5Tokenizer` (Unigram, as T5's) over printable characters, with and without the
    word-start marker."""
    from transformers import T5Tokenizer

    characters = [c for c in string.printable if not c.isspace()]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in characters] + [("\u2581" + c, -3.0) for c in characters]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def qwen2_tokenizer():
    """A `Qwen2Tokenizer` whose tokens are single bytes, plus the chat markers of Qwen-Image's
    prompt template."""
    from transformers import Qwen2Tokenizer

    vocab = {char: index for index, char in enumerate(_byte_to_unicode().values())}
    vocab[QWEN_PAD] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_CHAT_TOKENS)})
    return tokenizer


def qwen25_vl_tokenizer():
    """`qwen2_tokenizer()` plus the vision markers, for a Qwen2.5-VL that reads images with the
    prompt (Qwen-Image-Edit's processor puts them around an image's tokens)."""
    tokenizer = qwen2_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_CHAT_TOKENS + QWEN_VISION_TOKENS)})
    return tokenizer


def qwen3_tokenizer():
    """`qwen2_tokenizer()` (Qwen3 ships the same `Qwen2Tokenizer`) with a chat template for the
    pipelines that format prompts through `apply_chat_template` (Z-Image)."""
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def content_list_tokenizer():
    """`qwen2_tokenizer()` with `CONTENT_LIST_CHAT_TEMPLATE` (FLUX.2 [dev]'s tiny text: the pipeline
    formats its prompts through the tokenizer's `apply_chat_template`)."""
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = CONTENT_LIST_CHAT_TEMPLATE
    return tokenizer


def gemma_tokenizer():
    """A `GemmaTokenizer` whose tokens are single printable characters and the word-start marker
    (LTX-2's text encoder is Gemma 3)."""
    from transformers import GemmaTokenizer

    vocab = {token: index for index, token in enumerate(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\u2581"))}
    for character in string.printable:
        if not character.isspace():
            vocab.setdefault(character, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[])
