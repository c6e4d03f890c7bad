"""Regenerate models/tiny/data/python_reference.txt: an excerpt of the Python Language Reference
as shipped inside CPython itself (`pydoc_data/topics.py`, the text behind `help("if")`).

The text is part of the Python documentation, Copyright (c) 2001-2023 Python Software Foundation,
distributed with CPython under the PSF License Agreement (see data/LICENSE-PSF.txt). Run with the
CPython 3.12.1 used for the committed file to reproduce it byte for byte:

    python models/tiny/make_data.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# Prose-heavy topics of the language reference, in this order, until the size cap.
TOPICS = ("if", "while", "for", "try", "with", "function", "class", "assignment", "augassign", "naming",
          "execmodel", "import", "exceptions", "calls", "lambda", "booleans", "comparisons", "truth",
          "return", "yield", "raise", "break", "continue", "global", "nonlocal", "del", "pass", "assert",
          "customization", "attribute-access", "context-managers", "sequence-types", "numeric-types",
          "identifiers", "integers", "floating", "strings", "dict", "lists", "typesmapping", "typesseq")
CAP = 25_000  # bytes


def build(cap: int = CAP) -> str:
    from pydoc_data.topics import topics

    parts, size = [], 0
    for name in TOPICS:
        text = "\n".join(line.rstrip() for line in topics[name].strip().splitlines()) + "\n\n\n"
        if size + len(text.encode()) > cap:
            break
        parts.append(text)
        size += len(text.encode())
    return "".join(parts)


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "data" / "python_reference.txt"
    text = build(int(sys.argv[1]) if len(sys.argv) > 1 else CAP)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.encode())} bytes, Python {sys.version.split()[0]})")
