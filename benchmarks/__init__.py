"""Benchmarks: eager vs ComfyUI's torch.compile vs nexfort through ComfyUI's real sampler path.

* :mod:`benchmarks.models` - the benchmarked families (SD2.1, SDXL, PixArt-alpha, Flux-dev, Wan 2.1
  1.3B) as ComfyUI ``unet_config`` dicts, built with ComfyUI's own classes at real sizes (or tiny
  twins for CPU tests), random weights drawn on the target device, random conditioning.
* :mod:`benchmarks.metrics` - step timing (CUDA events), peak memory, compile counters, errors.
* :mod:`benchmarks.text_to_image` - the command line tool (one model x one compiler per process).
* :mod:`benchmarks.report` - JSON results -> the seeds-style Markdown table and a speed-up chart.

Nothing here is imported by the pack; it needs a ComfyUI tree on ``sys.path`` (``--comfy-root``).
"""
