"""Checkpoint management through the real `tinker` SDK (RestClient), its `tinker` CLI as a
subprocess and the cookbook's `weights.download`, against a live service: listings, weights info,
run by path, delete, TTL (expired checkpoints gone), copy_weights, downloads that load with peft
(LoRA) and transformers (full), and the OpenAI routes sampling a `tinker://` sampler path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tinker
import torch
from tinker import types
from tinker_service import KEY, served

ADAM = types.AdamParams(learning_rate=5e-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-ckpt")
    with served(root) as (server, policy):
        with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
            yield server, client, tinker.RestClient(base_url=server.base_url, api_key=KEY), policy, root


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
    )


def _trained(client, policy, seed: int = 0):
    trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    datum = _datum(policy.encode("Question 2: name 2 fruits. Answer: apple, red."))
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    return trainer


def _cli(server, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TINKER_BASE_URL=server.base_url, TINKER_API_KEY=KEY, HF_HUB_OFFLINE="1")
    tinker_cli = shutil.which("tinker", path=str(Path(sys.executable).parent))
    out = subprocess.run([tinker_cli, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    return out


def test_listings_weights_info_and_run_by_path(setup):
    server, client, rest, policy, _ = setup
    client.create_lora_training_client(base_model="tiny", rank=2).result()  # another run, used earlier
    trainer = _trained(client, policy)
    run_id = trainer.model_id
    first = trainer.save_state("first").result().path
    time.sleep(0.01)
    second = trainer.save_state("second").result().path
    sampler_path = trainer.save_weights_for_sampler("s1").result().path
    trainer.save_weights_and_get_sampling_client().result()  # ephemeral: not a listed checkpoint

    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [sampler_path, second, first]  # newest first
    assert [c.checkpoint_type for c in listed] == ["sampler", "training", "training"]
    assert all(c.expires_at is None for c in listed) and listed[1].size_bytes > 0
    everyone = rest.list_user_checkpoints(limit=100).result()
    assert {first, second, sampler_path} <= {c.tinker_path for c in everyone.checkpoints}
    assert everyone.cursor.total_count == len(everyone.checkpoints)

    info = rest.get_weights_info_by_tinker_path(second).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp) == ("tiny", True, 4, True)
    run = rest.get_training_run_by_tinker_path(second).result()
    assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (run_id, "tiny", True, 4)
    assert run.last_checkpoint.tinker_path == second and run.last_sampler_checkpoint.tinker_path == sampler_path
    runs = rest.list_training_runs(limit=100).result()
    assert run_id in [r.training_run_id for r in runs.training_runs]
    assert runs.training_runs[0].training_run_id == run_id  # the most recently used first
    page = rest.list_training_runs(limit=1, offset=1).result()
    assert len(page.training_runs) == 1 and page.cursor.total_count == runs.cursor.total_count
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("no-such-run").result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(f"tinker://{run_id}/weights/never").result()


def test_delete_and_ttl(setup):
    server, client, rest, policy, root = setup
    trainer = _trained(client, policy, seed=1)
    keep = trainer.save_state("keep").result().path
    doomed = trainer.save_state("doomed").result().path
    brief = trainer.save_state("brief", ttl_seconds=1).result().path
    sampled = trainer.save_weights_for_sampler("brief-sampler", ttl_seconds=1).result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed[brief].expires_at is not None and listed[keep].expires_at is None
    assert sampled in listed

    rest.delete_checkpoint_from_tinker_path(doomed).result()
    assert doomed not in [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint at"):
        trainer.load_state(doomed).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(doomed).result()

    time.sleep(1.5)  # both TTLs pass: the checkpoints are gone, files included
    left = [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    assert left == [keep]
    assert not list(root.glob("ckpt/*/brief.pt")) and list(root.glob("ckpt/*/keep.pt"))
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint at"):
        trainer.load_state(brief).result()
    with pytest.raises(tinker.NotFoundError, match="no sampler weights"):
        client.create_sampling_client(model_path=sampled).result()

    rest.set_checkpoint_ttl_from_tinker_path(keep, 1).result()  # a TTL set later is honoured too
    time.sleep(1.5)
    assert rest.list_checkpoints(trainer.model_id).result().checkpoints == []


def test_copy_weights_survives_the_source(setup):
    server, client, rest, policy, _ = setup
    trainer = _trained(client, policy, seed=2)
    source = trainer.save_state("orig").result().path
    copied = rest.copy_weights(source, "any-project").result()
    assert copied != source and copied.endswith("/weights/orig")
    data = [_datum(policy.encode("Question 7: name 1 fruits."))]
    before = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    rest.delete_checkpoint_from_tinker_path(source).result()
    resumed = client.create_training_client_from_state(copied).result()
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, abs=1e-6)
    info = rest.get_weights_info_by_tinker_path(copied).result()
    assert info.is_lora and info.lora_rank == 4


def _peft_logprobs(adapter_dir: Path, base_dir: Path, tokens: list[int]) -> np.ndarray:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float(), -1)
    return logp.gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1).numpy()


def test_cli_lists_and_downloads_a_lora_checkpoint_peft_loads(setup, tmp_path):
    server, client, rest, policy, root = setup
    trainer = _trained(client, policy, seed=3)
    path = trainer.save_state("for-download").result().path
    runs = json.loads(_cli(server, "--format", "json", "run", "list").stdout)
    assert trainer.model_id in json.dumps(runs)
    listed = json.loads(_cli(server, "--format", "json", "checkpoint", "list").stdout)
    assert path in json.dumps(listed)
    per_run = _cli(server, "checkpoint", "list", "--run-id", trainer.model_id).stdout
    assert "for-download" in per_run
    _cli(server, "checkpoint", "download", path, "--output", str(tmp_path))
    (adapter,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.name for f in adapter.iterdir()}
    tokens = policy.encode("Question 4: name 3 fruits. Answer: apple.")
    served = trainer.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(_peft_logprobs(adapter, root / "base", tokens) - served).max() < 1e-4
    with torch.no_grad():  # and the adapter matters: the base alone is far from it
        base = torch.log_softmax(policy.model(input_ids=torch.tensor([tokens[:-1]])).logits[0], -1)
    assert np.abs(base.gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1).numpy() - served).max() > 1e-3
    # the temporary export is deleted once downloaded; the checkpoint itself stays
    kinds = [c.checkpoint_type for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert "external" not in kinds
    _cli(server, "checkpoint", "set-ttl", path, "--ttl", "3600")
    (listed,) = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert listed.tinker_path == path and listed.expires_at is not None
    _cli(server, "checkpoint", "delete", "-y", path)
    assert rest.list_checkpoints(trainer.model_id).result().checkpoints == []


def test_cookbook_download_decrypts_an_age_encrypted_export(setup, tmp_path, monkeypatch):
    from tinker_cookbook import weights

    server, client, rest, policy, root = setup
    trainer = _trained(client, policy, seed=4)
    path = trainer.save_state("cookbook").result().path
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    out = weights.download(tinker_path=path, output_dir=str(tmp_path / "adapter"), base_url=server.base_url)
    tokens = policy.encode("Question 9: name 2 animals.")
    served = trainer.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(_peft_logprobs(Path(out), root / "base", tokens) - served).max() < 1e-4


def _call(http: httpx.Client, route: str, body: dict) -> dict:
    """A raw training call and its future's result."""
    request_id = http.post(f"/api/v1/{route}", json=body).json()["request_id"]
    while (out := http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()).get(
        "type"
    ) == "try_again":
        pass
    assert "error" not in out, out
    return out


