"""``nodes/prewarm.py``: the on-prompt handler that starts the engine's prewarm, without a server
(a stand-in with ComfyUI's ``add_on_prompt_handler`` / ``on_prompt_handlers``); the real server
path is in test_host_integration's restart test."""

from __future__ import annotations

import json

import pytest
from pack_modules import nodes_module

from nexfort_engine import prewarm


class _Server:
    def __init__(self):
        self.on_prompt_handlers = []

    def add_on_prompt_handler(self, handler):
        self.on_prompt_handlers.append(handler)


@pytest.fixture
def hook():
    with nodes_module("prewarm") as mod:
        yield mod
    prewarm.reset()


def test_registered_once(hook):
    server = _Server()
    assert hook.register_prewarm(server) is True
    assert hook.register_prewarm(server) is False and server.on_prompt_handlers == [hook.on_prompt]
    assert hook.register_prewarm(object()) is False  # not a PromptServer


def test_first_prompt_starts_the_prewarm_and_passes_the_prompt_on(hook, tmp_path, monkeypatch):
    monkeypatch.setenv("NEXFORT_CACHE_DIR", str(tmp_path))
    (tmp_path / prewarm.FILE).write_text(json.dumps({"version": prewarm.VERSION, "modules": ["torch.fx"]}))
    prewarm.reset()
    prompt = {"prompt": {"1": {"class_type": "KSampler"}}, "client_id": "x"}
    assert hook.on_prompt(prompt) is prompt
    prewarm.wait()
    assert prewarm.status()["state"] == "done"
    assert hook.on_prompt(prompt) is prompt  # later prompts: nothing new


def test_a_failing_prewarm_never_fails_the_prompt(hook, monkeypatch):
    def boom(root, background=True):
        raise OSError("cache dir unreadable")

    monkeypatch.setattr(prewarm, "start", boom)
    monkeypatch.setenv("NEXFORT_CACHE_DIR", "/nonexistent")
    prompt = {"prompt": {}}
    assert hook.on_prompt(prompt) is prompt
