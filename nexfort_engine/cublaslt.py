"""cuBLASLt through ``ctypes``: the few calls a chosen GEMM algorithm needs (no build step).

What: :class:`Lt` drives the ``libcublasLt`` torch has already loaded with the descriptors torch
builds for ``F.linear`` on a 16-bit CUDA tensor (``gemm_and_bias``): column-major ``D = Wᵀ·x``,
float32 accumulation, the ``DEFAULT``, ``BIAS`` or ``GELU_BIAS`` epilogue. It asks the heuristic for
candidates (:meth:`Lt.heuristics`), lists every configuration the library accepts for a shape
(:meth:`Lt.enumerate`), rebuilds one from its attributes (:meth:`Lt.from_config`, checked with
``AlgoCheck``) and runs it on the current stream (:meth:`Lt.matmul`; CUDA graphs capture it).

Why: torch runs the heuristic's first answer; for some shapes another tile runs faster
(PixArt-α's fc1 + GELU 1.28× under sustained load, BENCHMARKS.md fifty-fifth session). The choice
is made by :mod:`nexfort_engine.gemm_tuning`; this module only speaks the C API.

The reference twin of every call here is torch's own ``F.linear`` / ``torch._addmm_activation``:
the same descriptors and accumulation, so the heuristic's first answer is torch's algorithm.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ALGO_CONFIG", "EPILOGUES", "Descriptors", "Lt", "get", "loaded"]

_CUDA_R_16F, _CUDA_R_32F, _CUDA_R_16BF = 2, 0, 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER, _DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
_PREF_MAX_WORKSPACE_BYTES = 1
#: epilogue name -> cublasLtEpilogue_t
EPILOGUES: dict[str, int] = {"none": 1, "bias": 4, "gelu_bias": 36}
#: cublasLtMatmulAlgoConfigAttributes_t: name -> (attribute, its C type; the size must match)
ALGO_CONFIG: dict[str, tuple[int, Any]] = {
    "id": (0, ctypes.c_int32), "tile_id": (1, ctypes.c_uint32), "splitk_num": (2, ctypes.c_int32),
    "reduction_scheme": (3, ctypes.c_uint32), "cta_swizzling": (4, ctypes.c_uint32),
    "custom_option": (5, ctypes.c_uint32), "stages_id": (6, ctypes.c_uint32),
    "inner_shape_id": (7, ctypes.c_uint16), "cluster_shape_id": (8, ctypes.c_uint16)}
#: the attributes :meth:`Lt.from_config` sets (the rest are the algorithm's defaults)
CONFIG_SET = ("tile_id", "stages_id", "cta_swizzling", "custom_option", "splitk_num", "cluster_shape_id")
# cublasLtMatmulAlgoCapAttributes_t
_CAP_SWIZZLE, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_EPILOGUE_MASK, _CAP_STAGES_IDS = 2, 6, 7, 12, 13
#: cublasLtClusterShape_t values tried by the search: auto, 1x1x1, 2x1x1, 1x2x1, 2x2x1
CLUSTERS = (0, 2, 3, 5, 6)


class Algo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: opaque, 8 × 64 bits."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclass
class Descriptors:
    """A matmul descriptor and its three layouts for one (m, k, n, dtype, epilogue)."""

    desc: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    c: ctypes.c_void_p
    dtype: torch.dtype
    epilogue: str


def _load() -> ctypes.CDLL:
    """The libcublasLt torch has mapped (after one CUDA matmul), else the first one dlopen finds."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.float16)
    F.linear(a, a, a[0])
    torch.cuda.synchronize()
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "libcublasLt" in line})
    except OSError:
        pass
    for path in paths + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("no libcublasLt found")


def _cdt(dtype: torch.dtype) -> int:
    if dtype == torch.float16:
        return _CUDA_R_16F
    if dtype == torch.bfloat16:
        return _CUDA_R_16BF
    raise ValueError(f"cuBLASLt GEMMs here take float16 or bfloat16, not {dtype}")


