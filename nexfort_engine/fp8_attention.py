"""fp8 attention: cuDNN's e4m3 scaled-dot-product attention, one custom op with a torch twin.

What: :func:`sdpa_fp8` computes ``softmax(q k^T / sqrt(D)) v`` for e4m3 ``q8``, ``k8``, ``v8``
(``[B, H, L, D]``, any strides with a contiguous last dim) whose real values are
``q8 * descale_q`` etc. (per-tensor scales), and returns the result as e4m3 scaled by
``1 / descale_v`` in ``[B, L, H, D]`` memory order (viewed as ``[B, H, L, D]``): an attention
output is a convex combination of value rows, so ``|o| <= max |v| = 448 * descale_v`` and that
scale cannot overflow. The caller dequantizes it (``o8.float() * descale_v``), which Inductor
fuses into whatever reads the output next.

``scales`` is one float32 tensor holding, at offsets 0, 4, ..., 20 (16-byte aligned, as cuDNN
wants its operands), ``descale_q, descale_k, descale_v, descale_s, scale_s, scale_o``: the three
input descales, the probabilities' (``1/448`` and ``448``: ``p <= 1``) and the output's
(``1 / descale_v``). :func:`pack_scales` builds it inside the compiled graph, so one small
Inductor kernel makes all six, and the op holds no device tensor across calls (CUDA-graph trees
own the memory of everything made during a captured call; an object keeping such a tensor broke
their accounting in run104).

* CUDA with ``nvidia-cudnn-frontend`` (the ``cudnn`` Python module, an optional dependency) on a
  GPU whose cuDNN has fp8 attention (Hopper): cuDNN's ``sdpa_fp8`` graph, built once per shape,
  strides and device. On Hopper its output must be fp8 (a 16-bit output is Blackwell only).
* Elsewhere: the twin :func:`torch_sdpa_fp8` (the dequantized operands through float32 attention,
  then the same output quantization; cuDNN also rounds the probabilities to e4m3, which the twin
  does not). On CUDA where a graph does not build (or the module is missing): the dequantized
  operands through 16-bit attention, logged once.

Why: at Flux's 1024² shape cuDNN's fp8 forward took 286 us against 401 us for bf16 on an H200
(run100), about 8 ms of a step's 57 attention calls (runs 104-105). The quantization must not
eat that: queries and keys come quantized from the fused norm + rotary kernel
(:func:`nexfort_engine.rope.rms_norm_rope_fp8`, a static scale), values take one reduction and
one pointwise kernel, and the output's dequantization fuses into its consumer
(:mod:`nexfort_engine.passes.fp8_attention` wires this).

Cost: e4m3 has 3 mantissa bits. Per call the error against float32 attention is about 0.11
relative (L2) at Flux's shape; over a whole Flux sampling run the final latent's rel-L2 against
bf16 eager is 0.0565 with O3's fp8 linears and this, 0.0432 with the fp8 linears alone
(runs 110-112). So it runs under O3 (``low-precision``) only, and ``"fp8_attention": false`` turns
it off there. Measured: Flux O3 2.13-2.17x eager with it, 1.99x without (BENCHMARKS.md, fifteenth
session).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .fp8 import FP8_DTYPE
from .rowwise_quant import FP8_MAX

__all__ = ["SCALE_STRIDE", "cudnn_supported", "pack_scales", "plan_cache", "plan_stats", "quantize_tensor", "quantize_values", "sdpa_fp8",
           "takes_head_size",
           "torch_sdpa_fp8"]

log = logging.getLogger(__name__)

#: elements between consecutive scalars in ``scales`` (16 bytes)
SCALE_STRIDE = 4
_SCALE_NAMES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
#: the smallest compute capability whose cuDNN has the fp8 attention forward
MIN_CAPABILITY = (9, 0)

_lock = threading.Lock()
#: built graphs, and None for a key whose build failed (not tried again)
_graphs: dict[tuple, Any] = {}
_handles: dict[int, Any] = {}
_supported: dict[int, bool] = {}
_warned: set[str] = set()


def takes_head_size(d: int) -> bool:
    """Whether cuDNN's fp8 forward takes this head size (a multiple of 16 up to 128)."""
    return d % 16 == 0 and 0 < d <= 128


