"""A tiny model zoo built through ComfyUI's own model classes, in-process, on CPU.

Every model is a real ``comfy.model_base`` model from ``comfy.supported_models.<Family>`` wrapped
in a ``comfy.model_patcher.ModelPatcher`` — the objects the pack sees inside ComfyUI — only with
few blocks and small hidden sizes, and random finite weights drawn from a fixed seed (ComfyUI's
``comfy.ops`` layers are created uninitialised, and their ``reset_parameters`` is a no-op).

    boot()                      # ComfyUI on sys.path, --cpu, SDPA attention, grad off
    mp = tiny_sd15()            # or tiny_pixart(), tiny_flux(), tiny_sd3(), tiny_lumina2(), tiny_wan21(),
                                # tiny_qwen_image(); FAMILIES maps name -> builder
    latent = sample(mp, h=64, w=64, batch=1, steps=3, cfg=5.0, ctx_len=77)   # comfy.sample.sample
    out = call_diffusion(mp, h=64, w=96, batch=2, ctx_len=77)                # diffusion_model(...)

``h``/``w`` are pixel sizes (latent = /8). Helpers take an optional ``diffusion_model`` to call
instead of the patcher's own (a compiled one).

The ComfyUI tree comes from ``$NEXFORT_HOST`` or ``<repo>/.host/ComfyUI`` (``make host``).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent


def host_dir() -> Path:
    return Path(os.environ.get("NEXFORT_HOST") or REPO / ".host" / "ComfyUI").resolve()


_booted = False


def boot() -> None:
    """Import ComfyUI in this process the way main.py would for ``--cpu --use-pytorch-cross-attention``."""
    global _booted
    if _booted:
        return
    host = host_dir()
    if not (host / "comfy").is_dir():
        raise FileNotFoundError(f"no ComfyUI host at {host}: run `make host` (scripts/setup_host.sh)")
    if str(host) not in sys.path:
        sys.path.insert(0, str(host))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.use_pytorch_cross_attention = True
    comfy.cli_args.args.disable_api_nodes = True
    torch.set_grad_enabled(False)
    # order matters: model_management reads the args; utils.install_util must be imported before
    # anything runs a bare `import utils` (nodes.py puts <tree>/comfy first on sys.path)
    for name in ("comfy.model_management", "utils.install_util", "comfy.model_patcher", "comfy.sample",
                 "comfy.samplers", "comfy.supported_models"):
        importlib.import_module(name)

    _booted = True


def init_weights(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random finite weights, scaled so activations stay O(1) through a few blocks.

    Norm layers' scales are 1 wherever they sit: found by the module's class (GroupNorm, LayerNorm,
    RMSNorm and ComfyUI's subclasses), not only by a parameter name containing "norm". A scale of
    0 makes the layer's output its bias alone, and the whole model's output stops depending on
    its input (the SD1.5 UNet's ResBlocks and its ``out.0`` GroupNorm, SD3's ``ln_q``/``ln_k``,
    Lumina 2's ``cap_embedder.0``), which every compiled-vs-eager comparison would then pass.
    """
    gen = torch.Generator().manual_seed(seed)
    norm_scales = {
        f"{mod_name}.{leaf}" if mod_name else leaf
        for mod_name, mod in module.named_modules()
        if "Norm" in type(mod).__name__
        for leaf, _ in mod.named_parameters(recurse=False)
        if leaf in ("weight", "scale")
    }
    for name, p in module.named_parameters():
        # weights stored in fp8 (ComfyUI's weight_dtype fp8_e4m3fn) are drawn in float32 and cast
        t = p.data if p.dtype.itemsize > 1 else torch.empty(p.shape)
        if p.dim() == 0:
            t.fill_(1.0)
        elif p.dim() == 1:
            norm_scale = name in norm_scales or "norm" in name or name.endswith("scale")
            t.fill_(1.0 if norm_scale else 0.0)
            if "bias" in name:
                t.normal_(0.0, 0.02, generator=gen)
        else:
            t.normal_(0.0, (1.0 / p[0].numel()) ** 0.5, generator=gen)
        if t is not p.data:
            p.data.copy_(t)
    for name, b in module.named_buffers():
        if not b.is_floating_point():
            continue
        if name.startswith("diffusion_model."):
            # learned tables kept as buffers: SD3's pos_embed is allocated with torch.empty (the
            # checkpoint fills it), so its memory's leftovers, finite or not, would reach the
            # output (a fresh process's NaN); PixArt's y_embedding is drawn from the global RNG
            b.normal_(0.0, b.shape[-1] ** -0.5, generator=gen)
        elif not torch.isfinite(b).all():
            b.zero_()
    return module


