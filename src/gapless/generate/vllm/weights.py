"""How a weight push reaches vLLM: one seam, each transport through a vLLM API made for it.

`VLLMEngine.update_weights` calls `push(state, version)` between two steps (under its lock); the
transport is picked by name (`make_push`):

- `reload` (the default, CPU and GPU): `collective_rpc("reload_weights", weights_iterator=...)`,
  vLLM's in-place reload, which runs its checkpoint-format loader (HF names onto fused q/k/v and
  gate/up) and then its post-load processing again. Calling the model's `load_weights` directly
  is not supported: after post-load processing vLLM's parameters are no longer the loader's.
- `ipc` (GPU only): vLLM's weight-transfer engine (`weight_transfer_config`, the
  init / start / update / finish protocol) with its CUDA-IPC backend, driven from this process
  through vLLM's trainer-side engine; the worker side is vLLM's own.
- LoRA (`lora_dir` set): only the adapter goes to vLLM. Each version is written as a peft adapter
  directory and later requests carry it as a `LoRARequest` (one id per version); the base weights
  are never touched. In-flight samples are resubmitted with the new adapter (a request's
  adapter is fixed when it is added).

Guaranteed: `push` returns after the weights are loaded (the reload and the IPC engine
synchronise); a failed push raises and leaves the engine's version unchanged. Not guaranteed: a
failed reload leaves vLLM's weights as they were (a push that fails half way may have loaded some
layers: restart the generator). For vLLM started as its own server (`vllm serve`), the transport
is `HTTPReload` (vllm/http_push.py: the same in-place reload, reached over the server's routes),
which the server engine (vllm/remote.py) holds; `tests/unit/test_vllm_transports.py` runs one
contract over every transport.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

TRANSPORTS = ("reload", "ipc")


class WeightPush(Protocol):
    name: str

    def push(self, state: dict[str, torch.Tensor], version: int) -> None: ...


def is_adapter_push(state: dict[str, torch.Tensor]) -> bool:
    from gapless.generate.adapters import PREFIX, A

    return (
        bool(state) and all(k.startswith(PREFIX) and ".lora_" in k for k in state) and any(k.endswith(A) for k in state)
    )


class VLLMWeights:
    """The engine's seam: full state dicts through `transport`, adapter pushes as LoRA requests."""

    def __init__(self, llm, transport: str = "reload", lora_dir: str | None = None, lora_alpha: float = 32.0):
        if transport == "reload":
            self.full: WeightPush = ReloadInPlace(llm)
        elif transport == "ipc":
            self.full = TransferEngineIPC(llm)
        else:
            raise ValueError(f"unknown vLLM weight transport {transport!r}: use one of {list(TRANSPORTS)}")
        self.lora = LoraAdapters(lora_dir, lora_alpha) if lora_dir is not None else None

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        if is_adapter_push(state):
            if self.lora is None:
                raise ValueError("an adapter push to a vLLM engine built without LoRA (VLLMEngine(lora_rank=R))")
            self.lora.push(state, version)
        else:
            self.full.push(state, version)
            if self.lora is not None:
                self.lora.current = None  # the full weights are the policy now

    def lora_request(self):
        return self.lora.current if self.lora is not None else None


class ReloadInPlace:
    name = "reload"

    def __init__(self, llm):
        self.llm = llm

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        # a list, not a generator: with the engine core in another process it is pickled
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})


class _StateSource:
    """A vLLM `WeightSource` over the state dict of the push in progress."""

    def __init__(self):
        self.state: dict[str, torch.Tensor] = {}

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in self.state.items()]

    def __iter__(self):
        return iter(list(self.state.items()))


class _InProcessClient:
    """vLLM's `VLLMWeightSyncClient` for an engine in this process: the four phases as worker RPCs."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")


class TransferEngineIPC:
    name = "ipc"

    def __init__(self, llm):
        if not torch.cuda.is_available():
            raise RuntimeError("vLLM's IPC weight transfer needs CUDA; use transport 'reload' on CPU")
        from vllm.distributed.weight_transfer import base
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferTrainerFactory,
        )
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        source = _StateSource()
        # registered as a WeightSource without inheriting: its re-iterable pass is the push in progress
        base.WeightSource.register(_StateSource)
        self.source = source
        self.engine = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0), client=_InProcessClient(llm), source=source
        )

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.source.state = {k: v.cuda() for k, v in state.items()}
        try:
            self.engine.send_weights()
        finally:
            self.source.state = {}


class LoraAdapters:
    name = "lora"
    KEEP = 2  # adapter directories kept: the live one and the one before it (a resubmit may still name it)

    def __init__(self, root: str, alpha: float):
        self.alpha = alpha  # peft's lora_alpha: the adapter's scale is alpha / rank
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.current = None
        self.versions: list[int] = []

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from gapless.generate.adapters import PREFIX, A

        names = sorted(k[len(PREFIX) : -len(A)] for k in state if k.endswith(A))
        if not names or len(state) != 2 * len(names):
            raise KeyError(f"not a LoRA push (adapter tensors lora_A/lora_B under {PREFIX!r}): {sorted(state)[:3]}")
        rank = int(state[PREFIX + names[0] + A].shape[0])
        path = self.root / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors")
        )
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": self.alpha,
            "target_modules": sorted({n.rsplit(".", 1)[-1] for n in names}),
            "bias": "none",
            "lora_dropout": 0.0,
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": None,
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        # one id per version: vLLM caches adapters by id, so a new version never reuses an old one's slot
        self.current = LoRARequest(f"gapless-v{version}", version + 1, str(path))
        self.versions.append(version)
        for old in self.versions[: -self.KEEP]:
            for f in (self.root / f"v{old}").glob("*"):
                f.unlink()
            (self.root / f"v{old}").rmdir()
        self.versions = self.versions[-self.KEEP :]
