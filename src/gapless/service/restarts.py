"""What survives a restart of the service, and what a client is told about what did not.

On disk, under `service.checkpoint_dir` (nothing else outlives the process):

    MODEL_ID/NAME.pt                   save_state: tinker://MODEL_ID/weights/NAME
    MODEL_ID/sampler_weights/NAME.pt   save_weights_for_sampler(NAME): tinker://MODEL_ID/sampler_weights/NAME

(MODEL_ID and NAME with characters other than letters, digits, `.`, `_`, `-` written as `_`.)
A sampler save given a name is written like a checkpoint without its optimizer state (the
adapter of a LoRA run, every weight of a full one), and a process that does not hold it in memory
reloads it from there on first use; the unnamed snapshots of `save_weights_and_get_sampling_client`
live in memory only. Training runs, sampling sessions and unfinished calls are lost: a call made to
an earlier process answers with `restarted_message`, which names the run's last saved state.
Guaranteed: a file is complete or absent (written to a temporary name, then renamed).
Not guaranteed: that "last" is right when two processes share one checkpoint_dir (mtime decides).
"""

from __future__ import annotations

from pathlib import Path

from gapless.service.models import safe_name as safe


def sampler_file(root: Path, model_id: str, name: str) -> Path:
    """Where a named `tinker://MODEL_ID/sampler_weights/NAME` is stored under `root`."""
    return root / safe(model_id) / "sampler_weights" / f"{safe(name)}.pt"


def parse_sampler_path(path: str) -> tuple[str, str] | None:
    """(model id, name) of `tinker://MODEL_ID/sampler_weights/NAME`, else None."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    return (parts[0], parts[2]) if len(parts) == 3 and parts[1] == "sampler_weights" else None


def last_saved_state(root: Path, model_id: str) -> str | None:
    """The tinker path of the newest `save_state` checkpoint of `model_id`, if any."""
    files = sorted((root / safe(model_id)).glob("*.pt"), key=lambda p: p.stat().st_mtime)
    return f"tinker://{model_id}/weights/{files[-1].stem}" if files else None


def restarted_message(root: Path, tag: str | None) -> str:
    """What a call lost to a restart answers; `tag` is the model id of a training call or the
    weights key of a sample."""
    head = "the service restarted since this call was made, and its result was lost"
    if tag is None:
        return f"{head}; make the call again"
    if ":train:" not in tag:  # a sample: on a base model, or on sampler weights
        if parse_sampler_path(tag) is None:
            return f"{head}; sample again"
        return f"{head}; sample again (sampler weights saved with a name, as {tag!r} was if it has one, survive)"
    return f"{head} with the training run {tag!r}; " + resume_hint(root, tag)


def resume_hint(root: Path, model_id: str) -> str:
    last = last_saved_state(root, model_id)
    if last is None:
        return "it saved no state before the restart: start the run again"
    return (
        f"its last saved state is {last}: resume from it with "
        f"ServiceClient.create_training_client_from_state_with_optimizer({last!r})"
    )
