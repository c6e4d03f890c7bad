"""Loading the engine library, registering its XLA FFI targets, group set-up."""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import numpy as np

from jtilert.ffi import build as _build

# dtype codes of cuda/include/jtilert/engine.h
JT_F32, JT_BF16, JT_F16, JT_F8E4M3 = 0, 1, 2, 3
AR_ONESHOT, AR_TWOSHOT = 0, 1
MAX_WORLD = 8
NO_GPU = "no GPU backend"   # load()'s reason on a machine without a GPU, where falling back is expected

TARGETS = {
    "jtilert_all_reduce": "JtAllReduce",
    "jtilert_gemv_all_reduce": "JtGemvAllReduce",
    "jtilert_merge_topk": "JtMergeTopk",
    "jtilert_topk_select": "JtTopkSelect",
    "jtilert_route_select": "JtRouteSelect",
    "jtilert_norm_route": "JtNormRoute",
    "jtilert_moe_decode": "JtMoeDecode",
    "jtilert_prefetch_l2": "JtPrefetchL2",
    "jtilert_token_ring": "JtTokenRing",
    "jtilert_expert_down_all_reduce": "JtExpertDownAllReduce",
    # stacked [L, ...] weights + the layer index operand (ops.py, STACKED_SUFFIX)
    "jtilert_gemv_all_reduce_stacked": "JtGemvAllReduceStacked",
    "jtilert_expert_down_all_reduce_stacked": "JtExpertDownAllReduceStacked",
}

_lock = threading.RLock()
_state: dict = {}
_warned: set[str] = set()


def warn_once(key: str, msg: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 3) -> None:
    """One warning per reason for the whole process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(msg, category, stacklevel=stacklevel)


def payload_cap() -> int:
    """Largest message (bytes per rank) one engine call may carry."""
    return int(os.environ.get("JTILERT_FFI_MAX_BYTES", str(1 << 20)))


def timeout_ms() -> int:
    return int(os.environ.get("JTILERT_FFI_TIMEOUT_MS", "30000"))


class Lib:
    """ctypes view of libjtilert_engine.so."""

    def __init__(self, path: str):
        self.path = path
        self.dll = d = ctypes.CDLL(path)
        c_int, c_int64, p_int = ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)
        d.jt_device_count.restype = c_int
        d.jt_sm_count.argtypes = [c_int]
        d.jt_sm_count.restype = c_int
        d.jt_can_access_peers.argtypes = [p_int, c_int, ctypes.c_char_p, c_int]
        d.jt_can_access_peers.restype = c_int
        d.jt_prepare_device.argtypes = [c_int, ctypes.c_char_p, c_int]
        d.jt_prepare_device.restype = c_int
        d.jt_group_create.argtypes = [p_int, c_int, c_int64, c_int64, ctypes.c_char_p, c_int]
        d.jt_group_create.restype = c_int
        d.jt_group_find.argtypes = [p_int, c_int]
        d.jt_group_find.restype = c_int
        d.jt_group_payload_cap.argtypes = [c_int]
        d.jt_group_payload_cap.restype = c_int64
        d.jt_group_status.argtypes = [c_int, c_int, ctypes.c_void_p]
        d.jt_group_status.restype = c_int
        d.jt_merge_topk_max_k.argtypes = [c_int, c_int]
        d.jt_merge_topk_max_k.restype = c_int
        d.jt_topk_prepare.argtypes = [c_int, c_int64, ctypes.c_char_p, c_int]
        d.jt_topk_prepare.restype = c_int
        d.jt_topk_select_ctas.argtypes = [c_int] * 6
        d.jt_topk_select_ctas.restype = c_int
        d.jt_version.restype = ctypes.c_char_p
        d.jt_token_ring.argtypes = [c_int, ctypes.c_char_p, c_int]
        d.jt_token_ring.restype = ctypes.c_void_p
        self._prepared: set[int] = set()
        self._select_ready: set[int] = set()
        self._groups: dict[tuple[int, ...], int] = {}

    @staticmethod
    def _ints(xs):
        arr = (ctypes.c_int * len(xs))(*[int(v) for v in xs])
        return arr

    def device_count(self) -> int:
        return int(self.dll.jt_device_count())

    def sm_count(self, dev: int) -> int:
        return int(self.dll.jt_sm_count(dev))

    def merge_topk_max_m(self, dev: int, world: int) -> int:
        return int(self.dll.jt_merge_topk_max_k(dev, world))

    def prepare(self, dev: int) -> None:
        with _lock:
            if dev in self._prepared:
                return
            err = ctypes.create_string_buffer(512)
            if self.dll.jt_prepare_device(dev, err, 512) != 0:
                raise RuntimeError(err.value.decode())
            self._prepared.add(dev)

    def prepare_select(self, dev: int) -> None:
        """Allocates (once) device ``dev``'s top-k scratch."""
        with _lock:
            if dev in self._select_ready:
                return
            err = ctypes.create_string_buffer(512)
            if self.dll.jt_topk_prepare(dev, timeout_ms(), err, 512) != 0:
                raise RuntimeError(err.value.decode())
            self._select_ready.add(dev)

    def topk_ctas(self, dev: int, t: int, n: int, k: int, mode: int, ctas: int = 0) -> int:
        """CTAs per row of the top-k launch (``ctas`` asked for, 0: the default), or -1 if the
        shape is not supported."""
        return int(self.dll.jt_topk_select_ctas(dev, t, n, k, mode, ctas))

    def token_ring(self, dev: int) -> int:
        """The host address of device ``dev``'s token ring (cuda/src/ring.cu), allocated once."""
        err = ctypes.create_string_buffer(512)
        addr = self.dll.jt_token_ring(dev, err, 512)
        if not addr:
            raise RuntimeError(err.value.decode())
        return int(addr)

    def group(self, devices: tuple[int, ...]) -> int:
        """Creates (once) the group of these local device ids; returns its id."""
        with _lock:
            gid = self._groups.get(devices)
            if gid is not None:
                return gid
            for dv in devices:
                self.prepare(dv)
            err = ctypes.create_string_buffer(512)
            gid = self.dll.jt_group_create(self._ints(devices), len(devices), payload_cap(),
                                           timeout_ms(), err, 512)
            if gid < 0:
                raise RuntimeError(err.value.decode())
            self._groups[devices] = gid
            return gid

    def status(self, gid: int, rank: int) -> dict:
        buf = (ctypes.c_uint32 * 8)()
        if self.dll.jt_group_status(gid, rank, buf) != 0:
            raise ValueError("no such group/rank")
        v = list(buf)
        return {"code": v[0], "rank": v[1], "src": v[2], "epoch": v[3],
                "line": v[4] | (v[5] << 32), "op": v[6] | (v[7] << 32)}


