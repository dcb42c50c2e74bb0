"""The trainer's built-in byte tokenizer (``trainer.data.ByteTokenizer``: ids 0-255 are UTF-8 bytes,
256 BOS ``<s>``, 257 EOS ``</s>``) as Hugging Face tokenizer files, so an export of a run that used it
works with ``AutoTokenizer`` and ``pipeline("text-generation")``.

The ``tokenizer.json`` is a BPE model without merges whose 256 tokens are the bytes ``<0x00>`` ..
``<0xFF>`` with byte fallback (the encoding Llama's sentencepiece tokenizers use for bytes), so every
text encodes to exactly its UTF-8 bytes; a template adds BOS in front, as the trainer does.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from ..data import ByteTokenizer

BOS, EOS = "<s>", "</s>"


def byte_tokenizer_files() -> tuple[dict[str, bytes], SimpleNamespace]:
    """``({"tokenizer.json": ..., "tokenizer_config.json": ...}, ids)`` with ``ids.bos_id``/``eos_id``;
    ImportError without the ``tokenizers`` package."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    ids = ByteTokenizer()
    tokenizer = Tokenizer(models.BPE(vocab={f"<0x{b:02X}>": b for b in range(256)}, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    if (tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)) != (ids.bos_id, ids.eos_id):
        raise AssertionError("the byte tokenizer's special ids moved")  # guards the trainer's numbering
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, ids.bos_id)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "model_max_length": None}
    files = {"tokenizer.json": tokenizer.to_str().encode(),
             "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}
    return files, SimpleNamespace(bos_id=ids.bos_id, eos_id=ids.eos_id)
