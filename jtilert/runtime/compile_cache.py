"""JAX's persistent compilation cache, on by default: a process that compiles a step another process
has compiled (same model shapes, same jax, same GPU) reads the executable from disk instead.

The folder is `$JTILERT_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/jtilert/xla` (`~/.cache/jtilert/xla`);
`JTILERT_COMPILATION_CACHE=off` turns it off. A cache folder the user set through JAX
(`jax_compilation_cache_dir`) is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

OFF = ("off", "0", "none", "")


def folder() -> Path | None:
    """The cache folder jtilert uses (None: off)."""
    value = os.environ.get("JTILERT_COMPILATION_CACHE")
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jtilert" / "xla"


def enable() -> Path | None:
    """Turn the cache on (once per process, before the first compilation is best); returns its folder."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    path = folder()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:   # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    # every step is worth keeping: the small ones are what a notebook recompiles most
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
