"""Tokenizers: a character-level one for the built-in tasks (fits the tiny models' 64 ids) and a
Hugging Face tokenizer from a local directory for real checkpoints."""

from __future__ import annotations

import os
import string
from pathlib import Path

PAD_ID, EOS_ID = 0, 1
CHARS = string.digits + string.ascii_lowercase + "+-*=:;,. ?!()<>|#@"  # 54 symbols, ids 2..55


class CharTokenizer:
    pad_token_id, eos_token_id = PAD_ID, EOS_ID

    def __init__(self, chars: str = CHARS):
        self.chars = chars
        self.vocab_size = len(chars) + 2
        self._id = {c: i + 2 for i, c in enumerate(chars)}

    def encode(self, text: str, where: str = "text") -> list[int]:
        bad = sorted({c for c in text if c not in self._id})
        if bad:
            raise ValueError(f"{where}: characters {bad!r} are not in the char tokenizer's alphabet {self.chars!r}")
        return [self._id[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i - 2] if 2 <= i < self.vocab_size else "" for i in ids)


class HFTokenizer:
    """A tokenizer loaded from a local directory (tokenizer.json etc.); no hub access."""

    def __init__(self, path: str | os.PathLike):
        if not Path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.vocab_size = len(self.tok)

    def encode(self, text: str, where: str = "text") -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def make_tokenizer(path: str | None):
    return HFTokenizer(path) if path else CharTokenizer()
