"""Tokenizers: UTF-8 bytes for the embedded tiny model, an HF `tokenizer.json` for real checkpoints."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from jtilert.store.checkpoint import resolve


class ByteTokenizer:
    """Token id = byte value (vocab 256)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self):
        """An incremental decoder: feed ids one at a time, get text as soon as it is complete UTF-8."""
        d = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: d.decode(bytes(ids))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decoder(self):
        ids: list[int] = []
        state = {"text": ""}

        def feed(new):
            ids.extend(new)
            text = self.tok.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
                return ""
            out, state["text"] = text[len(state["text"]):], text
            return out
        return feed

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def load_tokenizer(folder: str | Path):
    """The tokenizer stored with a checkpoint: `tokenizer.json`, or bytes if its jtilert.json says so."""
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        return HFTokenizer(folder / "tokenizer.json")
    meta = folder / "jtilert.json"
    if meta.exists() and json.loads(meta.read_text()).get("tokenizer") == "bytes":
        return ByteTokenizer()
    raise FileNotFoundError(f"no tokenizer for {folder} (no tokenizer.json; jtilert.json does not say 'bytes')")


def tokenizer(source: str | Path):
    """The tokenizer of what `jtilert.load(source)` loads: an embedded preset ("tiny"), a jtilert
    checkpoint or an HF folder."""
    return load_tokenizer(resolve(source))
