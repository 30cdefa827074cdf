"""Start a real, headless ComfyUI, run API-format prompts on it, stop it. Used by the demo and tests.

Only the standard library plus aiohttp (a ComfyUI dependency, for the progress websocket)::

    with ComfyServer(host_dir, base_dir=tmp, env={"NEXFORT_CACHE_DIR": ...}) as srv:
        result = srv.run(prompt)            # POST /prompt, follow /ws, poll /history/<id>
        result.images, result.step_seconds("3"), srv.stats()

The server is started as ``main.py --cpu --use-pytorch-cross-attention --disable-api-nodes --listen
127.0.0.1 --port <free>`` (without ``--cpu`` where ``cpu=False``) in its own process group;
stdout/stderr go to a log file whose tail is included in every error. ``make_base_dir`` builds an isolated ``--base-directory`` (models, custom
nodes, user, output) so tests never touch the developer's host tree or compile cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACK_NAME = "nexfort"


class ComfyServerError(RuntimeError):
    """The server failed to start, rejected a prompt, or a prompt failed; message has the log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_base_dir(base: str | os.PathLike, checkpoints: list[str | os.PathLike] = (),
                  pack: str | os.PathLike = REPO_ROOT) -> Path:
    """Create an isolated ComfyUI base directory: the pack symlinked into ``custom_nodes/`` and the
    given checkpoint files symlinked into ``models/checkpoints/``. Idempotent."""
    base = Path(base)
    for sub in ("models/checkpoints", "custom_nodes", "input", "output", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_NAME
    if not link.exists():
        link.symlink_to(Path(pack).resolve(), target_is_directory=True)
    for ckpt in checkpoints:
        ckpt = Path(ckpt).resolve()
        dst = base / "models" / "checkpoints" / ckpt.name
        if not dst.exists():
            dst.symlink_to(ckpt)
    return base


@dataclass
class PromptResult:
    """What a finished prompt left behind."""

    prompt_id: str
    history: dict
    output_dir: Path
    events: list = field(default_factory=list)  # (monotonic seconds, type, data) from the websocket

    @property
    def status(self) -> dict:
        return self.history.get("status", {})

    @property
    def messages(self) -> list:
        return self.status.get("messages", [])

    @property
    def outputs(self) -> dict:
        return self.history.get("outputs", {})

    @property
    def images(self) -> list[Path]:
        """Files of every image output (SaveImage etc.) that is on disk."""
        out = []
        for node_out in self.outputs.values():
            for img in node_out.get("images", []):
                if img.get("type") != "output":
                    continue
                out.append(self.output_dir / img.get("subfolder", "") / img["filename"])
        return out

    def timestamp(self, kind: str) -> float | None:
        """Server timestamp (seconds) of a status message, e.g. ``execution_start``."""
        for name, data in self.messages:
            if name == kind and "timestamp" in data:
                return data["timestamp"] / 1000.0
        return None

    @property
    def execution_seconds(self) -> float | None:
        start, end = self.timestamp("execution_start"), self.timestamp("execution_success")
        return None if start is None or end is None else end - start

    def step_times(self, node_id: str | None = None) -> list[float]:
        """Monotonic arrival times of the websocket ``progress`` events (one per sampler step)."""
        return [t for t, kind, data in self.events
                if kind == "progress" and data.get("prompt_id") == self.prompt_id
                and (node_id is None or str(data.get("node")) == str(node_id))]

    def step_seconds(self, node_id: str | None = None) -> list[float]:
        """Seconds between consecutive sampler steps (excludes the first step, which holds warm-up
        and, for a compiled model, compilation)."""
        t = self.step_times(node_id)
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def node_start(self, node_id: str) -> float | None:
        for t, kind, data in self.events:
            if kind == "executing" and str(data.get("node")) == str(node_id):
                return t
        return None


class _ProgressListener:
    """Collects websocket messages for one client id in a background thread."""

    def __init__(self, url: str, client_id: str):
        self.url = url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
        self.events: list = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        self._ready.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # the websocket is a nicety: prompts still complete via /history
            self._ready.set()

    async def _main(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(self.url, heartbeat=30) as ws:
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        msg = await ws.receive(timeout=0.2)
                    except asyncio.TimeoutError:
                        continue
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        data = json.loads(msg.data)
                        self.events.append((time.monotonic(), data.get("type"), data.get("data") or {}))
                    elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                        return


class ComfyServer:
    """A ComfyUI server process owned by this object."""

    def __init__(self, host_dir: str | os.PathLike, base_dir: str | os.PathLike | None = None,
                 port: int | None = None, log_path: str | os.PathLike | None = None,
                 env: dict | None = None, extra_args: list[str] = (), python: str = sys.executable,
                 cpu: bool = True):
        """``cpu=False`` starts ComfyUI without ``--cpu`` (on its default device: the GPU where there is
        one); ``extra_args`` are appended to the command line (e.g. ``["--preview-method", "auto"]``)."""
        self.host_dir = Path(host_dir).resolve()
        self.base_dir = Path(base_dir).resolve() if base_dir else None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root = self.base_dir or self.host_dir
        self.output_dir = root / "output"
        self.log_path = Path(log_path) if log_path else root / f"comfyui-{self.port}.log"
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.python = python
        self.cpu = cpu
        self.proc: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex
        self._log_file = None

    # -- lifecycle -------------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [self.python, "main.py", *(["--cpu"] if self.cpu else []), "--use-pytorch-cross-attention",
               "--disable-api-nodes", "--listen", "127.0.0.1", "--port", str(self.port)]
        if self.base_dir:
            cmd += ["--base-directory", str(self.base_dir)]
        return cmd + self.extra_args

    def start(self, timeout: float = 180.0) -> ComfyServer:
        if not (self.host_dir / "main.py").is_file():
            raise ComfyServerError(f"no ComfyUI at {self.host_dir}: run `make host` (scripts/setup_host.sh)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(self.command(), cwd=self.host_dir, env=env, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComfyServerError(f"ComfyUI exited with code {self.proc.returncode} while starting"
                                       + self.log_tail_text())
            try:
                self.get_json("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.5)
        self.stop()
        raise ComfyServerError(f"ComfyUI did not answer on {self.url} within {timeout:.0f} s"
                               + self.log_tail_text())

    def stop(self, timeout: float = 20.0) -> int | None:
        """Interrupt the server (it exits cleanly on SIGINT), escalating to SIGTERM/SIGKILL."""
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    rc = proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        elif proc is not None:
            rc = proc.returncode
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        return rc

    def restart(self, timeout: float = 180.0) -> ComfyServer:
        """Stop and start again (same base dir, env and port): a new process, persistent dirs kept."""
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> ComfyServer:
        return self if self.proc else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- logs ------------------------------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_tail_text(self, lines: int = 60) -> str:
        return f"\n--- last {lines} lines of {self.log_path} ---\n{self.log_tail(lines)}"

    # -- HTTP ------------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 30.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def get_json(self, path: str, timeout: float = 30.0):
        return self.request("GET", path, timeout=timeout)

    def object_info(self) -> dict:
        return self.get_json("/object_info", timeout=60)

    def stats(self) -> dict | None:
        """``GET /nexfort/stats`` ({"engine": ..., "cache": ...}), or None where the route is absent."""
        try:
            return self.get_json("/nexfort/stats")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    # -- prompts ---------------------------------------------------------------------------------
    def submit(self, prompt: dict) -> str:
        """POST an API-format graph; returns the prompt id. Validation errors raise with details."""
        try:
            resp = self.request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            raise ComfyServerError(f"ComfyUI rejected the prompt ({e.code}): {detail}") from e
        return resp["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        return (self.get_json(f"/history/{prompt_id}") or {}).get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = 600.0, progress=None) -> dict:
        """Poll ``/history/<id>`` until the prompt completes; raise if it errors or the server dies."""
        deadline = time.monotonic() + timeout
        last_note = time.monotonic()
        while time.monotonic() < deadline:
            entry = self.history(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None \
                    and entry["status"].get("status_str") in ("success", "error"):
                if entry["status"]["status_str"] != "success":
                    errors = [m for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
                    raise ComfyServerError(f"prompt {prompt_id} failed: {json.dumps(errors)[:4000]}"
                                           + self.log_tail_text())
                return entry
            if not self.running:
                raise ComfyServerError(f"ComfyUI exited while running prompt {prompt_id}" + self.log_tail_text())
            if progress and time.monotonic() - last_note > 10:
                progress(time.monotonic() - (deadline - timeout))
                last_note = time.monotonic()
            time.sleep(0.25)
        raise ComfyServerError(f"prompt {prompt_id} did not finish within {timeout:.0f} s" + self.log_tail_text())

    def run(self, prompt: dict, timeout: float = 600.0, progress=None) -> PromptResult:
        """Submit ``prompt``, wait for it, and return its history, images and websocket events."""
        listener = _ProgressListener(self.url, self.client_id)
        listener.start()
        try:
            prompt_id = self.submit(prompt)
            entry = self.wait(prompt_id, timeout, progress)
            time.sleep(0.2)  # let the last websocket messages arrive
        finally:
            listener.stop()
        return PromptResult(prompt_id, entry, self.output_dir, listener.events)


#: the websocket listener ``run`` uses, for callers that follow a whole session of prompts
ProgressListener = _ProgressListener


def load_workflow(path: str | os.PathLike) -> dict:
    """Read an API-format workflow (``{"<node id>": {"class_type": ..., "inputs": ...}}``)."""
    graph = json.loads(Path(path).read_text())
    if not all(isinstance(v, dict) and "class_type" in v for v in graph.values()):
        raise ValueError(f"{path} is not an API-format workflow (export it with 'Save (API)')")
    return graph


def set_seed(graph: dict, seed: int) -> dict:
    """Copy of ``graph`` with every sampler's seed set (ComfyUI caches identical prompts)."""
    graph = json.loads(json.dumps(graph))
    for node in graph.values():
        for key in ("seed", "noise_seed"):
            if key in node["inputs"] and not isinstance(node["inputs"][key], list):
                node["inputs"][key] = seed
    return graph


def without_nodes(graph: dict, class_type: str) -> dict:
    """Copy of ``graph`` with every ``class_type`` node removed and its consumers rewired to the
    node's first linked input (e.g. drop NexfortCompileModel to get the eager twin)."""
    graph = json.loads(json.dumps(graph))
    drop = {nid: node for nid, node in graph.items() if node["class_type"] == class_type}
    for nid, node in drop.items():
        upstream = next(v for v in node["inputs"].values() if isinstance(v, list))
        del graph[nid]
        for other in graph.values():
            for k, v in other["inputs"].items():
                if isinstance(v, list) and str(v[0]) == nid:
                    other["inputs"][k] = list(upstream)
    return graph


def find_node(graph: dict, class_type: str) -> str | None:
    return next((nid for nid, n in graph.items() if n["class_type"] == class_type), None)


def main(argv: list[str] | None = None) -> int:
    """CLI: run API-format workflows on a fresh server and print their images."""
    import argparse

    ap = argparse.ArgumentParser(description="Run API-format workflows on a headless ComfyUI")
    ap.add_argument("workflows", nargs="+")
    ap.add_argument("--host", default=os.environ.get("NEXFORT_HOST", str(REPO_ROOT / ".host" / "ComfyUI")))
    ap.add_argument("--base-directory", default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    with ComfyServer(args.host, base_dir=args.base_directory) as srv:
        for wf in args.workflows:
            graph = load_workflow(wf)
            if args.seed is not None:
                graph = set_seed(graph, args.seed)
            res = srv.run(graph)
            print(f"{wf}: {res.execution_seconds:.2f} s -> {[str(p) for p in res.images]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
