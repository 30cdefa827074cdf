"""The benchmarked model families, built through ComfyUI's own classes with random weights.

Each :class:`ModelSpec` holds the ``unet_config`` that ``comfy.model_detection.detect_unet_config``
derives from the released checkpoint (real sizes), a tiny twin of the same architecture for CPU
tests, and what the sampler needs: latent shape, text-context shape, pooled vector, guidance, cfg.

:func:`build` follows ``comfy.sd.load_diffusion_model_state_dict``: ComfyUI picks the weight dtype
(``model_management.unet_dtype`` from the released weights' dtype) and the manual-cast dtype, and
``supported_models.<X>(unet_config).get_model(..., device=...)`` creates the layers straight on the
target device (``comfy.ops`` layers are uninitialised); :func:`init_weights` then draws small
random normals in place on that device, so no CPU time is spent on billions of parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

#: SD2.1 768-v, from comfy.model_detection (unet_config_from_diffusers_unet's SD21)
_SD21 = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1, "use_linear_in_transformer": True,
    "context_dim": 1024, "num_head_channels": 64, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
_SD21_TINY = dict(
    _SD21, model_channels=64, num_res_blocks=[1, 1], transformer_depth=[1, 1], channel_mult=[1, 2],
    transformer_depth_output=[1, 1, 1, 1], context_dim=64,
)

#: SDXL base 1.0
_SDXL = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# adm = pooled (32) + 6 size embeddings of 256 (SDXL.encode_adm)
_SDXL_TINY = dict(
    _SDXL, model_channels=64, num_res_blocks=[1, 1], transformer_depth=[0, 1], channel_mult=[1, 2],
    transformer_depth_middle=1, transformer_depth_output=[0, 0, 1, 1], context_dim=64, adm_in_channels=1536 + 32,
)

#: PixArt-alpha XL-2 1024-MS
_PIXART = {
    "image_model": "pixart_alpha", "num_heads": 16, "patch_size": 2, "hidden_size": 1152, "in_channels": 4,
    "depth": 28, "model_max_length": 120, "input_size": 128, "pe_interpolation": 2, "micro_condition": True,
}
# hidden must be a multiple of 3 (micro-conditioning); latents under 48 give PixArt a zero PE base size
_PIXART_TINY = dict(_PIXART, hidden_size=48, depth=2, num_heads=2, caption_channels=48, input_size=32,
                    pe_interpolation=0.5)

#: Flux.1-dev
_FLUX = {
    "image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
    "out_channels": 16, "qkv_bias": True, "in_channels": 16, "hidden_size": 3072, "context_in_dim": 4096,
    "patch_size": 2, "vec_in_dim": 768, "depth": 19, "depth_single_blocks": 38, "guidance_embed": True,
}
_FLUX_TINY = dict(_FLUX, axes_dim=[8, 12, 12], num_heads=2, mlp_ratio=2.0, hidden_size=64, context_in_dim=48,
                  vec_in_dim=32, depth=1, depth_single_blocks=1)

#: Wan 2.1 T2V 1.3B
_WAN = {
    "image_model": "wan2.1", "model_type": "t2v", "dim": 1536, "out_dim": 16, "num_heads": 12, "ffn_dim": 8960,
    "num_layers": 30, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
    "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16,
}
_WAN_TINY = dict(_WAN, dim=64, num_heads=2, ffn_dim=128, num_layers=2, text_dim=48, freq_dim=32)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked family at one size (full or tiny)."""

    name: str
    title: str
    #: ``comfy.supported_models`` class name (what model_detection picks for the checkpoint)
    config_class: str
    unet_config: dict[str, Any]
    #: dtype of the released weights (decides ComfyUI's unet_dtype)
    weight_dtype: torch.dtype
    height: int
    width: int
    latent_channels: int
    text_len: int
    text_dim: int
    cfg: float
    sampler: str = "euler"
    scheduler: str = "normal"
    frames: int | None = None
    pooled_dim: int | None = None
    guidance: float | None = None
    #: cond-dict entries that carry the image size (SDXL's adm, PixArt's micro-conditioning)
    size_conds: bool = False
    #: fake state-dict entries that steer ``model_type`` (SD2.1's v-prediction detection)
    detect_state_dict: dict[str, Any] = field(default_factory=dict)
    #: --run_multiple_resolutions: (height, width) pairs and prompt lengths swept
    sweep_resolutions: tuple[tuple[int, int], ...] = ()
    sweep_text_lens: tuple[int, ...] = ()
    #: approximate parameter count (for the fp32-reference affordability check)
    params: float = 0.0

    def latent_shape(self, batch: int, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        h, w = height // 8, width // 8
        if self.frames is not None:
            t = ((frames or self.frames) - 1) // 4 + 1
            return (batch, self.latent_channels, t, h, w)
        return (batch, self.latent_channels, h, w)


def _v_pred_state_dict() -> dict[str, Any]:
    # SD20.model_type: v-prediction when this norm bias has std > 0.09 (as in the 768-v checkpoint)
    return {"output_blocks.11.1.transformer_blocks.0.norm1.bias": torch.linspace(-1.0, 1.0, 320)}


FULL: dict[str, ModelSpec] = {
    "sd21": ModelSpec(
        "sd21", "SD2.1 (768-v)", "SD20", _SD21, torch.float16, 768, 768, 4, 77, 1024, 7.0,
        detect_state_dict=_v_pred_state_dict(),
        sweep_resolutions=((768, 768), (512, 512), (512, 768), (1024, 768)), sweep_text_lens=(77, 154),
        params=0.87e9,
    ),
    "sdxl": ModelSpec(
        "sdxl", "SDXL base", "SDXL", _SDXL, torch.float16, 1024, 1024, 4, 77, 2048, 7.0, pooled_dim=1280,
        size_conds=True,
        sweep_resolutions=((1024, 1024), (768, 768), (832, 1216), (1216, 832)), sweep_text_lens=(77, 154),
        params=2.6e9,
    ),
    "pixart": ModelSpec(
        "pixart", "PixArt-alpha XL-2 1024", "PixArtAlpha", _PIXART, torch.float16, 1024, 1024, 4, 120, 4096, 4.5,
        size_conds=True,
        sweep_resolutions=((1024, 1024), (768, 768), (768, 1024), (1024, 768)), sweep_text_lens=(120, 60),
        params=0.61e9,
    ),
    "flux": ModelSpec(
        "flux", "Flux.1-dev", "Flux", _FLUX, torch.bfloat16, 1024, 1024, 16, 512, 4096, 1.0, scheduler="simple",
        pooled_dim=768, guidance=3.5,
        sweep_resolutions=((1024, 1024), (768, 768), (768, 1024), (1024, 768)), sweep_text_lens=(512, 256),
        params=11.9e9,
    ),
    "wan": ModelSpec(
        "wan", "Wan 2.1 T2V 1.3B", "WAN21_T2V", _WAN, torch.float16, 480, 832, 16, 512, 4096, 5.0,
        scheduler="simple", frames=33,
        sweep_resolutions=((480, 832), (832, 480), (480, 480), (512, 768)), sweep_text_lens=(512, 256),
        params=1.4e9,
    ),
}

TINY: dict[str, ModelSpec] = {
    "sd21": ModelSpec(
        "sd21", "SD2.1 (tiny)", "SD20", _SD21_TINY, torch.float32, 64, 64, 4, 77, 64, 7.0,
        detect_state_dict=_v_pred_state_dict(),
        sweep_resolutions=((64, 64), (64, 96), (96, 64), (96, 96)), sweep_text_lens=(77, 154), params=1e6,
    ),
    "sdxl": ModelSpec(
        "sdxl", "SDXL (tiny)", "SDXL", _SDXL_TINY, torch.float32, 64, 64, 4, 77, 64, 7.0, pooled_dim=32,
        size_conds=True,
        sweep_resolutions=((64, 64), (64, 96), (96, 64), (96, 96)), sweep_text_lens=(77, 154), params=1e6,
    ),
    "pixart": ModelSpec(
        "pixart", "PixArt-alpha (tiny)", "PixArtAlpha", _PIXART_TINY, torch.float32, 384, 384, 4, 120, 48, 4.5,
        size_conds=True,
        sweep_resolutions=((384, 384), (384, 512), (512, 384), (512, 512)), sweep_text_lens=(120, 60), params=1e5,
    ),
    "flux": ModelSpec(
        "flux", "Flux (tiny)", "Flux", _FLUX_TINY, torch.float32, 64, 64, 16, 64, 48, 1.0, scheduler="simple",
        pooled_dim=32, guidance=3.5,
        sweep_resolutions=((64, 64), (64, 96), (96, 64), (96, 96)), sweep_text_lens=(64, 32), params=1e5,
    ),
    "wan": ModelSpec(
        "wan", "Wan 2.1 (tiny)", "WAN21_T2V", _WAN_TINY, torch.float32, 64, 64, 16, 32, 48, 5.0,
        scheduler="simple", frames=5,
        sweep_resolutions=((64, 64), (64, 96), (96, 64), (96, 96)), sweep_text_lens=(32, 16), params=1e5,
    ),
}

MODELS = tuple(FULL)


def get_spec(name: str, tiny: bool = False) -> ModelSpec:
    table = TINY if tiny else FULL
    if name not in table:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(table)}")
    return table[name]