def test_full_fine_tuning_download_loads_with_automodel(setup, tmp_path):
    """lora_config absent (a raw create_model; the SDK 0.38 creates LoRA clients only)."""
    from transformers import AutoModelForCausalLM

    server, _, _, policy, _ = setup
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY}, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        model_id = _call(http, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny"})[
            "model_id"
        ]
        run = server.app.runs[model_id]

        @torch.no_grad()
        def perturb() -> None:  # weights that differ from the base's, changed on the training thread
            for p in run.params:
                p.add_(0.01 * torch.randn_like(p))

        server.app._trainer.submit(perturb).result()
        path = _call(http, "save_weights", {"model_id": model_id, "path": "full"})["path"]
    _cli(server, "checkpoint", "download", path, "--output", str(tmp_path))
    (directory,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = torch.tensor([policy.encode("Question 1: name 5 colours.")])
    with torch.no_grad():
        want = server.app._trainer.submit(torch.no_grad()(lambda: run.model(input_ids=tokens).logits)).result()
        assert torch.allclose(loaded(input_ids=tokens).logits, want, atol=1e-4)
        assert not torch.allclose(policy.model(input_ids=tokens).logits, want, atol=1e-3)


def test_openai_routes_sample_a_tinker_sampler_path(setup):
    server, client, _, policy, _ = setup
    trainer = _trained(client, policy, seed=5)
    path = trainer.save_weights_for_sampler("oa").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    prompt = policy.encode("Question 3: name")
    oa = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    out = oa.completions.create(model=path, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    greedy = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, temperature=0))
    seq = greedy.result().sequences[0]
    assert out.model == path
    assert policy.tokenizer.decode(seq.tokens, skip_special_tokens=True).startswith(out.choices[0].text)
    assert np.allclose(out.choices[0].logprobs.token_logprobs[: len(seq.logprobs)], seq.logprobs, atol=1e-4)
    base = oa.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert base.model == "tiny"
    with pytest.raises(openai.NotFoundError, match="no sampler weights"):
        oa.completions.create(model=path.replace("/oa", "/never"), prompt=prompt, max_tokens=2)


def test_the_sweeper_deletes_expired_files_when_nobody_calls(tmp_path):
    from gapless.service.checkpoints import CheckpointPath, CheckpointStore

    now = [1000.0]
    store = CheckpointStore(tmp_path, clock=lambda: now[0])
    path = CheckpointPath("run-1", "weights", "w")
    store.record_run("run-1", "tiny", None)
    store.training_file(path).write_bytes(b"weights")
    store.add(path, ttl_s=10)
    store.start_sweeping(every_s=0.05)
    try:
        time.sleep(0.2)
        assert store.training_file(path).is_file()  # not expired yet
        now[0] += 11
        deadline = time.monotonic() + 10
        while store.training_file(path).is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not store.training_file(path).exists() and not list(tmp_path.glob("*/meta/*/*.json"))
    finally:
        store.close()
