"""The Cache Manager's text report says how each model was compiled, from the engine's counters."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

import nexfort_engine
from nexfort_engine import counters
from nexfort_engine.cache import CacheStore

REPO = Path(__file__).resolve().parent.parent.parent
PKG = "_nexfort_pack_report"


@pytest.fixture
def cache_manager(comfy_inproc):
    pack = types.ModuleType(PKG)
    pack.__path__ = [str(REPO)]
    sub = types.ModuleType(f"{PKG}.nodes")  # not executing nodes/__init__.py (it registers the nodes)
    sub.__path__ = [str(REPO / "nodes")]
    sys.modules[PKG], sys.modules[f"{PKG}.nodes"] = pack, sub
    try:
        yield importlib.import_module(f"{PKG}.nodes.cache_manager")
    finally:
        for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
            del sys.modules[name]


def test_report_names_regions_fp8_and_the_spatial_multiple(cache_manager, tmp_path, fresh_stats):
    counters.set_info("UNetModel:aa", state="compiled", spatial_multiple=8)
    counters.bump("UNetModel:aa", "compiles")
    counters.set_info("PixArt:bb", state="compiled", regions=["blocks[x28]"], fp8=True)
    counters.add_reason("UNetModel:aa", "recompile", "0/0: tensor 'x' rank mismatch. expected 6, actual 4")
    text = cache_manager.report(CacheStore(tmp_path))
    unet = next(line for line in text.splitlines() if line.strip().startswith("UNetModel:aa"))
    pixart = next(line for line in text.splitlines() if line.strip().startswith("PixArt:bb"))
    assert "whole model, latent sizes traced as multiples of 8" in unet
    assert "regional: blocks[x28], fp8 linears" in pixart and "multiples" not in pixart
    assert "recompile: 0/0: tensor 'x' rank mismatch" in text
    assert nexfort_engine.stats()["models"]["UNetModel:aa"]["spatial_multiple"] == 8
