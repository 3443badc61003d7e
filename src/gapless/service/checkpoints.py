"""What the service knows about training runs and their checkpoints: the REST listings' source.

    CheckpointPath.parse("tinker://RUN/KIND/NAME")   KIND: weights | sampler_weights | external_weights
    CheckpointStore(root)
      record_run / touch / runs / run              one `run.json` per training run, last-request times
      add / checkpoints / find / delete / set_ttl  one JSON record per checkpoint, beside its files
      sweep                                        every expired checkpoint deleted, files and record

Layout under `root` (service.checkpoint_dir), one directory per run (names made filesystem-safe):

    RUN/run.json                          base model, LoRA shape, user metadata, creation time
    RUN/NAME.pt                           a training checkpoint (save_state; models.checkpoint_file)
    RUN/sampler_weights/NAME.pt           named sampler weights (restarts.sampler_file)
    RUN/external_weights/NAME/...         an export (save_weights_external): a peft adapter or HF model
    RUN/meta/KIND/NAME.json               the checkpoint's record: time, size, expiry, metadata

Unnamed sampler weights (`save_weights_and_get_sampling_client`) live in the sampler pool's memory
only and are not listed; named ones are files, listed like the rest, and deleting one also drops
it from the pool.
Guaranteed: a checkpoint past its `expires_at` is deleted (files and record) by the next sweep
(`start_sweeping`: once a minute), and every listing, lookup and load sweeps first (every sample
call sweeps the sampler records), so an expired checkpoint is never listed, loaded or sampled;
records and runs survive a restart (they are files). Not guaranteed: the files gone at the very
second of expiry, or records for checkpoints saved before records existed.
All methods take one lock: REST routes (event loop) and the training thread both call them.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from tinker import types as tt

from gapless.lora import LoraSpec
from gapless.service.models import UserError, checkpoint_file, safe_name
from gapless.service.restarts import sampler_file

log = logging.getLogger("gapless.serve.tinker")
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    segment: str  # weights | sampler_weights | external_weights
    name: str

    @classmethod
    def parse(cls, tinker_path: str) -> CheckpointPath:
        parts = tinker_path.removeprefix("tinker://").split("/") if tinker_path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
            raise UserError(f"{tinker_path!r} is not a checkpoint path: tinker://RUN_ID/{{{'|'.join(KINDS)}}}/NAME")
        return cls(*parts)

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.segment}/{self.name}"

    @property
    def kind(self) -> str:
        return KINDS[self.segment]


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


class CheckpointStore:
    def __init__(
        self,
        root: str | Path,
        *,
        sampler_drop: Callable[[str], None] = lambda path: None,
        clock: Callable[[], float] = time.time,
    ):
        self.root, self.clock = Path(root), clock
        self._sampler_drop = sampler_drop  # forget deleted sampler weights held in memory
        # expiry times of sampler weights, so that every sample call can sweep them without reading files
        self._sampler_expiry: dict[str, float] = {}
        for meta in self.root.glob("*/meta/sampler_weights/*.json"):
            self._index(json.loads(meta.read_text()))
        self._last_request: dict[str, float] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()

    def start_sweeping(self, every_s: float = 60.0) -> None:
        """Sweep from a daemon thread every `every_s`, so expired files go even when nobody calls."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.sweep()
                except OSError:  # a file removed under us (a delete at the same time): the next sweep
                    log.exception("checkpoint sweep failed")

        threading.Thread(target=loop, name="tinker-checkpoint-sweeper", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    # ---- runs ------------------------------------------------------------------------------
    def run_dir(self, run_id: str) -> Path:
        return self.root / safe_name(run_id)

    def record_run(
        self, run_id: str, base: str, spec: LoraSpec | None, user_metadata: dict | None = None, trainable: bool = True
    ) -> None:
        record = {
            "training_run_id": run_id,
            "base_model": base,
            "is_lora": spec is not None,
            "lora_rank": spec.rank if spec else None,
            "train_attn": spec.train_attn if spec else None,
            "train_mlp": spec.train_mlp if spec else None,
            "train_unembed": spec.train_unembed if spec else None,
            "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
            "trainable": trainable,
            "created": self.clock(),
        }
        with self._lock:
            _write_json(self.run_dir(run_id) / "run.json", record)
            self._last_request[run_id] = record["created"]

    def touch(self, run_id: str) -> None:
        self._last_request[run_id] = self.clock()

    def run(self, run_id: str) -> dict | None:
        file = self.run_dir(run_id) / "run.json"
        return json.loads(file.read_text()) if file.is_file() else None

    def training_run(self, run_id: str) -> tt.TrainingRun | None:
        with self._lock:
            self.sweep()
            record = self.run(run_id)
            return self._training_run(record) if record else None

    def training_runs(self) -> list[tt.TrainingRun]:
        """Every run, the most recently used first."""
        with self._lock:
            self.sweep()
            records = [json.loads(f.read_text()) for f in self.root.glob("*/run.json")]
            runs = [self._training_run(r) for r in records]
            return sorted(runs, key=lambda r: r.last_request_time, reverse=True)

    def _training_run(self, record: dict) -> tt.TrainingRun:
        run_id = record["training_run_id"]
        own = self._checkpoints(run_id)
        latest = lambda kind: max((c for c in own if c.checkpoint_type == kind), key=lambda c: c.time, default=None)  # noqa: E731
        return tt.TrainingRun(
            training_run_id=run_id,
            base_model=record["base_model"],
            model_owner="local",
            is_lora=record["is_lora"],
            lora_rank=record["lora_rank"],
            last_request_time=_iso(self._last_request.get(run_id, record["created"])),
            last_checkpoint=latest("training"),
            last_sampler_checkpoint=latest("sampler"),
            user_metadata=record["user_metadata"],
        )

    def weights_info(self, path: CheckpointPath) -> tt.WeightsInfoResponse:
        record = self.run(path.run_id)
        if record is None or self.find(path) is None:
            raise UserError(f"no checkpoint at {path.tinker_path!r}")
        return tt.WeightsInfoResponse(
            base_model=record["base_model"],
            is_lora=record["is_lora"],
            lora_rank=record["lora_rank"],
            train_attn=record["train_attn"],
            train_mlp=record["train_mlp"],
            train_unembed=record["train_unembed"],
        )

    # ---- checkpoints ---------------------------------------------------------------------------
    def training_file(self, path: CheckpointPath) -> Path:
        return checkpoint_file(self.root, path.run_id, path.name)

    def external_dir(self, path: CheckpointPath) -> Path:
        return self.run_dir(path.run_id) / "external_weights" / safe_name(path.name)

    def _index(self, record: dict) -> None:
        if CheckpointPath.parse(record["tinker_path"]).kind != "sampler":
            return
        if record["expires"] is None:
            self._sampler_expiry.pop(record["tinker_path"], None)
        else:
            self._sampler_expiry[record["tinker_path"]] = record["expires"]

    def sampler_file(self, path: CheckpointPath) -> Path:
        return sampler_file(self.root, path.run_id, path.name)

    def _meta(self, path: CheckpointPath) -> Path:
        return self.run_dir(path.run_id) / "meta" / path.segment / f"{safe_name(path.name)}.json"

    def add(
        self, path: CheckpointPath, ttl_s: int | None = None, user_metadata: dict | None = None, size_bytes=None
    ) -> None:
        """Record a checkpoint whose files exist now."""
        check_ttl(ttl_s)
        now = self.clock()
        record = {
            "tinker_path": path.tinker_path,
            "time": now,
            "expires": now + ttl_s if ttl_s is not None else None,
            "size_bytes": size_bytes if size_bytes is not None else self._size(path),
            "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
            "public": False,
        }
        with self._lock:
            _write_json(self._meta(path), record)
            self._index(record)

    def _size(self, path: CheckpointPath) -> int | None:
        if path.kind == "external":
            return sum(f.stat().st_size for f in self.external_dir(path).rglob("*") if f.is_file())
        file = self.training_file(path) if path.kind == "training" else self.sampler_file(path)
        return file.stat().st_size if file.is_file() else None

    def _record(self, path: CheckpointPath) -> dict | None:
        meta = self._meta(path)
        return json.loads(meta.read_text()) if meta.is_file() else None

    def find(self, path: CheckpointPath) -> tt.Checkpoint | None:
        with self._lock:
            self.sweep()
            record = self._record(path)
            return _checkpoint(record) if record else None

    def checkpoints(self, run_id: str | None = None) -> list[tt.Checkpoint]:
        """One run's checkpoints (all runs' when None), the newest first."""
        with self._lock:
            self.sweep()
            return self._checkpoints(run_id)

    def _checkpoints(self, run_id: str | None) -> list[tt.Checkpoint]:
        pattern = f"{safe_name(run_id)}/meta/*/*.json" if run_id is not None else "*/meta/*/*.json"
        records = [json.loads(f.read_text()) for f in self.root.glob(pattern)]
        return sorted((_checkpoint(r) for r in records), key=lambda c: c.time, reverse=True)

    def delete(self, path: CheckpointPath) -> bool:
        """Remove the checkpoint's files and record; False if there was none."""
        with self._lock:
            found = self._meta(path).is_file()
            self._meta(path).unlink(missing_ok=True)
            if path.kind in ("training", "sampler"):
                file = self.training_file(path) if path.kind == "training" else self.sampler_file(path)
                found |= file.is_file()
                file.unlink(missing_ok=True)
                if path.kind == "sampler":
                    self._sampler_expiry.pop(path.tinker_path, None)
                    self._sampler_drop(path.tinker_path)
            else:
                found |= self.external_dir(path).is_dir()
                shutil.rmtree(self.external_dir(path), ignore_errors=True)
            return found

    def set_ttl(self, path: CheckpointPath, ttl_s: int | None) -> None:
        with self._lock:
            self.sweep()
            record = self._record(path)
            if record is None:
                raise UserError(f"no checkpoint at {path.tinker_path!r}")
            check_ttl(ttl_s)
            record["expires"] = self.clock() + ttl_s if ttl_s is not None else None
            _write_json(self._meta(path), record)
            self._index(record)

    def set_public(self, path: CheckpointPath, public: bool) -> bool:
        """Mark the checkpoint public or private; False if it already was."""
        with self._lock:
            record = self._record(path)
            if record is None:
                raise UserError(f"no checkpoint at {path.tinker_path!r}")
            if record.get("public", False) == public:
                return False
            record["public"] = public
            _write_json(self._meta(path), record)
            return True

    def sweep_samplers(self) -> None:
        """Delete expired sampler weights only: from an index in memory, cheap enough for every sample call."""
        now = self.clock()
        with self._lock:
            for tinker_path in [p for p, expires in self._sampler_expiry.items() if expires <= now]:
                self.delete(CheckpointPath.parse(tinker_path))

    def sweep(self) -> list[str]:
        """Delete every expired checkpoint; the tinker paths deleted."""
        now = self.clock()
        with self._lock:
            records = [json.loads(f.read_text()) for f in self.root.glob("*/meta/*/*.json")]
            expired = [r["tinker_path"] for r in records if r["expires"] is not None and r["expires"] <= now]
            for tinker_path in expired:
                self.delete(CheckpointPath.parse(tinker_path))
            return expired


def check_ttl(ttl_s: int | None) -> None:
    """Any positive TTL is served (Tinker's own floor is an hour; a shorter one harms nobody here)."""
    if ttl_s is not None and ttl_s < 1:
        raise UserError(f"ttl_seconds must be at least 1 (got {ttl_s}), or None for no expiry")


def _checkpoint(record: dict) -> tt.Checkpoint:
    path = CheckpointPath.parse(record["tinker_path"])
    return tt.Checkpoint(
        checkpoint_id=f"{path.segment}/{path.name}",
        checkpoint_type=path.kind,
        time=_iso(record["time"]),
        tinker_path=path.tinker_path,
        size_bytes=record["size_bytes"],
        public=record.get("public", False),
        user_metadata=record["user_metadata"],
        expires_at=_iso(record["expires"]) if record["expires"] is not None else None,
    )


def _write_json(file: Path, record: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(file)
