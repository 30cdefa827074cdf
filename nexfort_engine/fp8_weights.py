"""Linear weights *stored* in e4m3 while a model is compiled: half the weight memory of bf16.

What: :class:`Fp8StoredLinear` holds a linear's weight as ``float8_e4m3fn`` values and one fp32
scale (the weight's absolute maximum over 224: half e4m3's largest value, 448, so that a patch may
grow the weight up to twice its range before it clips; e4m3 is a float format, so the headroom
costs precision only for values below 1/14336 of the maximum); its forward casts the weight
up to the input's dtype and multiplies it by the scale, then calls ``F.linear``. That is the form of
a host's "scaled fp8" linears (ComfyUI's fp8 checkpoints), so the fp8 graph path reads the stored
e4m3 tensor straight into ``torch._scaled_mm`` (``passes/fp8_stored.py``), with no bf16 copy and no
fp8 copy (:mod:`nexfort_engine.fp8` keeps one e4m3 copy per bf16 weight beside it otherwise).
:func:`stored_copy` makes one from a linear; a host swaps it in for the original while it runs the
compiled model (the node layer does this through ComfyUI's object patches, which keep the original
module and put it back) and keeps the original off the device meanwhile.

The class speaks the host's weight-patch protocol by duck typing (the engine imports no host):
``comfy_cast_weights``, ``weight_function`` / ``bias_function`` (functions applied to the cast
weight and bias, as a low-VRAM load or a hook sets them), ``convert_weight`` (the stored weight as
full precision, what a LoRA is added to, computed in float32) and ``set_weight`` (a patched
full-precision weight rounded back to e4m3 with the same scale). They have the meaning ComfyUI's
``scaled_fp8`` ops give them. What a weight function receives depends on the host, which says so
through :attr:`Fp8StoredLinear.dequantize_for_patches`: ComfyUI 0.3.75's low-VRAM patch converts
the stored values itself, patches, and rounds back (the layer then scales); newer ComfyUI hands
weight functions the dequantized weight, as its own quantized layers do.

Why it is lossy, and how much: one rounding of each weight to e4m3 with a per-tensor scale
(relative error about 2-4 % per element; the tiny Flux's image moved 0.023 relative L2). It is an
opt-in memory setting (``"fp8_weights": true``), meant with O3, whose fp8 GEMMs round the
activations anyway. A patch keeps the scale (ComfyUI backs up and restores the weight tensor
only), so a LoRA that makes a weight more than twice the original's largest value is clipped
there, as ComfyUI's own scaled fp8 linears clip at once.

Twin: :func:`dequantized` (the weight the forward multiplies, in float32) and
:func:`quantize_per_tensor`'s round trip are checked against plain torch in the tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["E4M3", "E4M3_MAX", "HEADROOM", "Fp8StoredLinear", "quantize_per_tensor", "storable", "stored_copy"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
#: where a weight's largest value lands (half of E4M3_MAX: room for patches to grow it)
HEADROOM = 2.0
#: weight dtypes a stored copy is made from
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_per_tensor(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as e4m3 values and the fp32 scale they are multiplied by (``amax * HEADROOM / 448``
    unless ``scale`` is given; values beyond the scale's range are clipped to +-448)."""
    w = weight.detach()
    if scale is None:
        # the largest magnitude is one of the weight's own values: exact in its dtype, no fp32 copy;
        # one pass with no temporary (abs() made one: 3.6-6x slower on the CPU)
        lo, hi = torch.aminmax(w)
        amax = torch.maximum(lo.abs(), hi.abs()).float()
        scale = torch.where(amax > 0, amax * HEADROOM / E4M3_MAX, torch.ones_like(amax))
    scale = scale.detach().float().reshape(()).to(w.device)
    return _round_in_row_blocks(w, scale), scale


#: elements per fp32 working block on the CPU (16 MiB, in a server's last-level cache). Flux-dev's
#: block linears on 16 threads of a device host (run252): 7.67 / 4.65 / 4.13 / 6.05 s at
#: 2^18 / 2^20 / 2^22 / 2^24 elements; 12.8 / 11.7 s at 2^20 / 2^22 on the CI box's 2 threads
CPU_CHUNK = 1 << 22


