"""`gapless serve-training` killed (SIGKILL) and started again on the same port and checkpoint
directory, driven by the real `tinker` SDK throughout: checkpoints and named sampler weights saved
before the kill load and sample identically after it, and a call the dead process had accepted
answers, through the SDK, with an error that says the service restarted and names the last saved
state."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from serve_model import tiny_policy
from tinker import types

KEY = "tml-gapless-test"
SRC = Path(__file__).parents[2] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(root: Path, port: int) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "gapless.cli", "serve-training", "--port", str(port), "--threads", "1",
        "--service.base_models", f'{{tiny = "{root / "base"}"}}',
        "--service.checkpoint_dir", f'"{root / "ckpt"}"',
        "--service.export_tokenizers", "false",
        "--service.poll_hold_s", "2",
    ]  # fmt: skip
    env = {**os.environ, "TINKER_API_KEY": KEY, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(root / f"server-{time.monotonic_ns()}.log", "w")  # noqa: SIM115 -- the process's, closed with it
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail("the service did not start within 120 s")


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)},
    )


def test_saved_state_survives_a_restart_and_lost_calls_say_so(tmp_path):
    policy = tiny_policy()
    policy.save(tmp_path / "base")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    data = [_datum(policy.encode(f"Question {i}: name {i % 7} fruits. Answer: apple, red, cat.")) for i in range(4)]
    prompt = types.ModelInput.from_ints(policy.encode("Question 3: name"))
    params = types.SamplingParams(max_tokens=12, seed=7)
    server = _start(tmp_path, port)
    try:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        trainer = client.create_lora_training_client(base_model="tiny", rank=4).result()
        for _ in range(2):
            trainer.forward_backward(data, "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = trainer.save_state("two-steps").result().path
        sampler_path = trainer.save_weights_for_sampler("two-steps").result().path
        before = client.create_sampling_client(model_path=sampler_path).result().sample(prompt, 2, params).result()
        loss_before = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
        # calls the dead process accepts and never answers: heavy forward passes queued on its one training thread
        long = [5 + (i * 7 + j) % 250 for i in range(1) for j in range(200)]
        heavy = [_datum(long)] * 512
        pending = [trainer.forward(heavy, "cross_entropy") for _ in range(12)]
        time.sleep(1.0)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        server = _start(tmp_path, port)
        errors = []
        for future in pending:  # on a quiet machine the first ones may finish before the kill
            try:
                future.result(timeout=120)
            except tinker.RequestFailedError as exc:
                errors.append(str(exc))
        assert errors, "every queued call finished before the kill: queue heavier work"
        # the first lost was accepted by the old process; later ones may have reached only the new one:
        # both name the state
        assert "the service restarted since this call was made, and its result was lost" in errors[0], errors[0]
        assert all("the service restarted" in e and state in e for e in errors), errors
        # what was saved is all there: the same samples from the sampler weights, the same loss from the state
        after = client.create_sampling_client(model_path=sampler_path).result().sample(prompt, 2, params).result()
        assert [list(s.tokens) for s in after.sequences] == [list(s.tokens) for s in before.sequences]
        resumed = client.create_training_client_from_state_with_optimizer(state)
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            loss_before, rel=1e-5
        )
        client.close("success")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
