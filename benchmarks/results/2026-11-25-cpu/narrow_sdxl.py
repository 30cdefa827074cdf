"""The CPU box's stand-in for SDXL in this folder's measurements: ComfyUI's SDXL UNet at the real
depth (transformer depths 2 and 10, 3 levels) but narrow (64 channels, context 64), float32, random
weights (5038 nodes traced), and a call's inputs marked as the engine marks them."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import tiny_models  # noqa: E402
import torch  # noqa: E402

tiny_models.boot()
import comfy.supported_models  # noqa: E402

from benchmarks import models as M  # noqa: E402
from nexfort_engine import precompile, shapes, trace_ops  # noqa: E402


def unet() -> torch.nn.Module:
    cfg = dict(M._SDXL, model_channels=64, context_dim=64, adm_in_channels=2816)
    mc = comfy.supported_models.SDXL(dict(cfg))
    mc.set_inference_dtype(torch.float32, None)
    return mc.get_model({}, "", device=torch.device("cpu")).eval().diffusion_model


def call(dm: torch.nn.Module) -> tuple[tuple, dict]:
    """``(dm, x, timesteps, context)`` and ``{y, transformer_options}``, dynamic dims marked."""
    args = (dm, torch.randn(2, 4, 16, 16), torch.rand(2) * 999, torch.randn(2, 77, 64))
    kwargs = {"y": torch.randn(2, 2816), "transformer_options": {}}
    shapes.mark_dynamic_dims(args[1:], kwargs)
    return args, kwargs


class Done(Exception):
    """Raised by a measuring backend once it has what it measures: the trace stops there."""


def trace_until_done(backend) -> None:
    """The engine's own trace of :func:`unet` (``precompile.trace``, ``F.linear`` standing in) into
    ``backend``, which ends it by raising :class:`Done` (Dynamo wraps it; any other error is raised)."""
    dm = unet()
    args, kwargs = call(dm)
    try:
        with torch.no_grad(), trace_ops.standing_in():
            precompile.trace(type(dm).forward, args, kwargs, backend, "self", trace_ops.originals())
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's exception
        while e is not None and not isinstance(e, Done):
            e = getattr(e, "inner_exception", None) or e.__cause__
        if e is None:
            raise