def _round_in_row_blocks(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w / scale`` clipped to +-448 and cast to e4m3, computed in fp32 through one reused buffer:
    all rows at once on a GPU, a block of rows at a time (:data:`CPU_CHUNK` elements) on the CPU.
    The same element-wise steps either way, so the same bits. ComfyUI loads a checkpoint to the CPU,
    so a Flux-size model's copies are made there, and a whole-weight fp32 temporary made that
    memory-bound: each call touched a fresh 4-byte-per-element allocation (page faults) and
    streamed it four times. In blocks, 3 bytes per element cross memory. With the one-pass maximum,
    a 3072x12288 bf16 weight takes 82 ms on one thread of the CI box (was about 195) and 43 ms on
    two (was about 380: the page faults do not parallelise)."""
    rows = w.reshape(w.shape[0] if w.dim() else 1, -1)
    per = max(1, CPU_CHUNK // max(rows.shape[1], 1)) if w.device.type == "cpu" else rows.shape[0]
    out = torch.empty(rows.shape, dtype=E4M3, device=w.device)
    buf = torch.empty((min(per, rows.shape[0]), rows.shape[1]), dtype=torch.float32, device=w.device)
    for i in range(0, rows.shape[0], per):
        j = min(rows.shape[0], i + per)
        b = buf[: j - i]
        b.copy_(rows[i:j])
        b.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX)
        out[i:j].copy_(b)
    return out.reshape(w.shape)


def storable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a linear a stored copy can replace: an ``nn.Linear`` whose weight is a
    plain bf16/fp16/fp32 tensor (not already fp8, not a tensor subclass) with both sizes multiples
    of 16 (what fp8 GEMMs take)."""
    if not isinstance(module, torch.nn.Linear) or isinstance(module, Fp8StoredLinear):
        return False
    w = module.weight
    data = w.data if isinstance(w, torch.nn.Parameter) else w
    return (type(data) is torch.Tensor and data.dtype in SOURCE_DTYPES and data.dim() == 2
            and data.shape[0] % 16 == 0 and data.shape[1] % 16 == 0 and data.device.type != "meta")


class Fp8StoredLinear(torch.nn.Module):
    """A linear layer with an e4m3 weight and one fp32 scale (see the module's docstring)."""

    #: the host's weight-patch protocol (ComfyUI's ops): this layer always casts its weight
    comfy_cast_weights = True
    weight_function: list[Any] = []
    bias_function: list[Any] = []
    #: whether ``weight_function`` receives the dequantized weight (newer ComfyUI) rather than the
    #: stored values cast up, which the function converts and rounds back itself (ComfyUI 0.3.75)
    dequantize_for_patches: bool = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scale = quantize_per_tensor(weight)
        self.out_features, self.in_features = q.shape
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.scale_weight = torch.nn.Parameter(scale, requires_grad=False)
        # its own Parameter on the same storage: moving this module does not move the original's bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer multiplies by, in ``dtype``."""
        return self.weight.to(dtype) * self.scale_weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the cast, then the scale: the form passes/fp8_stored.py reads back to the stored tensor
        w = self.weight.to(device=x.device, dtype=x.dtype)
        scale = self.scale_weight.to(device=x.device, dtype=x.dtype)
        if self.weight_function and self.dequantize_for_patches:
            w = w * scale
            for f in self.weight_function:
                w = f(w)
        else:
            for f in self.weight_function:
                w = f(w)
            w = w * scale
        b = self.bias
        if b is not None:
            b = b.to(device=x.device, dtype=x.dtype)
            for f in self.bias_function:
                b = f(b)
        return F.linear(x, w, b)

    def convert_weight(self, weight: torch.Tensor, inplace: bool = False, **_: Any) -> torch.Tensor:
        """The host's patch protocol: the stored values ``weight`` (cast up) as the full-precision
        weight a patch is added to, in float32 whatever ``weight``'s dtype (newer ComfyUI patches in
        float16 on a GPU, where a small weight's scale, its maximum over 224, is subnormal). A new
        tensor even when ``inplace`` is asked: the host takes the returned one."""
        return weight.float() * self.scale_weight.to(device=weight.device)

    def set_weight(self, weight: torch.Tensor, inplace_update: bool = False, seed: Any = None,
                   return_weight: bool = False, **_: Any) -> torch.Tensor | None:
        """The host's patch protocol: a patched full-precision ``weight`` rounded to e4m3 with this
        layer's scale; returned (``return_weight``), copied into the stored tensor
        (``inplace_update``) or set as the new stored tensor."""
        q, _scale = quantize_per_tensor(weight, self.scale_weight)
        if return_weight:
            return q
        if inplace_update:
            self.weight.data.copy_(q)
        else:
            self.weight = torch.nn.Parameter(q.to(self.weight.device), requires_grad=False)
        return None


def stored_copy(module: torch.nn.Module, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> Fp8StoredLinear:
    """An :class:`Fp8StoredLinear` with ``module``'s weight rounded to e4m3 (on the weight's device)
    and its bias; ``module`` is left as it is. ``weight``/``bias`` replace the module's own (a host
    passes the unpatched originals it keeps while a patched copy is loaded). Raises ValueError when
    the module is not :func:`storable` or ``weight`` does not match its weight's shape and dtype."""
    if not storable(module):
        raise ValueError(f"not a linear with a bf16/fp16/fp32 weight whose sizes are multiples of 16: {module!r}")
    assert isinstance(module, torch.nn.Linear)
    w = module.weight if weight is None else weight
    if w.shape != module.weight.shape or w.dtype != module.weight.dtype:
        raise ValueError(f"weight {tuple(w.shape)} {w.dtype} does not match the layer's "
                         f"{tuple(module.weight.shape)} {module.weight.dtype}")
    with torch.no_grad():
        return Fp8StoredLinear(w, module.bias if bias is None else bias)