@dataclass
class Tiny:
    """What the helpers need to know about a family."""

    name: str
    latent_channels: int
    context_dim: int
    #: extra conditioning dict entries for comfy.sample (e.g. pooled_output for Flux)
    cond_extra: Callable[[], dict[str, Any]]
    #: extra kwargs for a direct diffusion_model call, given (batch, h_lat, w_lat)
    call_extra: Callable[[int, int, int], dict[str, Any]]
    #: the latent has a frame axis, ``[B, C, T, H, W]`` (Wan, Qwen-Image), sampled with one frame
    frames: bool = False


SPECS: dict[str, Tiny] = {}


def _patcher(model: torch.nn.Module, spec: Tiny) -> Any:
    import comfy.model_patcher

    model.eval()
    mp = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    model.nexfort_tiny = spec  # helpers read the family's spec from here (clones share the model)
    return mp


def tiny_sd15(seed: int = 0, depth: int = 1) -> Any:
    """SD1.5-family UNet, model_channels 32 (1.6M params at ``depth`` 1); ``depth`` transformer
    blocks per SpatialTransformer (SDXL-like stacks: depth 2 gives 6 + 8 identical blocks)."""
    boot()
    import comfy.supported_models

    unet_config = {
        "model_channels": 32, "in_channels": 4, "out_channels": 4, "num_res_blocks": [1, 1],
        "channel_mult": [1, 2], "transformer_depth": [depth, depth], "transformer_depth_output": [depth] * 4,
        "context_dim": 64, "num_heads": 2, "num_head_channels": -1, "use_linear_in_transformer": False,
        "adm_in_channels": None, "use_spatial_transformer": True, "legacy": False,
        "transformer_depth_middle": depth, "use_temporal_resblock": False, "use_temporal_attention": False,
        "dims": 2, "num_classes": None, "image_size": 32, "use_checkpoint": False,
    }
    model = init_weights(comfy.supported_models.SD15(unet_config).get_model({}), seed)
    spec = SPECS["sd15"]
    return _patcher(model, spec)


def tiny_pixart(seed: int = 0, depth: int = 2) -> Any:
    """PixArt-alpha DiT: ``depth`` (2) blocks, hidden 48 (micro-conditioning needs a multiple of 3), patch 2, micro-conditioning on."""
    boot()
    import comfy.supported_models

    unet_config = {
        "image_model": "pixart_alpha", "micro_condition": True, "input_size": 32, "patch_size": 2,
        "in_channels": 4, "hidden_size": 48, "depth": depth, "num_heads": 2, "caption_channels": 48,
        "pe_interpolation": 0.5, "model_max_length": 120, "learn_sigma": True, "pred_sigma": True,
    }
    model = init_weights(comfy.supported_models.PixArtAlpha(unet_config).get_model({}), seed)
    return _patcher(model, SPECS["pixart"])


_FLUX_TINY_CONFIG: dict[str, Any] = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32,
    "context_in_dim": 48, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
    "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2,
    "qkv_bias": True, "guidance_embed": True,
}


def _flux_config(**overrides: Any) -> dict[str, Any]:
    """The tiny Flux's ``unet_config`` for the running ComfyUI (``benchmarks.models.host_config``)."""
    from benchmarks.models import host_config

    return host_config({**_FLUX_TINY_CONFIG, **overrides})