def pick_dtypes(spec: ModelSpec, device: torch.device, override: str | None = None) -> tuple[torch.dtype, Any]:
    """(weight dtype, manual-cast dtype) exactly as ComfyUI's diffusion-model loader picks them."""
    import comfy.model_management as mm
    import comfy.supported_models

    config_cls = getattr(comfy.supported_models, spec.config_class)
    supported = list(config_cls.supported_inference_dtypes)
    if override:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                 "fp8_e4m3fn": torch.float8_e4m3fn}[override]
    else:
        dtype = mm.unet_dtype(device=device, model_params=int(spec.params), supported_dtypes=supported,
                              weight_dtype=spec.weight_dtype)
    manual_cast = mm.unet_manual_cast(dtype, device, supported)
    return dtype, manual_cast


def check_detection(spec: ModelSpec) -> str:
    """The supported_models class ComfyUI's detection maps this unet_config to (sanity check)."""
    import comfy.model_detection

    cfg = comfy.model_detection.model_config_from_unet_config(dict(spec.unet_config), dict(spec.detect_state_dict))
    return type(cfg).__name__ if cfg is not None else "none"


@torch.no_grad()
def init_weights(module: torch.nn.Module, seed: int = 0, draw_device: torch.device | None = None) -> torch.nn.Module:
    """Small random normals in place.

    Matrices/kernels get N(0, 1/fan_in) (activations stay O(1) through deep stacks); 1-D
    parameters: norm scales 1, biases N(0, 0.02^2), other vectors N(0, 0.02^2). Drawn on
    ``draw_device`` (default: each parameter's own device) and copied in, so a model built on the
    CPU gets the very values it would get on the GPU, drawn at GPU speed (the CPU generator draws
    Flux's 12 B values in about 300 s). Deterministic for a seed and draw device, so a second
    process rebuilds the same model.
    """
    gen_by_device: dict[str, torch.Generator] = {}
    for name, p in module.named_parameters():
        dev = torch.device(draw_device) if draw_device is not None else p.device
        gen = gen_by_device.get(str(dev))
        if gen is None:
            gen = torch.Generator(device=dev).manual_seed(seed)
            gen_by_device[str(dev)] = gen
        # weights stored in fp8 (--dtype fp8_e4m3fn) are drawn in bf16 and cast
        draw_dtype = torch.bfloat16 if p.dtype.itemsize == 1 else p.dtype
        t = p if draw_dtype == p.dtype and dev == p.device else torch.empty(p.shape, device=dev, dtype=draw_dtype)
        if p.dim() <= 1:
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf in ("weight", "scale"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
        else:
            fan_in = p[0].numel()
            t.normal_(0.0, 1.0 / math.sqrt(max(fan_in, 1)), generator=gen)
        if t is not p:
            p.copy_(t)
    for _name, b in module.named_buffers():
        if b.is_floating_point() and not torch.isfinite(b).all():
            b.zero_()
    return module


def host_unet_config(spec: ModelSpec) -> dict[str, Any]:
    """``spec.unet_config`` for the running ComfyUI (see :func:`host_config`)."""
    return host_config(spec.unet_config)


def host_config(unet_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``unet_config`` for the running ComfyUI: newer ones' ``FluxParams`` also require
    ``txt_ids_dims``, which their detection sets to ``[]`` for Flux.1 (0.3.75 has no such field)."""
    import dataclasses

    config = dict(unet_config)
    if config.get("image_model") == "flux":
        import comfy.ldm.flux.model

        if "txt_ids_dims" in {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:
            config.setdefault("txt_ids_dims", [])
    return config


def build(spec: ModelSpec, device: torch.device, dtype: torch.dtype, manual_cast: Any, seed: int = 0,
          weights_device: torch.device | None = None) -> Any:
    """A ``comfy.model_patcher.ModelPatcher`` over a random-weight model that loads on ``device``,
    its weights built on ``weights_device`` (default ``device``; the CPU: as ComfyUI's checkpoint
    loader leaves a model, the patcher then offloads there and its first load moves them)."""
    load_device = device
    device = weights_device if weights_device is not None else device
    import comfy.model_patcher
    import comfy.supported_models

    config_cls = getattr(comfy.supported_models, spec.config_class)
    model_config = config_cls(host_unet_config(spec))
    model_config.set_inference_dtype(dtype, manual_cast)
    model = model_config.get_model(dict(spec.detect_state_dict), "", device=device)
    model = model.to(device)  # a few parameters are created with plain torch.randn on the CPU
    model.eval()
    # weights built on the CPU are drawn on the load device: the same values wherever they are built
    init_weights(model.diffusion_model, seed, draw_device=load_device if device != load_device else None)
    return comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=device)


def build_controlnet(spec: ModelSpec, device: torch.device, dtype: torch.dtype, manual_cast: Any,
                     seed: int = 1) -> Any:
    """A ``comfy.controlnet.ControlNet`` (ComfyUI's ``cldm`` ControlNet: the UNet's encoder, a hint
    encoder and zero convolutions) sized for a UNet ``spec``, random weights, as ComfyUI's
    ``ControlNetLoader`` builds it from a file: same dtype and operations as the model."""
    if spec.config_class not in ("SD20", "SDXL", "SD15"):
        raise ValueError(f"--controlnet: {spec.name} is not a UNet (sd21, sdxl)")
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops

    config = {k: v for k, v in host_unet_config(spec).items() if k != "out_channels"}
    config.update(hint_channels=3, operations=comfy.ops.pick_operations(dtype, manual_cast), dtype=dtype,
                  device=device)
    model = comfy.cldm.cldm.ControlNet(**config).to(device).eval()
    init_weights(model, seed)
    return comfy.controlnet.ControlNet(model, load_device=device, manual_cast_dtype=manual_cast)


def build_fp32_twin(spec: ModelSpec, device: torch.device, source: Any) -> Any:
    """The same model in float32 (weights upcast from ``source``'s): the accuracy reference."""
    import comfy.model_patcher
    import comfy.supported_models

    config_cls = getattr(comfy.supported_models, spec.config_class)
    model_config = config_cls(host_unet_config(spec))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model(dict(spec.detect_state_dict), "", device=device).to(device).eval()
    src = source.model.diffusion_model.state_dict()
    dst = model.diffusion_model.state_dict()
    with torch.no_grad():
        for k, v in dst.items():
            v.copy_(src[k].to(device=v.device, dtype=v.dtype))
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


def conditioning(
    spec: ModelSpec, height: int, width: int, text_len: int | None = None, seed: int = 1234
) -> tuple[list, list]:
    """Random positive/negative conditioning in ComfyUI's ``[[tensor, dict]]`` form (CPU tensors)."""
    text_len = text_len or spec.text_len
    gen = torch.Generator().manual_seed(seed)

    def one() -> list:
        ctx = torch.randn(1, text_len, spec.text_dim, generator=gen)
        extra: dict[str, Any] = {}
        if spec.pooled_dim:
            extra["pooled_output"] = torch.randn(1, spec.pooled_dim, generator=gen)
        if spec.guidance is not None:
            extra["guidance"] = spec.guidance
        if spec.size_conds:
            extra.update(width=width, height=height, target_width=width, target_height=height)
        return [[ctx, extra]]

    return one(), one()
