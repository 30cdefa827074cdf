"""The tiny model zoo (``tiny_models.py``) itself: every family's output depends on each of its
inputs. A model whose output is constant (a norm layer's scale left at 0 makes its output its bias
alone) passes every compiled-vs-eager comparison whatever the compiled graph computes, so the
tests built on the zoo would check nothing."""

from __future__ import annotations

from typing import Any

import pytest
import tiny_models as tm
import torch

#: a fresh draw of one input must move the output by at least this much (relative to its scale)
MIN_EFFECT = 1e-2


class _Redrawn(torch.nn.Module):
    """A diffusion model whose latent (``"x"``, the first positional argument) or ``"context"``
    keyword is replaced by a fresh normal draw of the same shape at every call."""

    def __init__(self, inner: torch.nn.Module, what: str) -> None:
        super().__init__()
        self.inner, self.what = inner, what

    def __getattr__(self, name: str) -> Any:  # the host reads e.g. ``dtype`` off the model
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def fresh(t: torch.Tensor) -> torch.Tensor:
            return torch.randn(t.shape, generator=torch.Generator().manual_seed(1234)).to(t.dtype)

        if self.what == "x":
            args = (fresh(args[0]), *args[1:])
        else:
            kwargs = {**kwargs, self.what: fresh(kwargs[self.what])}
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("family", sorted(tm.FAMILIES))
def test_every_tiny_familys_output_depends_on_its_latent_and_its_context(comfy_inproc, family):
    """Sampled through ComfyUI's real sampler (each family's own conditioning path): the
    diffusion model's latent or context redrawn at every call changes the image."""
    mp = tm.FAMILIES[family](seed=11)
    h, w = tm.RESOLUTIONS[family][0]
    cfg = 1.0 if family == "flux" else 4.0
    ref = tm.sample(mp, h, w, 1, 2, cfg, 12, seed=1)
    assert torch.isfinite(ref).all()
    dm = mp.model.diffusion_model
    for what in ("x", "context"):
        out = tm.sample(tm.with_diffusion_model(mp, _Redrawn(dm, what)), h, w, 1, 2, cfg, 12, seed=1)
        assert tm.rel_err(out, ref) > MIN_EFFECT, f"{family}: the output ignores its {what}"


def test_no_norm_layer_of_the_zoo_has_a_zero_scale(comfy_inproc):
    for family, build in sorted(tm.FAMILIES.items()):
        model = build(seed=3).model
        zero = [
            f"{mod_name}.{leaf}"
            for mod_name, mod in model.named_modules()
            if "Norm" in type(mod).__name__
            for leaf, p in mod.named_parameters(recurse=False)
            if leaf in ("weight", "scale") and not bool(p.detach().float().abs().max() > 0)
        ]
        assert not zero, f"{family}: norm scales at 0: {zero[:5]}"