def _gpu_present() -> bool:
    import jax  # noqa: PLC0415

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def load() -> tuple[Lib | None, str]:
    """The loaded library (FFI targets registered) or None and the reason."""
    with _lock:
        if "lib" in _state:
            return _state["lib"], _state["why"]
        lib, why = None, ""
        try:
            lib, why = _load_uncached()
        except Exception as e:  # noqa: BLE001 - any failure means: fall back
            lib, why = None, f"{type(e).__name__}: {e}"
        _state["lib"], _state["why"] = lib, why
        return lib, why


def load_prepared() -> tuple[Lib | None, str]:
    """`load`, with every local GPU prepared (the kernels' shared-memory limits raised): for a custom
    call's lowering, which runs in the main thread before XLA runs anything. (None, reason) on a failure."""
    import jax  # noqa: PLC0415

    lib, why = load()
    if lib is None:
        return None, why
    try:
        for d in jax.local_devices(backend="gpu"):
            lib.prepare(int(d.local_hardware_id))
    except Exception as e:  # noqa: BLE001 - any failure means: fall back
        return None, f"{type(e).__name__}: {e}"
    return lib, ""


def register_targets() -> Lib:
    """Builds (if needed) and loads the library and registers its FFI targets for CUDA without a GPU,
    and makes `load` return it: for compiling programs for a GPU on a machine without one
    (bench/xla_kernels.py). The library's functions are never called there."""
    with _lock:
        lib = _register(Lib(str(_build.find_library() or _build.build())))
        _state["lib"], _state["why"] = lib, ""
        return lib


def _register(lib: Lib) -> Lib:
    """Registers the library's FFI targets (TARGETS) for CUDA."""
    import jax  # noqa: PLC0415
    import jax.ffi  # noqa: PLC0415

    for name, sym in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib.dll, sym)), platform="CUDA")
    return lib


def _load_uncached() -> tuple[Lib | None, str]:
    import jax  # noqa: PLC0415

    if os.environ.get("JTILERT_FFI_DISABLE", "") not in ("", "0"):
        return None, "disabled by JTILERT_FFI_DISABLE"
    if not _gpu_present():
        return None, NO_GPU
    if jax.process_count() != 1:
        return None, "multi-process runs are not supported by the engine"
    path = _build.find_library()
    if path is None:
        if os.environ.get("JTILERT_FFI_AUTOBUILD", "1") in ("0", ""):
            return None, "library not built (python -m jtilert.ffi.build) and JTILERT_FFI_AUTOBUILD=0"
        why = _build.toolchain_missing()
        if why:
            return None, f"library not built and cannot build: {why}"
        path = _build.build()
    lib = Lib(str(path))
    if lib.device_count() < 1:
        return None, "the engine sees no CUDA device"
    return _register(lib), ""


def groups_of(mesh, axis_name: str) -> np.ndarray | None:
    """[ngroups, world] local device ids of the groups along ``axis_name``."""
    import jax  # noqa: PLC0415

    if not isinstance(mesh, jax.sharding.Mesh) or axis_name not in mesh.axis_names:
        return None
    ax = list(mesh.axis_names).index(axis_name)
    devs = np.moveaxis(np.asarray(mesh.devices), ax, -1)
    devs = devs.reshape(-1, devs.shape[-1])
    me = jax.process_index()
    if any(d.process_index != me or d.platform != "gpu" for d in devs.ravel()):
        return None
    return np.vectorize(lambda d: int(d.local_hardware_id), otypes=[np.int32])(devs)
