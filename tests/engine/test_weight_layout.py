"""weight_layout: conv weights kept channels-last outside the compiled graph.

The class on plain modules (what it converts, what it leaves, a replaced weight, inference
tensors, values unchanged), then through the engine with the GPU's layout patch applied on the
CPU (real Inductor): the weights are converted before the first compile, a weight the host
replaces later (ComfyUI's LoRA patching sets a new Parameter) is converted before the next call,
and neither costs a recompile or changes the output against eager.
"""

from __future__ import annotations

import pytest
import torch

import nexfort_engine
from nexfort_engine import shapes
from nexfort_engine.weight_layout import ChannelsLastWeights

CL = torch.channels_last


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.c = torch.nn.Conv2d(8, 8, 1)  # 1x1: contiguous is channels-last already
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(self.b(torch.nn.functional.silu(self.a(x))))
        return self.fc(h.mean(dim=(2, 3)))[:, :, None, None] + h


class _ComfyStyleConv(torch.nn.Conv2d):
    """A host's subclass (ComfyUI's comfy.ops.*.Conv2d are torch.nn.Conv2d subclasses)."""


def test_converts_conv_weights_only_and_keeps_values():
    net = _ConvNet()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    ref = net(x)
    cw = ChannelsLastWeights(net)
    assert cw.refresh() == 2 and cw.converted == 2
    assert net.a.weight.is_contiguous(memory_format=CL) and net.b.weight.is_contiguous(memory_format=CL)
    assert net.fc.weight.is_contiguous()  # not a conv: untouched
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(net(x), ref, rtol=1e-5, atol=1e-5)
    assert cw.refresh() == 0  # nothing replaced since


def test_a_replaced_weight_is_converted_at_the_next_refresh():
    conv = _ComfyStyleConv(4, 4, 3)
    cw = ChannelsLastWeights(torch.nn.Sequential(conv))
    assert cw.refresh() == 1
    new = torch.nn.Parameter(torch.randn(4, 4, 3, 3), requires_grad=False)  # LoRA-style replacement
    conv.weight = new
    assert cw.refresh() == 1
    assert conv.weight is new and new.is_contiguous(memory_format=CL)  # same Parameter, new layout
    conv.weight.data = conv.weight.data.contiguous()  # changed in place: the host's business
    assert cw.refresh() == 0 and cw.converted == 2


def test_inference_tensors_stay_inference_tensors():
    with torch.inference_mode():
        conv = torch.nn.Conv2d(4, 4, 3)
    assert conv.weight.is_inference()
    cw = ChannelsLastWeights(conv)
    assert cw.refresh() == 1
    assert conv.weight.is_inference() and conv.weight.is_contiguous(memory_format=CL)
    with torch.inference_mode():  # ComfyUI samples under inference mode
        conv2 = torch.nn.Conv2d(4, 4, 3)
        assert ChannelsLastWeights(conv2).refresh() == 1
    assert conv2.weight.is_inference()


@pytest.mark.inductor
def test_engine_converts_before_compiling_and_after_a_replacement(monkeypatch, tmp_path, fresh_stats, clean_dynamo):
    """Real Inductor (CPU) with the GPU's layout patch: converted before the first compile, a
    replaced weight converted before the next call, one graph, outputs equal to eager's."""
    monkeypatch.setattr(shapes, "layout_patches", lambda module, cuda: {"force_layout_optimization": True})
    torch.manual_seed(0)
    net = _ConvNet().eval().requires_grad_(False)  # as ComfyUI loads them
    cm = nexfort_engine.compile(net, {"mode": "O2"}, cache_dir=tmp_path, label="cl-weights")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        out = cm(x)
        assert net.a.weight.is_contiguous(memory_format=CL) and net.b.weight.is_contiguous(memory_format=CL)
        torch.testing.assert_close(out, net(x), rtol=1e-4, atol=1e-4)
        net.b.weight = torch.nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1, requires_grad=False)
        assert not net.b.weight.is_contiguous(memory_format=CL)
        out2 = cm(x)
        assert net.b.weight.is_contiguous(memory_format=CL)
        torch.testing.assert_close(out2, net(x), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(out2, out)  # the new weight was used
    rec = fresh_stats()["models"][cm.label]
    assert rec["compiles"] == 1 and rec["recompiles"] == 0 and rec["fallbacks"] == 0
    assert rec["channels_last_weights"] >= 2


class _Block(torch.nn.Module):
    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1) if conv else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.fc(h.movedim(1, -1)).movedim(-1, 1)
        return self.conv(h) if self.conv is not None else h


