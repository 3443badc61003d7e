"""The weight push into a `vllm serve` process over its HTTP routes: a `WeightPush` (vllm/weights.py).

A push writes the state dict as one safetensors file into a directory of its own (`v<version>`,
which the server must be able to read: the same machine or a shared filesystem), then, over the
server's routes (mounted by `VLLM_SERVER_DEV_MODE=1`):

    POST /pause?mode=abort            the server aborts what it holds and waits until no step runs
    POST /collective_rpc              method reload_weights, kwargs {"weights_path": <directory>}
    POST /update_weight_version       {"new_version": "<version>"} (GET /weight_info reports it)
    POST /resume                      (also after a failed reload: the server is never left paused)

`reload_weights(weights_path=...)` is vLLM's in-place reload, the same loader as the in-process
`reload` transport (checkpoint names onto its fused q/k/v and gate/up, then its post-load
processing again); `/collective_rpc` passes string arguments only, so the tensors go by path. The
pause makes the reload land between two steps with no request of any client in flight, and its
cache clearing drops every prefix block the old weights computed.

Why not vLLM's weight-transfer routes (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`): they move tensors through a backend, and every backend
vLLM 0.32 registers (`WeightTransferEngineFactory`) needs an accelerator: `nccl`, `sparse_nccl` and
`nccl_m2n` open a NCCL group (`nccl_common.worker_init_process_group` calls
`torch.accelerator.current_device_index()`, which raises "Cannot access accelerator device when
none is available" on CPU), `ipc` passes CUDA IPC handles (`ipc_engine`, `rebuild_cuda_tensor`),
`sharded_rdt` pulls over Ray with CUDA streams and events, `modelexpress` is a separate package. On
a GPU those routes are the faster path; this one runs wherever the server does.

Guaranteed: `push` returns after the server has loaded the weights, and raises (after resuming the
server) when a route fails; the two newest version directories are kept, older ones deleted. Not
guaranteed: a reload that fails half way may leave some layers loaded (restart the server).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import torch


class HTTPReload:
    name = "http"
    KEEP = 2  # version directories kept: the one loaded and the one before it

    def __init__(self, url: str, weights_dir: str | Path, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.root = Path(weights_dir).resolve()  # the server resolves it, from its own working directory
        self.root.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.versions: list[int] = []

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        path = self.root / f"v{version}"
        write_checkpoint(state, path)
        self._post("/pause", params={"mode": "abort"})
        try:
            self._post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            self._post("/update_weight_version", json={"new_version": str(version)})
        finally:
            self._post("/resume")
        self.versions = [v for v in self.versions if v != version] + [version]  # a version may be pushed again
        for old in self.versions[: -self.KEEP]:
            for f in (self.root / f"v{old}").glob("*"):
                f.unlink()
            (self.root / f"v{old}").rmdir()
        self.versions = self.versions[-self.KEEP :]

    def _post(self, route: str, **kwargs) -> None:
        response = httpx.post(self.url + route, timeout=self.timeout_s, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server {self.url}{route} answered {response.status_code}: {response.text[:500]}")


def write_checkpoint(state: dict[str, torch.Tensor], path: Path) -> None:
    """`state` as `path/model.safetensors`; tensors that share storage (tied embeddings) are copied
    once each, since safetensors stores no aliases."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.rename(path / "model.safetensors")  # the loader globs *.safetensors: never a half-written one
