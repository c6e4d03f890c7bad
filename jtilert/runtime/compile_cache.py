"""Compile once per machine: two caches in one folder.

- JAX's persistent compilation cache, on by default: a process that compiles a step another process
  has compiled (same model shapes, same jax, same GPU) reads the executable from disk instead.
- The program cache (`programs/` inside that folder): each step's lowered program, exported with
  `jax.export`. JAX's cache is keyed on the lowered module, so without this every process would
  still trace and lower each step (Mosaic-GPU lowering runs in Python, about a second per kernel)
  before finding the executable. A program is keyed by everything that changes it (`program_key`),
  so a second process reads it, lowers a call of it (cheap: no tracing, no kernel lowering) and
  finds the executable in JAX's cache.

A step that is lowered (a miss, or no program cache) first has its Mosaic kernels lowered side by side
in worker processes (`jtilert.pallas.lowering_cache.prelower`).

The folder is `$JTILERT_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/jtilert/xla` (`~/.cache/jtilert/xla`);
`JTILERT_COMPILATION_CACHE=off` turns both caches off, `JTILERT_PROGRAM_CACHE=off` the program cache
alone. A cache folder the user set through JAX (`jax_compilation_cache_dir`) is left as it is.
The key sees what the op table (`jtilert.ops.table.OPS`) runs, so an op replaced there is its own
program; it cannot see other code patched at run time (a monkeypatched function the table does not
name): turn the program cache off there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import pickle
import sys
import warnings
from pathlib import Path

import jax
from jax._src import config as _jax_config

from jtilert.pallas import lowering_cache

OFF = ("off", "0", "none", "")
ENTRY_FORMAT = 1   # bump when what an entry holds changes


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


# --- the program cache -----------------------------------------------------------------------

def programs_folder() -> Path | None:
    """Where exported programs are kept (None: off)."""
    if os.environ.get("JTILERT_PROGRAM_CACHE", "on").strip().lower() in OFF:
        return None
    base = folder()
    return None if base is None else base / "programs"


@functools.cache
def _fixed_key() -> str:
    """What every program's key shares: jtilert's own source files, the versions of Python and of
    the packages that trace and lower the steps (jax, jaxlib and its plugins, flax)."""
    names = sorted((d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions())
    versions = [(n, importlib.metadata.version(n)) for n in names if n.startswith("jax") or n in ("flax", "numpy")]
    return repr((source_digest(Path(__file__).resolve().parent.parent), sys.version_info[:3], versions))


def source_digest(root: Path) -> str:
    """A hash of the Python files under root (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


_NOT_KEYED = ("JTILERT_COMPILATION_CACHE", "JTILERT_PROGRAM_CACHE", "JTILERT_LOWERING_WORKERS",
              "JTILERT_KERNEL_PRECOMPILE")


def _settings() -> tuple:
    """The settings that can change a traced program: jax's config (not its cache or logging
    options) and jtilert's environment variables (the engine switches; not the cache folders, nor
    how the kernels are lowered and compiled)."""
    jax_config = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k and "log" not in k)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("JTILERT_") and k not in _NOT_KEYED)
    return tuple(jax_config), tuple(env)


def _describe(x) -> tuple:
    """An argument as its program sees it: shape, dtype, weak type, sharding and its devices."""
    s = getattr(x, "sharding", None)
    devices = None if s is None else tuple((d.id, d.platform, d.device_kind) for d in s._device_assignment)
    return tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), repr(s), devices


def program_key(identity: tuple, donate: tuple[int, ...], args: tuple, platforms: tuple[str, ...] | None = None) -> str:
    """The key of the program a jitted function makes for `args`. `identity` names the function and
    whatever it closes over (model config, DecodeConfig, mesh...), each part with a deterministic repr."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    platforms = platforms or (jax.default_backend(),)
    parts = (ENTRY_FORMAT, _fixed_key(), _settings(), identity, tuple(donate), platforms, str(treedef),
             tuple(map(_describe, leaves)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


_warned: set[str] = set()


def _warn_once(reason: str, msg: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _read(path: Path) -> jax.export.Exported | None:
    """The exported program of an entry; None if there is none. An unreadable entry is removed (one
    warning) so that it is rebuilt."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn_once("read", f"jtilert: cannot read the compiled-program cache entry {path} ({e}); rebuilding it")
        return None
    try:
        entry = pickle.loads(data)
        if entry["format"] != ENTRY_FORMAT or not isinstance(entry["exported"], jax.export.Exported):
            raise ValueError("not an entry of this format")
        return entry["exported"]
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, the entry is rebuilt
        _drop(path, e)
        return None