class _RegionalNet(torch.nn.Module):
    """Convolutions in the glue around a stack of 4 identical blocks (a UNet's transformer blocks
    have none; ``conv_blocks`` puts one in each block instead)."""

    def __init__(self, conv_blocks: bool) -> None:
        super().__init__()
        for i in range(4):  # not a ModuleList: not a region
            setattr(self, f"glue{i}", torch.nn.Conv2d(8, 8, 3, padding=1))
        self.blocks = torch.nn.ModuleList(_Block(conv_blocks) for _ in range(4))

    @property
    def glue(self) -> list[torch.nn.Conv2d]:
        return [getattr(self, f"glue{i}") for i in range(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, block in zip(self.glue, self.blocks, strict=True):
            x = block(conv(x))
        return x


@pytest.mark.parametrize("conv_blocks", [False, True])
def test_regional_compile_converts_only_the_compiled_blocks_convs(monkeypatch, clean_dynamo, conv_blocks):
    """Under regional compilation the glue runs eager: its conv weights keep their layout (cuDNN
    would otherwise hand channels-last outputs to eager ops that copy them back); convolutions
    inside the compiled blocks are converted as in a whole-model compile."""
    real = shapes.layout_patches
    monkeypatch.setattr(shapes, "layout_patches", lambda module, cuda: real(module, True))  # as on a GPU
    net = _RegionalNet(conv_blocks).eval().requires_grad_(False)
    x = torch.randn(1, 8, 6, 6)
    cm = nexfort_engine.compile(net, {"mode": "O2", "regional": True}, cache_dir=None)
    cm._setup(x)  # decides; nothing is compiled or converted before the first compiled call
    assert not any(b.conv.weight.is_contiguous(memory_format=CL) for b in net.blocks if b.conv is not None)  # eager calls keep the layout
    if cm._nx_conv_weights is not None:
        cm._refresh_conv_weights()  # what every compiled call does first
    assert [r.name for r in cm._nx_regions] == ["blocks[_Blockx4]"]
    assert not any(c.weight.is_contiguous(memory_format=CL) for c in net.glue)
    assert all(b.conv.weight.is_contiguous(memory_format=CL) for b in net.blocks) if conv_blocks else True
    assert (cm._nx_conv_weights is not None) is conv_blocks
    whole = nexfort_engine.compile(net, {"mode": "O2", "regional": False}, cache_dir=None)
    whole._setup(x)
    whole._refresh_conv_weights()
    assert all(c.weight.is_contiguous(memory_format=CL) for c in net.glue)


def test_cpu_conv_net_compiles_without_inductor_layout_choice_unless_asked(clean_dynamo):
    """On CPU a conv net's settings turn Inductor's layout choice off (it copied every conv weight
    in every call) and leave the weights as they are; a user's own ``inductor.layout_optimization``
    option wins over the patch, as any explicit option does."""
    x = torch.randn(1, 8, 6, 6)
    net = _RegionalNet(True).eval().requires_grad_(False)
    assert shapes.conv_count(net) >= shapes.MIN_CONVS
    cm = nexfort_engine.compile(net, {"mode": "O2", "regional": False}, cache_dir=None)
    cm._setup(x)  # decides; nothing is compiled before the first call
    assert cm._nx_settings.inductor["layout_optimization"] is False
    assert "force_layout_optimization" not in cm._nx_settings.inductor
    assert cm._nx_conv_weights is None and not any(
        m.weight.is_contiguous(memory_format=CL) for m in net.modules() if isinstance(m, torch.nn.Conv2d)
        and m.kernel_size != (1, 1))
    mine = nexfort_engine.compile(net, {"mode": "O2", "regional": False, "options": {"inductor.layout_optimization": True}},
                                  cache_dir=None)
    mine._setup(x)
    assert mine._nx_settings.inductor["layout_optimization"] is True
