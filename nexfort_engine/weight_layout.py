"""Convolution weights kept channels-last outside the compiled graph (reference: the weight as the
host loaded it; the convolution's result does not depend on its memory layout).

What: :class:`ChannelsLastWeights` converts the 4-D weights of a conv net's ``Conv2d`` layers to
``torch.channels_last`` memory in place (``param.data``), once before the first compile and then
before every compiled call for any weight the host *replaced* since (ComfyUI's LoRA patching sets
new parameters; in-place updates keep the layout).

Why: on a GPU Inductor runs conv nets channels-last (:func:`nexfort_engine.shapes.layout_patches`).
Weights are graph inputs (live parameters, so LoRA works without a recompile), and a weight that
arrives in the default layout is copied to channels-last inside the graph, on every call: on an
H200, SD2.1 768² spent 0.75 of its 14.4 GPU-ms per step in those 14 copy kernels (BENCHMARKS.md,
eighth session). Converted once outside the graph, the copies vanish; CUDA graphs capture the
converted weights. Only layout changes: same values, same memory.
"""

from __future__ import annotations

import torch

__all__ = ["ChannelsLastWeights"]


def _needs(w: object) -> bool:
    return (
        isinstance(w, torch.Tensor)
        and w.dim() == 4
        and w.is_floating_point()
        and not w.is_contiguous(memory_format=torch.channels_last)
    )


class ChannelsLastWeights:
    """The ``Conv2d`` weights of one module, kept channels-last (see the module docstring)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
        #: the weight object each conv had at the last refresh: a replaced one is checked again
        self._seen: list[object] = [None] * len(self._convs)
        #: weights converted so far (for the counters)
        self.converted = 0

    def refresh(self) -> int:
        """Convert every weight replaced since the last call; returns how many were converted."""
        n = 0
        for i, conv in enumerate(self._convs):
            w = conv._parameters.get("weight")
            if w is self._seen[i]:
                continue
            self._seen[i] = w
            if not _needs(w):
                continue
            assert isinstance(w, torch.Tensor)
            with torch.no_grad(), torch.inference_mode(w.is_inference()):
                w.data = w.data.contiguous(memory_format=torch.channels_last)
            n += 1
        self.converted += n
        return n