class Lt:
    """One cuBLASLt handle and the calls above, every status checked."""

    def __init__(self) -> None:
        self.lib = _load()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.version = int(self.lib.cublasLtGetVersion())

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cublasStatus {status}")

    def _set(self, fn: Any, obj: ctypes.c_void_p, attr: int, value: Any) -> None:
        self._check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), fn.__name__)

    def build(self, m: int, k: int, n: int, dtype: torch.dtype, epilogue: str) -> Descriptors:
        """Descriptors for ``out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias, GELU)`` as torch builds them;
        the bias pointer is set per call (:meth:`matmul`)."""
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue {epilogue!r}: expected one of {sorted(EPILOGUES)}")
        lib, cdt = self.lib, _cdt(dtype)
        desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _CUDA_R_32F), "DescCreate")
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))
        if epilogue != "none":
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(cdt))
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # A = w (op T), B = x, C = D = out
            lay = ctypes.c_void_p()
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), cdt, ctypes.c_uint64(rows),
                                                       ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
            layouts.append(lay)
        return Descriptors(desc, layouts[0], layouts[1], layouts[2], dtype, epilogue)

    def heuristics(self, d: Descriptors, count: int, workspace: int) -> list[Heuristic]:
        """The heuristic's answers, best first (its first is torch's own choice)."""
        lib = self.lib
        pref = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
                      ctypes.c_uint64(workspace))
            results = (Heuristic * count)()
            returned = ctypes.c_int(0)
            self._check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, d.desc, d.a, d.b, d.c, d.c, pref, count,
                                                           results, ctypes.byref(returned)), "AlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict[str, int]:
        """The algorithm's configuration attributes (those the library reports)."""
        out = {}
        for name, (attr, ctype) in ALGO_CONFIG.items():
            val, written = ctype(0), ctypes.c_size_t(0)
            st = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(val),
                                                               ctypes.c_size_t(ctypes.sizeof(val)),
                                                               ctypes.byref(written))
            if st == 0:
                out[name] = int(val.value)
        return out

    def _cap(self, algo: Algo, attr: int, ctype: Any = ctypes.c_int32) -> int:
        val, written = ctype(0), ctypes.c_size_t(0)
        st = self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(val),
                                                        ctypes.c_size_t(ctypes.sizeof(val)), ctypes.byref(written))
        return int(val.value) if st == 0 else 0

    def _cap_list(self, algo: Algo, attr: int) -> list[int]:
        written = ctypes.c_size_t(0)
        self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                                   ctypes.byref(written))
        count = written.value // 4
        if count == 0:
            return [0]
        buf = (ctypes.c_uint32 * count)()
        self._check(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf,
                                                               ctypes.c_size_t(4 * count), ctypes.byref(written)),
                    "AlgoCapGetAttribute")
        return [int(v) for v in buf]

    def _set_config(self, algo: Algo, name: str, value: int) -> bool:
        attr, ctype = ALGO_CONFIG[name]
        val = ctype(value)
        return self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(val),
                                                             ctypes.c_size_t(ctypes.sizeof(val))) == 0

    def _init(self, dtype: torch.dtype, algo_id: int) -> Algo | None:
        cdt, base = _cdt(dtype), Algo()
        if self.lib.cublasLtMatmulAlgoInit(self.handle, _COMPUTE_32F, _CUDA_R_32F, cdt, cdt, cdt, cdt, algo_id,
                                           ctypes.byref(base)) != 0:
            return None
        return base

    def check(self, d: Descriptors, algo: Algo) -> Heuristic | None:
        """``AlgoCheck``: the algorithm's workspace for these descriptors, or None if it cannot run them."""
        h = Heuristic()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, d.desc, d.a, d.b, d.c, d.c, ctypes.byref(algo),
                                            ctypes.byref(h)) != 0:
            return None
        h.algo = algo
        return h

    def _configured(self, base: Algo, values: dict[str, int]) -> Algo | None:
        algo = Algo()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
        for name in CONFIG_SET:
            if name == "cluster_shape_id" and not values.get(name):
                continue  # auto: the algorithm's default (older libraries lack the attribute)
            if name in values and not self._set_config(algo, name, values[name]):
                return None
        return algo

    def from_config(self, d: Descriptors, values: dict[str, int]) -> Heuristic | None:
        """The algorithm ``values`` (from :meth:`config`) describes, checked against ``d``; None if
        this library or GPU does not take it."""
        base = self._init(d.dtype, int(values.get("id", -1)))
        if base is None:
            return None
        algo = self._configured(base, values)
        return None if algo is None else self.check(d, algo)

    def enumerate(self, d: Descriptors, workspace: int, limit: int, algo_ids: tuple[int, ...] | None = None,
                  stages: tuple[int, ...] | None = None, tiles: tuple[int, ...] | None = None,
                  swizzles: tuple[int, ...] | None = None, customs: tuple[int, ...] | None = None,
                  clusters: tuple[int, ...] = CLUSTERS) -> list[Heuristic]:
        """Every configuration cuBLASLt accepts (``AlgoCheck``) for these descriptors: each algorithm
        id × tile × stages × CTA swizzle × custom option × cluster shape, no split-K (the heuristic's
        own space for shapes this large), at most ``limit``; ``algo_ids``/``stages``/``tiles``/
        ``swizzles``/``customs`` narrow it to those values (of the ones the algorithm has)."""
        lib, cdt = self.lib, _cdt(d.dtype)
        ids = (ctypes.c_int * 256)()
        returned = ctypes.c_int(0)
        self._check(lib.cublasLtMatmulAlgoGetIds(self.handle, _COMPUTE_32F, _CUDA_R_32F, cdt, cdt, cdt, cdt,
                                                 256, ids, ctypes.byref(returned)), "AlgoGetIds")
        found: list[Heuristic] = []
        for algo_id in list(ids)[: returned.value]:
            if algo_ids is not None and algo_id not in algo_ids:
                continue
            base = self._init(d.dtype, algo_id)
            if base is None or not self._cap(base, _CAP_EPILOGUE_MASK, ctypes.c_uint32) & EPILOGUES[d.epilogue]:
                continue
            swz_ids = [s for s in ((0, 1) if self._cap(base, _CAP_SWIZZLE, ctypes.c_uint32) else (0,))
                       if swizzles is None or s in swizzles]
            custom_ids = [c for c in range(self._cap(base, _CAP_CUSTOM_MAX) + 1) if customs is None or c in customs]
            tile_ids = [t for t in self._cap_list(base, _CAP_TILE_IDS) if tiles is None or t in tiles]
            stage_ids = [s for s in self._cap_list(base, _CAP_STAGES_IDS) if stages is None or s in stages]
            for tile, stage, swz, custom, cluster in itertools.product(tile_ids, stage_ids, swz_ids, custom_ids,
                                                                       clusters):
                algo = self._configured(base, {"tile_id": tile, "stages_id": stage, "cta_swizzling": swz,
                                               "custom_option": custom, "splitk_num": 1,
                                               "cluster_shape_id": cluster})
                if algo is None:
                    continue
                h = self.check(d, algo)
                if h is None or h.workspace_size > workspace:
                    continue
                found.append(h)
                if len(found) >= limit:
                    return found
        return found

    def matmul(self, d: Descriptors, algo: Algo, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor, workspace: torch.Tensor | None) -> None:
        """``out = x · wᵀ (+ bias, GELU)`` with ``algo`` on the current stream (contiguous, aligned
        operands: the caller checks)."""
        if d.epilogue != "none":
            assert bias is not None
            self._set(self.lib.cublasLtMatmulDescSetAttribute, d.desc, _DESC_BIAS_POINTER,
                      ctypes.c_void_p(bias.data_ptr()))
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ws_ptr = ctypes.c_void_p(workspace.data_ptr() if workspace is not None else 0)
        ws_size = ctypes.c_size_t(workspace.numel() if workspace is not None else 0)
        self._check(self.lib.cublasLtMatmul(
            self.handle, d.desc, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), d.a,
            ctypes.c_void_p(x.data_ptr()), d.b, ctypes.byref(zero), ctypes.c_void_p(out.data_ptr()), d.c,
            ctypes.c_void_p(out.data_ptr()), d.c, ctypes.byref(algo), ws_ptr, ws_size, stream), "cublasLtMatmul")


_lt: Lt | None = None
_lt_lock = threading.Lock()


def loaded() -> bool:
    """Whether :func:`get` has made the process's :class:`Lt` (its first call runs a CUDA matmul:
    not while a CUDA graph is captured)."""
    return _lt is not None


def get() -> Lt:
    """The process's :class:`Lt` (made at the first call; CUDA only)."""
    global _lt
    if _lt is None:
        with _lt_lock:
            if _lt is None:
                _lt = Lt()
    return _lt