def tiny_flux(seed: int = 0, depth: int = 1, depth_single: int = 1, weight_dtype: torch.dtype | None = None,
              scaled_fp8: bool = False) -> Any:
    """Flux DiT: ``depth`` (1) double + ``depth_single`` (1) single blocks, hidden 64, 2 heads, patch 2.
    ``weight_dtype=torch.float8_e4m3fn`` stores the weights in fp8 and computes in bf16 through
    ComfyUI's ``manual_cast`` ops, as its UNETLoader's ``weight_dtype: fp8_e4m3fn`` does;
    ``scaled_fp8`` gives the linears ComfyUI's ``scaled_fp8`` ops (a ``scale_weight`` each, 1 until
    set), as an fp8 checkpoint with scales loads."""
    boot()
    import comfy.supported_models

    unet_config = _flux_config(depth=depth, depth_single_blocks=depth_single)
    model_config = comfy.supported_models.Flux(unet_config)
    if weight_dtype is not None:
        model_config.set_inference_dtype(weight_dtype, torch.bfloat16)
    if scaled_fp8:
        model_config.scaled_fp8 = torch.float8_e4m3fn
    model = init_weights(model_config.get_model({}), seed)
    return _patcher(model, SPECS["flux"])


def tiny_flux_quantized(seed: int = 0) -> Any:
    """The tiny Flux in ComfyUI's mixed-precision checkpoint format: every block linear stored as an
    e4m3 ``QuantizedTensor`` with one scale (``layer_quant_config``, what newer fp8 checkpoints'
    ``_quantization_metadata`` gives), the rest in bf16; loaded through the model's state dict as
    ComfyUI's loader does."""
    import comfy.supported_models

    sd = tiny_flux(seed).model.diffusion_model.state_dict()
    quantized: dict[str, Any] = {}
    layers: dict[str, dict[str, str]] = {}
    for k, v in sd.items():
        if "blocks." in k and k.endswith(".weight") and v.dim() == 2:
            layer = k[: -len(".weight")]
            layers[layer] = {"format": "float8_e4m3fn"}
            scale = v.float().abs().amax() / 448
            quantized[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            quantized[f"{layer}.weight_scale"] = scale.reshape(())
        else:
            quantized[k] = v
    model_config = comfy.supported_models.Flux(_flux_config())
    if hasattr(model_config, "quant_config"):  # newer ComfyUI: each layer's format in the state dict
        import json

        import comfy.utils

        for layer, conf in layers.items():
            quantized[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        model_config.quant_config = comfy.utils.detect_layer_quantization(quantized, "")
    else:
        model_config.layer_quant_config = layers
    model_config.set_inference_dtype(torch.float32, torch.bfloat16)
    model = model_config.get_model({})
    missing, unexpected = model.diffusion_model.load_state_dict(quantized, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"quantized tiny Flux: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return _patcher(model, SPECS["flux"])


def tiny_sd3(seed: int = 0, depth: int = 2) -> Any:
    """SD3 MMDiT: ``depth`` (2) joint blocks (hidden 64 per block of depth), patch 2, RMS q/k norm,
    the first block's extra x self-attention (SD3.5's), pooled conditioning."""
    boot()
    import comfy.supported_models

    unet_config = {
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": depth, "adm_in_channels": 32,
        "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 48, "out_features": 64 * depth}},
        "pos_embed_max_size": 32, "num_patches": 1024, "pos_embed_scaling_factor": None, "qk_norm": "rms",
        "x_block_self_attn_layers": [0],
    }
    model = init_weights(comfy.supported_models.SD3(unet_config).get_model({}), seed)
    return _patcher(model, SPECS["sd3"])


def tiny_lumina2(seed: int = 0, depth: int = 2) -> Any:
    """Lumina Image 2.0 NextDiT: ``depth`` (2) layers and one refiner layer each for the image and
    the caption, hidden 64, 2 heads, 3-axis RoPE."""
    boot()
    import comfy.supported_models

    unet_config = {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 48,
        "n_layers": depth, "n_heads": 2, "n_kv_heads": 2, "axes_dims": [8, 12, 12], "axes_lens": [300, 512, 512],
        "rope_theta": 10000.0, "n_refiner_layers": 1, "qk_norm": True, "ffn_dim_multiplier": 1.0,
    }
    model = init_weights(comfy.supported_models.Lumina2(unet_config).get_model({}), seed)
    return _patcher(model, SPECS["lumina2"])


def tiny_wan21(seed: int = 0, depth: int = 2) -> Any:
    """Wan 2.1 text-to-video DiT: ``depth`` (2) blocks, hidden 64, 2 heads, patch (1, 2, 2); a
    one-frame latent is a text-to-image run."""
    boot()
    import comfy.supported_models

    unet_config = {
        "image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "text_len": 16, "in_dim": 16,
        "dim": 64, "ffn_dim": 128, "freq_dim": 32, "text_dim": 48, "out_dim": 16, "num_heads": 2, "num_layers": depth,
    }
    model = init_weights(comfy.supported_models.WAN21_T2V(unet_config).get_model({}), seed)
    return _patcher(model, SPECS["wan21"])


def tiny_qwen_image(seed: int = 0, depth: int = 2) -> Any:
    """Qwen-Image MMDiT: ``depth`` (2) blocks, 2 heads of 32, patch 2, 3-axis RoPE."""
    boot()
    import comfy.supported_models

    unet_config = {
        "image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": depth,
        "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 48, "axes_dims_rope": (8, 12, 12),
    }
    model = init_weights(comfy.supported_models.QwenImage(unet_config).get_model({}), seed)
    return _patcher(model, SPECS["qwen_image"])


def _no_extra(*_a: Any) -> dict[str, Any]:
    return {}


def _pooled() -> dict[str, Any]:
    return {"pooled_output": torch.randn(1, 32, generator=torch.Generator().manual_seed(7))}


SPECS.update(
    sd15=Tiny("sd15", 4, 64, _no_extra, _no_extra),
    pixart=Tiny("pixart", 4, 48, _no_extra, _no_extra),
    flux=Tiny(
        "flux", 16, 48,
        lambda: {"pooled_output": torch.randn(1, 32, generator=torch.Generator().manual_seed(7))},
        lambda b, h, w: {
            "y": torch.randn(b, 32, generator=torch.Generator().manual_seed(7)),
            "guidance": torch.full((b,), 3.5),
        },
    ),
    sd3=Tiny("sd3", 16, 48, _pooled, lambda b, h, w: {"y": torch.randn(b, 32, generator=torch.Generator().manual_seed(7))}),
    lumina2=Tiny("lumina2", 16, 48, _no_extra, _no_extra),
    wan21=Tiny("wan21", 16, 48, _no_extra, _no_extra, frames=True),
    qwen_image=Tiny("qwen_image", 16, 48, _no_extra, _no_extra, frames=True),
)

#: name -> (square, landscape, portrait) pixel sizes the family handles. PixArt derives its
#: position-embedding base size from round(latent side / 64): latents under 48 give a zero base.
RESOLUTIONS: dict[str, list[tuple[int, int]]] = {
    "sd15": [(64, 64), (64, 96), (96, 64)],
    "pixart": [(384, 384), (384, 512), (512, 384)],
    "flux": [(64, 64), (64, 96), (96, 64)],
    "sd3": [(64, 64), (64, 96), (96, 64)],
    "lumina2": [(64, 64), (64, 96), (96, 64)],
    "wan21": [(64, 64), (64, 96), (96, 64)],
    "qwen_image": [(64, 64), (64, 96), (96, 64)],
}

#: name -> builder
FAMILIES: dict[str, Callable[..., Any]] = {
    "sd15": tiny_sd15, "pixart": tiny_pixart, "flux": tiny_flux, "sd3": tiny_sd3, "lumina2": tiny_lumina2,
    "wan21": tiny_wan21, "qwen_image": tiny_qwen_image,
}


def _conds(spec: Tiny, ctx_len: int, seed: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, ctx_len, spec.context_dim, generator=gen), dict(spec.cond_extra())]]
    neg = [[torch.randn(1, ctx_len, spec.context_dim, generator=gen), dict(spec.cond_extra())]]
    return pos, neg


def sample(
    mp: Any,
    h: int = 64,
    w: int = 64,
    batch: int = 1,
    steps: int = 3,
    cfg: float = 5.0,
    ctx_len: int = 77,
    seed: int = 0,
    sampler: str = "euler",
    scheduler: str = "normal",
) -> torch.Tensor:
    """Denoise an empty latent through ComfyUI's real sampler (``comfy.sample.sample``)."""
    import comfy.sample

    spec: Tiny = mp.model.nexfort_tiny
    gen = torch.Generator().manual_seed(seed)
    frames = (1,) if spec.frames else ()
    latent = torch.zeros(batch, spec.latent_channels, *frames, h // 8, w // 8)
    noise = torch.randn(latent.shape, generator=gen)
    pos, neg = _conds(spec, ctx_len, seed + 1)
    return comfy.sample.sample(
        mp, noise, steps, cfg, sampler, scheduler, pos, neg, latent, seed=seed, disable_pbar=True
    )


def sd15_compiled_error(compile_model_patcher: Callable[[Any, Any], Any], options: Any, steps: int = 2) -> float:
    """The tiny SD1.5 UNet sampled eagerly, then through ``compile_model_patcher(mp, options)`` (the
    node layer's ``patcher.compile_model_patcher``): the compiled image's :func:`rel_err` to eager's."""
    mp = tiny_sd15()
    h, w = RESOLUTIONS["sd15"][0]
    ref = sample(mp, h, w, steps=steps)
    out = sample(compile_model_patcher(mp, options), h, w, steps=steps)
    return rel_err(out, ref)


def call_diffusion(
    mp: Any,
    h: int = 64,
    w: int = 64,
    batch: int = 1,
    ctx_len: int = 77,
    seed: int = 0,
    diffusion_model: Callable[..., Any] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Call the diffusion model (or ``diffusion_model``) directly on random inputs of this shape;
    ``dtype``: the latent, the context and the model's extra inputs in it (a 16-bit model), the
    timestep left in float32."""
    spec: Tiny = mp.model.nexfort_tiny
    gen = torch.Generator().manual_seed(seed)
    hl, wl = h // 8, w // 8
    x = torch.randn(batch, spec.latent_channels, hl, wl, generator=gen)
    t = torch.rand(batch, generator=gen) * (999 if spec.name != "flux" else 1.0)
    ctx = torch.randn(batch, ctx_len, spec.context_dim, generator=gen)
    extra = spec.call_extra(batch, hl, wl)
    if dtype is not None:
        x, ctx = x.to(dtype), ctx.to(dtype)
        extra = {k: v.to(dtype) for k, v in extra.items()}
    fn = diffusion_model if diffusion_model is not None else mp.model.diffusion_model
    # a fresh transformer_options each call: ComfyUI's models write into it (and their default
    # argument is a shared mutable {}), which would otherwise change Dynamo's guards between calls
    return fn(x, t, ctx, transformer_options={}, **extra)


def with_diffusion_model(mp: Any, fn: Callable[..., Any]) -> Any:
    """A clone of ``mp`` whose diffusion model is replaced by ``fn`` for each apply_model call."""
    from comfy.patcher_extension import WrappersMP

    def wrapper(executor, *args, **kwargs):
        base = executor.class_obj
        orig = base.diffusion_model
        base.diffusion_model = fn
        try:
            return executor(*args, **kwargs)
        finally:
            base.diffusion_model = orig

    m = mp.clone()
    m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "test", wrapper)
    return m


def rotations(batch: int, length: int, d: int, seed: int = 0) -> torch.Tensor:
    """Rotary-embedding matrices in ComfyUI's ``pe`` layout (``flux.math.rope``): float32
    ``[batch, 1, L, D/2, 2, 2]`` of random angles."""
    gen = torch.Generator().manual_seed(seed)
    angle = torch.randn(batch, 1, length, d // 2, generator=gen) * 3
    return torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], -1).reshape(batch, 1, length, d // 2, 2, 2)


def apply_rope1(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``flux.math.apply_rope1`` (float32 rotation, then ``x``'s dtype)."""
    x_ = x.to(dtype=freqs.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    out = freqs[..., 0] * x_[..., 0]
    out.addcmul_(freqs[..., 1], x_[..., 1])
    return out.reshape(*x.shape).type_as(x)


class FluxAttentionBlock(torch.nn.Module):
    """Flux's attention path in plain torch: a fused QKV projection, per-head RMSNorm and RoPE of
    q and k (what the fused RoPE pass turns into ``nexfort::rms_norm_rope``), SDPA, an output
    projection. Imports nothing of the engine: a new process that builds it has not registered
    the engine's ops."""

    def __init__(self, dim: int = 64, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.q_scale = torch.nn.Parameter(torch.randn(dim // heads) * 0.2 + 1)
        self.k_scale = torch.nn.Parameter(torch.randn(dim // heads) * 0.2 + 1)

    def forward(self, x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q = apply_rope1(torch.rms_norm(q, (q.shape[-1],), self.q_scale, 1e-6), pe)
        k = apply_rope1(torch.rms_norm(k, (k.shape[-1],), self.k_scale, 1e-6), pe)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(x.shape))


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the output scale (max |b|, at least 1e-6)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
