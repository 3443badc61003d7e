"""`save_weights_external`: a training run's weights as files any Hugging Face user loads.

    export_run(run, directory, recipients) -> bytes written

A LoRA run becomes a peft adapter (`adapter_config.json`, `adapter_model.safetensors`):
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE_DIR), directory)`. A full
run becomes an HF checkpoint (`config.json`, `model.safetensors`):
`AutoModelForCausalLM.from_pretrained(directory)`. Both carry the base model's tokenizer files.
With age recipients ("age1..." keys or SSH public keys), every file is encrypted to them and
stored with an `.age` suffix, as the SDK's `age_encryption_recipients` asks.
Guaranteed: the files give the run's own function (the adapter, or the full weights, as of the
call; tested by loading them and comparing log-probs with the service's `forward`). Not
guaranteed: the optimizer state (a training checkpoint, `save_state`, keeps it).
"""

from __future__ import annotations

import copy
from pathlib import Path

from gapless.models import save_tokenizer
from gapless.service.models import TrainingRun, UserError


def export_run(run: TrainingRun, directory: Path, recipients: list[str] | None = None) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    if run.spec is None:
        run.model.save_pretrained(directory)
    else:
        _save_adapter(run, directory)
    save_tokenizer(run.base.policy.tokenizer, directory)
    if recipients:
        _encrypt_all(directory, recipients)
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _save_adapter(run: TrainingRun, directory: Path) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = copy.deepcopy(run.model.peft_config[run.adapter])
    config.base_model_name_or_path = run.base.name
    config.save_pretrained(str(directory))
    state = get_peft_model_state_dict(run.model, adapter_name=run.adapter)  # names without the adapter's
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(directory / "adapter_model.safetensors"))


def _encrypt_all(directory: Path, recipients: list[str]) -> None:
    try:
        import pyrage
    except ImportError:
        raise UserError("age_encryption_recipients needs pyrage on the service (pip install pyrage)") from None
    keys = []
    for r in recipients:
        kind = pyrage.ssh if r.startswith("ssh-") else pyrage.x25519
        try:
            keys.append(kind.Recipient.from_str(r))
        except Exception as exc:  # noqa: BLE001 -- pyrage raises its own error types per key kind
            raise UserError(
                f"age_encryption_recipients: {r[:24]!r}... is not an age or SSH public key ({exc})"
            ) from None
    for file in [f for f in directory.rglob("*") if f.is_file()]:
        file.with_name(file.name + ".age").write_bytes(pyrage.encrypt(file.read_bytes(), keys))
        file.unlink()