def _drop(path: Path, why: BaseException) -> None:
    _warn_once("corrupt", f"jtilert: ignoring a damaged compiled-program cache entry {path} "
                          f"({type(why).__name__}: {why}); rebuilding it")
    try:
        path.unlink()
    except OSError:
        pass


def _write(path: Path, exported: jax.export.Exported) -> None:
    """Store an entry (written whole, then renamed: a reader never sees half of it). A folder that
    cannot be written leaves the program uncached."""
    # `_get_vjp` is a closure (for differentiating the call); the steps are never differentiated
    data = pickle.dumps({"format": ENTRY_FORMAT, "exported": dataclasses.replace(exported, _get_vjp=None)})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        _warn_once("write", f"jtilert: cannot write the compiled-program cache in {path.parent} ({e})")
        tmp.unlink(missing_ok=True)


def lower_kernels(jitted, args: tuple, workers: int | None = None, background: bool | None = None) -> int:
    """Trace `jitted` for `args` (jax keeps the trace for the lowering that follows) and lower its
    Mosaic-GPU kernels in `workers` parallel processes (`lowering_cache.prelower`, which with
    `background` also starts their compile); the kernels lowered (none in interpret mode)."""
    return lowering_cache.prelower(jitted.trace(*args).jaxpr, workers, background)


def export(jitted, args: tuple, platforms: tuple[str, ...] | None = None,
           custom_calls: tuple[str, ...] = ()) -> jax.export.Exported | None:
    """`jitted` traced and lowered for `args` and exported, or None where it cannot be exported
    (e.g. host callbacks, as GPU interpret mode makes: one warning; a tracing error raises again
    when the caller lowers it plainly). `custom_calls`: targets without jax's compatibility
    guarantee that the program may call (ours: an entry is only read by the same versions)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in custom_calls]
    # The kernels as a plain lowering serialises them: the entry is only read by the same jax.
    with _jax_config.export_ignore_forward_compatibility(True):
        try:
            return jax.export.export(jitted, platforms=platforms, disabled_checks=checks)(*args)
        except Exception as e:  # noqa: BLE001 - a step that cannot be exported still compiles as it is
            _warn_once("export", f"jtilert: a step cannot be exported, so it is traced and lowered in every "
                                 f"process ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            return None


def lower_exported(exported: jax.export.Exported, donate: tuple[int, ...], args: tuple,
                   platforms: tuple[str, ...] | None = None, out_shardings=None):
    """The lowered call of an exported program, donating the arguments `donate` names and placing
    the outputs by `out_shardings` (None: as XLA chooses; neither the exported module's donations nor
    its output memory kinds carry over to a call of it)."""
    kw = {} if out_shardings is None else {"out_shardings": out_shardings}
    traced = jax.jit(exported.call, donate_argnums=donate, **kw).trace(*args)
    return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()


def compile_cached(jitted, donate: tuple[int, ...], args: tuple, identity: tuple | None,
                   custom_calls: tuple[str, ...] = (), prepare=None, options: dict | None = None,
                   out_shardings=None):
    """`jitted` (made with `donate_argnums=donate` and `out_shardings`) compiled for `args`: (executable, whether the
    program came from the program cache). `identity`: see `program_key`; None: not cached.
    `prepare(exported)`: run before a cached program is compiled (set-up its tracing would have
    done); False makes it a miss. `options`: XLA compile options (they do not change the lowered
    program, so not its key; JAX's own cache keys them)."""
    options = options or None
    base = programs_folder()
    if identity is None or base is None:
        lower_kernels(jitted, args)
        return jitted.lower(*args).compile(options), False
    path = base / f"{program_key(identity, donate, args)}.jaxexport"
    exported = _read(path)
    if exported is not None and (prepare is None or prepare(exported)):
        try:
            return lower_exported(exported, donate, args, out_shardings=out_shardings).compile(options), True
        except Exception as e:  # noqa: BLE001 - a damaged program: rebuild it (a real error raises again below)
            _drop(path, e)
    lower_kernels(jitted, args)
    exported = export(jitted, args, custom_calls=custom_calls)
    if exported is None:
        return jitted.lower(*args).compile(options), False
    _write(path, exported)
    return lower_exported(exported, donate, args, out_shardings=out_shardings).compile(options), False