def _scaled_e4m3(t: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t * 448 / amax`` as e4m3 (``t``'s layout) and the descale ``amax / 448`` ([1, 1, 1, 1])."""
    amax = amax.clamp(min=1e-12)
    q = (t.float() * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, (amax / FP8_MAX).reshape(1, 1, 1, 1)


def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` scaled by ``448 / amax(|t|)`` as e4m3 (``t``'s layout), and the descale
    ``amax / 448`` ([1, 1, 1, 1] float32). Plain torch ops: in a compiled graph, one reduction and
    one pointwise kernel."""
    return _scaled_e4m3(t, t.abs().amax().float())


def quantize_values(v: torch.Tensor, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_tensor` of attention's values ``v`` with their maximum from
    ``nexfort::absmax`` (:mod:`nexfort_engine.absmax`) over ``parts``: ``[v]``, or the tensors
    ``v`` concatenates on the sequence dim (the maximum is read from them, and the quantizing
    pointwise kernel reads the concatenation without materializing it)."""
    from . import absmax  # noqa: F401 - registers nexfort::absmax

    q, descale = _scaled_e4m3(v, torch.ops.nexfort.absmax.default(parts))
    # in [B, L, H, D] memory as the queries and keys (a layout, not a copy: Inductor writes the
    # quantized values there), so every block's attention has the same strides and shares one
    # cuDNN graph per shape (each build costs warm-start time)
    return q.transpose(1, 2).contiguous().transpose(1, 2), descale


def pack_scales(descale_q: torch.Tensor, descale_k: torch.Tensor, descale_v: torch.Tensor) -> torch.Tensor:
    """The op's ``scales`` operand (module docstring) from the three input descales."""
    dv = descale_v.reshape(1).float()
    vals = [descale_q.reshape(1).float(), descale_k.reshape(1).float(), dv,
            torch.full_like(dv, 1.0 / FP8_MAX), torch.full_like(dv, FP8_MAX), 1.0 / dv]
    return torch.stack(vals).expand(len(vals), SCALE_STRIDE).contiguous().reshape(-1)


def _scalar(scales: torch.Tensor, name: str) -> torch.Tensor:
    """One of ``scales``' values as the [1, 1, 1, 1] tensor cuDNN reads (a view)."""
    i = _SCALE_NAMES.index(name) * SCALE_STRIDE
    return scales[i:i + 1].reshape(1, 1, 1, 1)


def _check(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> None:
    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        if t.dtype != FP8_DTYPE or t.dim() != 4:
            raise ValueError(f"sdpa_fp8: {name} must be a [B, H, L, D] {FP8_DTYPE} tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
    b, h, _, d = q8.shape
    if k8.shape != v8.shape or k8.shape[0] != b or k8.shape[1] != h or k8.shape[3] != d:
        raise ValueError(f"sdpa_fp8: k8 and v8 must be [B, H, L_kv, D] with q8's B, H, D: q8 {tuple(q8.shape)}, "
                         f"k8 {tuple(k8.shape)}, v8 {tuple(v8.shape)}")
    if scales.dtype != torch.float32 or scales.shape != (len(_SCALE_NAMES) * SCALE_STRIDE,):
        raise ValueError(f"sdpa_fp8: scales must be float32 [{len(_SCALE_NAMES) * SCALE_STRIDE}] (pack_scales), "
                         f"got {scales.dtype} {tuple(scales.shape)}")


def _output(q8: torch.Tensor) -> torch.Tensor:
    """An empty e4m3 result: ``[B, L, H, D]`` memory viewed as ``[B, H, L, D]``."""
    b, h, n, d = q8.shape
    return q8.new_empty((b, n, h, d), dtype=FP8_DTYPE).permute(0, 2, 1, 3)


def torch_sdpa_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The twin: float32 attention of the dequantized operands, quantized like cuDNN's output."""
    _check(q8, k8, v8, scales)
    return _dequantized_sdpa(q8, k8, v8, scales, torch.float32)


def _dequantized_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Attention of the operands dequantized to ``dtype``, its output quantized as cuDNN's."""
    q, k, v = (t.to(dtype) * _scalar(scales, n).to(dtype)
               for t, n in ((q8, "descale_q"), (k8, "descale_k"), (v8, "descale_v")))
    out = F.scaled_dot_product_attention(q, k, v).float() * _scalar(scales, "scale_o")
    return _output(q8).copy_(out.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))


#: the graph's input uids (fixed; cuDNN numbers the outputs, which a saved graph records)
_UIDS = {"q": 1, "k": 2, "v": 3, **{n: 10 + i for i, n in enumerate(_SCALE_NAMES)}}
_OUTPUTS = ("o", "amax_s", "amax_o")


class _Graph:
    """One cuDNN fp8 attention graph for fixed shapes and strides (on one device): built, or
    restored from ``serialized`` (:meth:`serialize`'s bytes from an earlier process)."""

    def __init__(self, handle: Any, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, out: torch.Tensor,
                 serialized: bytes | None = None) -> None:
        import cudnn

        self.handle = handle
        if serialized is not None:  # a JSON line of the output uids, then cuDNN's bytes
            header, _, data = serialized.partition(b"\n")
            self.uids = {**_UIDS, **{k: int(v) for k, v in json.loads(header).items() if k in _OUTPUTS}}
            if set(self.uids) != set(_UIDS) | set(_OUTPUTS):
                raise ValueError("the saved graph does not name its outputs")
            g = cudnn.pygraph(handle=handle)
            g.deserialize(list(data))  # the binding takes a list of byte values
            self.graph = g
            self.workspace_size = max(int(g.get_workspace_size()), 1)
            return
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def operand(name: str, t: torch.Tensor) -> Any:
            return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=fp8, uid=_UIDS[name])

        q, k, v = operand("q", q8), operand("k", k8), operand("v", v8)
        scalars = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, uid=_UIDS[n])
                   for n in _SCALE_NAMES}
        o, _, amax_s, amax_o = g.sdpa_fp8(q=q, k=k, v=v, **scalars, generate_stats=False,
                                          attn_scale=1.0 / math.sqrt(q8.shape[-1]), name="sdpa_fp8")
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(fp8)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.uids = {**_UIDS, "o": o.get_uid(), "amax_s": amax_s.get_uid(), "amax_o": amax_o.get_uid()}
        self.workspace_size = max(int(g.get_workspace_size()), 1)

    def serialize(self) -> bytes:
        header = json.dumps({k: self.uids[k] for k in _OUTPUTS}).encode()
        return header + b"\n" + bytes(self.graph.serialize())

    def __call__(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor,
                 out: torch.Tensor) -> None:
        import cudnn

        # workspace and amax outputs per call (module docstring: nothing device-side is kept)
        workspace = torch.empty(self.workspace_size, device=q8.device, dtype=torch.uint8)
        amax = torch.empty(2 * SCALE_STRIDE, device=q8.device, dtype=torch.float32)
        uid = self.uids
        pack = {uid["q"]: q8, uid["k"]: k8, uid["v"]: v8, uid["o"]: out,
                uid["amax_s"]: amax[0:1], uid["amax_o"]: amax[SCALE_STRIDE:SCALE_STRIDE + 1]}
        pack.update({uid[n]: _scalar(scales, n) for n in _SCALE_NAMES})
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
        self.graph.execute(pack, workspace, handle=self.handle)


def _handle(device: torch.device) -> Any:
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    return _handles[index]


#: where built graphs are saved and looked for (:func:`plan_cache`), or None
_plan_dir: Path | None = None
#: graphs built, loaded from the plan cache, and rebuilt because a saved one did not load
plan_stats = {"built": 0, "loaded": 0, "rebuilt": 0}


@contextlib.contextmanager
def plan_cache(directory: str | os.PathLike[str] | None) -> Iterator[None]:
    """Save each graph built inside this context under ``directory`` and load graphs from there
    instead of building them (a build costs about 1.5 s in a new process on an H200, a load
    milliseconds: run109). The compiler points it at its cache entry's artifacts, whose manifest
    hashes every file; a file that does not load is rebuilt and replaced."""
    global _plan_dir
    old, _plan_dir = _plan_dir, Path(directory) if directory is not None else None
    try:
        yield
    finally:
        _plan_dir = old


def _plan_file(key: tuple) -> Path | None:
    if _plan_dir is None:
        return None
    import cudnn

    index = key[0].index if key[0].index is not None else torch.cuda.current_device()
    ident = repr((key[1:], torch.cuda.get_device_name(index), cudnn.backend_version(), cudnn.__version__))
    return _plan_dir / f"sdpa_fp8-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.cudnn"


def _load_or_build(key: tuple, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, out: torch.Tensor) -> _Graph:
    handle = _handle(q8.device)
    path = _plan_file(key)
    if path is not None and path.is_file():
        try:
            graph = _Graph(handle, q8, k8, v8, out, serialized=path.read_bytes())
            plan_stats["loaded"] += 1
            return graph
        except Exception as exc:  # corrupt, or from another cuDNN: build it again
            log.warning("nexfort: cached cuDNN plan %s did not load (%s: %s); rebuilding it", path.name,
                        type(exc).__name__, exc)
            plan_stats["rebuilt"] += 1
    start = time.perf_counter()
    graph = _Graph(handle, q8, k8, v8, out)
    plan_stats["built"] += 1
    log.info("nexfort: cuDNN fp8 attention graph for %s built in %.2f s", tuple(q8.shape), time.perf_counter() - start)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(graph.serialize())
            os.replace(tmp, path)
        except Exception as exc:  # not serializable here, or no space: the next process builds it
            log.info("nexfort: cuDNN plan not saved (%s: %s)", type(exc).__name__, exc)
    return graph


def _graph_for(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, out: torch.Tensor) -> _Graph | None:
    """The graph for these operands, loaded or built on first use; None when that failed before."""
    key = (q8.device, *((tuple(t.shape), tuple(t.stride())) for t in (q8, k8, v8, out)))
    with _lock:
        if key in _graphs:
            return _graphs[key]
        _graphs[key] = None  # until it has built
        with torch.cuda.device(q8.device):
            graph = _graphs[key] = _load_or_build(key, q8, k8, v8, out)
        return graph


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def cudnn_supported(device: torch.device | str) -> bool:
    """Whether cuDNN's fp8 attention can run on ``device``: a CUDA GPU of compute capability 9.0+
    and the ``cudnn`` module (``pip install nvidia-cudnn-frontend``). Whether a given shape's graph
    builds is known at its first call; one that does not runs :func:`_sdpa_16bit` instead (no probe
    graph here: each build costs warm-start time)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _supported:
        ok = torch.cuda.get_device_capability(index) >= MIN_CAPABILITY
        if ok:
            try:
                import cudnn  # noqa: F401 - nvidia-cudnn-frontend
            except ImportError:
                ok = False
                log.info("nexfort: fp8 attention needs nvidia-cudnn-frontend (pip install "
                         "nvidia-cudnn-frontend); attention stays in 16-bit")
        _supported[index] = ok
    return _supported[index]


def _sdpa_16bit(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fallback on CUDA where cuDNN's graph does not build: the dequantized operands through
    bfloat16 attention (fast), the output quantized as cuDNN's."""
    return _dequantized_sdpa(q8, k8, v8, scales, torch.bfloat16)


@torch.library.custom_op("nexfort::sdpa_fp8", mutates_args=())
def sdpa_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 attention (module docstring): cuDNN on CUDA where it runs, the twin elsewhere."""
    _check(q8, k8, v8, scales)
    if q8.is_cuda and takes_head_size(q8.shape[-1]):
        q8, k8, v8 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q8, k8, v8))
        out = _output(q8)
        try:
            graph = _graph_for(q8, k8, v8, out)
            if graph is not None:
                graph(q8, k8, v8, scales, out)
                return out
        except ImportError:
            _warn_once("import", "nexfort: nvidia-cudnn-frontend is not installed: fp8 attention runs in 16-bit")
        except Exception as exc:  # this shape failed to build: 16-bit attention keeps the run going
            _warn_once(f"{tuple(q8.shape)}", "nexfort: cuDNN fp8 attention failed for %s (%s: %s); 16-bit "
                       "attention runs instead", tuple(q8.shape), type(exc).__name__, exc)
        return _sdpa_16bit(q8, k8, v8, scales)
    return torch_sdpa_fp8(q8, k8, v8, scales)


@sdpa_fp8.register_fake
def _(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _check(q8, k8, v8, scales)
    return _output(q8)
