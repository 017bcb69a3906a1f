"""Tokenizers: `tokenizer.json` through the `tokenizers` library, else byte-level."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    eos_token_id: int | None
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; ids >= 256 are specials (decoded to nothing)."""

    def __init__(self, bos_token_id: int | None = 256, eos_token_id: int | None = 257) -> None:
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json (no special tokens added on encode)."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_id: int | None) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> ByteTokenizer | HFTokenizer:
    """The folder's tokenizer.json if present, else a ByteTokenizer; ids from config.json."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = cfg.get("bos_token_id")
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json", bos, eos)
    return ByteTokenizer(bos, eos)
