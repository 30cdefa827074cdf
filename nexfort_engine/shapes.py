"""Dynamic-shape policy: one graph for every resolution, batch size, sequence length and step count.

Plain ``torch.compile(dynamic=True)`` recompiles a diffusion backbone on a typical sweep because

* *duck sizing* gives equal sizes one symbol: a square latent ties H to W (and a 4-step schedule
  ties ``sample_sigmas`` to the 4 latent channels), so the first non-square image or other step
  count recompiles;
* sizes 0 and 1 are specialised: batch 1 (cfg 1) and batch 2 (cfg > 1) are two graphs.

We switch off duck sizing (``use_duck_shape=False``) and compile with *backed size-oblivious*
semantics (``backed_size_oblivious=True``): a backed size is reasoned about as if it could be any
value >= 2, so a size that happens to be 1 does not specialise the graph. Both are scoped
config patches entered around each compiled call, never process-wide assignments. Floats (sigma,
cfg) are not specialised either, so changing them never recompiles.

Safety: size-oblivious reasoning only removes the 0/1 special cases; where a graph truly needs
them Inductor adds runtime asserts instead of silently computing a wrong result. The correctness
tests compare batch-1 outputs of the compiled graph against eager.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _existing(cfg: Any, patches: dict[str, Any]) -> dict[str, Any]:
    # torch 2.11 .. 2.14 differ a little; only patch the keys this torch has
    return {k: v for k, v in patches.items() if hasattr(cfg, k)}


def dynamo_patches(dynamic: bool) -> dict[str, Any]:
    p: dict[str, Any] = {"specialize_float": False, "cache_size_limit": 64}
    if dynamic:
        p.update(assume_static_by_default=False, automatic_dynamic_shapes=True)
    return p


def fx_patches(dynamic: bool) -> dict[str, Any]:
    return {"use_duck_shape": False, "backed_size_oblivious": True} if dynamic else {}


@contextlib.contextmanager
def shape_policy(dynamic: bool) -> Iterator[None]:
    """Enter the dynamic-shape policy for one compiled call."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    with dynamo_config.patch(**_existing(dynamo_config, dynamo_patches(dynamic))), fx_config.patch(
        **_existing(fx_config, fx_patches(dynamic))
    ):
        yield


def to_memory_format(args: tuple, kwargs: dict, memory_format: torch.memory_format) -> tuple[tuple, dict]:
    """Convert 4-D floating tensor arguments to ``memory_format`` (channels_last for conv nets)."""

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point():
            return v.contiguous(memory_format=memory_format)
        return v

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}
