"""One contract over every vLLM weight transport, and the server engine over a real `vllm serve`.

After a push, greedy output equals HF `generate` with the pushed weights, on each transport that
runs here: `reload` (vLLM's in-place reload into the session's in-process engine) and `http` (a
`vllm serve` process: pause, `reload_weights` from a file, resume); `ipc` needs CUDA. The server
tests check what generation over the OpenAI API must keep: sampled log-probs equal the trainer's,
and across a push in the middle of generation every token's log-prob is its own version's.
Run from the vLLM venv (`.venv-vllm/bin/python -m pytest -m vllm`); one server for the module.
"""

import dataclasses

import pytest
import torch
from vllm_checks import hf_greedy, perturbed

from gapless.trainer.batch import build_batch, token_logprobs
from gapless.types import SamplingParams

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server_engine(vllm_policy, tmp_path_factory):
    from gapless.generate.vllm.remote import VLLMServerEngine
    from gapless.generate.vllm.server import VLLMServer

    root = tmp_path_factory.mktemp("vllm-server")
    vllm_policy.save(root / "policy")
    server = VLLMServer.start(root / "policy", root / "server.log", dtype="float32", max_batch=4, max_seq_len=256)
    engine = VLLMServerEngine(
        server, vllm_policy.eos_id, vllm_policy.decode, weights_dir=root / "weights", max_batch=4, max_seq_len=256
    )
    yield engine
    engine.close()
    assert server.process.poll() is not None  # stopped with the engine


def _ipc(request):
    from gapless.generate.vllm.weights import TransferEngineIPC

    engine = request.getfixturevalue("vllm_engine")
    full = engine.weights.full
    engine.weights.full = TransferEngineIPC(engine.llm)
    request.addfinalizer(lambda: setattr(engine.weights, "full", full))
    return engine


TRANSPORTS = [
    "reload",
    "http",
    pytest.param(
        "ipc",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="vLLM's IPC weight transfer passes CUDA IPC handles: GPU only"
        ),
    ),
]


@pytest.fixture(params=TRANSPORTS)
def pushed(request, vllm_policy):
    """An engine whose pushes go through the transport named; `vllm_policy`'s weights back after."""
    if request.param == "reload":
        engine = request.getfixturevalue("vllm_engine")
        assert engine.weights.full.name == "reload"
    elif request.param == "http":
        engine = request.getfixturevalue("server_engine")
        assert engine.weights.name == "http"
    else:
        engine = _ipc(request)
    yield engine
    engine.abort({s.request_id for s in engine.running})
    engine.update_weights(vllm_policy.model.state_dict(), version=engine.version + 1)


def _trainer_logprobs(model, policy, completion, temperature=1.0):
    batch = build_batch([completion], [1.0], [True], policy.pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature)[0]
    start = len(completion.prompt_ids) - 1
    return lp[start : start + len(completion.token_ids)]


def test_after_a_push_greedy_output_equals_hf_generate_with_the_new_weights(pushed, vllm_policy, problems):
    prompts = [vllm_policy.encode(p.prompt) for p in problems[:4]]
    for seed in (11, 12):  # two pushes: the second must replace the first, not add to it
        model = perturbed(vllm_policy, seed)
        version = pushed.version + 1
        pushed.update_weights(model.state_dict(), version=version)
        got = pushed.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
        for prompt, c in zip(prompts, got):
            assert c.token_ids == hf_greedy(model, vllm_policy, prompt, 10)
            assert c.versions == [version] * len(c.token_ids) and pushed.version == version


def test_sampled_logprobs_over_the_openai_api_equal_the_trainers(server_engine, vllm_policy, problems):
    prompts = [vllm_policy.encode(p.prompt) for p in problems[:4]]
    completions = server_engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=12, seed=3))
    assert sum(len(c.token_ids) for c in completions) > 12
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) == len(c.versions)
        gap = (_trainer_logprobs(vllm_policy.model, vllm_policy, c, 0.7) - torch.tensor(c.logprobs)).abs().max()
        assert gap < 1e-4
    again = server_engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=12, seed=3))
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]  # seeded per sample


def test_a_push_mid_generation_then_abort_and_resume_keep_every_tokens_version(server_engine, vllm_policy, problems):
    """Tokens received before the push carry the old version, the rest the new; each token's
    log-prob is the one its version's weights give over the whole prefix."""
    engine, new = server_engine, perturbed(vllm_policy, 2)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=1)
    v0 = engine.version
    ids = [engine.add_request(vllm_policy.encode(p.prompt), params, n=2) for p in problems[:2]]
    while sum(len(s.tokens) for s in engine.running) < 8:
        assert not engine.step()
    engine.update_weights(new.state_dict(), version=v0 + 1)
    partials = engine.abort([ids[0]])
    assert [c.finish_reason for c in partials] == ["abort", "abort"]
    engine.resume(partials, params)
    done = []
    while engine.has_work:
        done += engine.step()
    assert len(done) == 4 and any(v0 in c.versions for c in done)
    for c in done:
        assert len(c.token_ids) == 24 and c.versions == sorted(c.versions) and c.versions[-1] == v0 + 1
        cut = c.versions.index(v0 + 1)
        old = dataclasses.replace(c, token_ids=c.token_ids[:cut], logprobs=c.logprobs[:cut], versions=c.versions[:cut])
        if cut:
            assert (
                _trainer_logprobs(vllm_policy.model, vllm_policy, old) - torch.tensor(old.logprobs)
            ).abs().max() < 1e-4
        lp = _trainer_logprobs(new, vllm_policy, c)
        assert (lp[cut:] - torch.tensor(c.logprobs[cut:])).abs().max() < 1e-4
    engine.update_weights(vllm_policy.model.state_dict(), version=v0 + 2)


def test_requests_another_client_pauses_away_are_resubmitted_and_complete(server_engine, vllm_policy, problems):
    """`POST /pause?mode=abort` from elsewhere ends this engine's streams as aborted: the engine
    continues each sample from its tokens, and the log-probs stay the policy's."""
    import httpx

    engine, v = server_engine, server_engine.version
    prompt = vllm_policy.encode(problems[0].prompt)
    n_new = 256 - len(prompt) - 8  # long, so that the pause lands while the server still streams
    params = SamplingParams(temperature=1.0, max_new_tokens=n_new, ignore_eos=True, seed=5)
    for _attempt in range(3):  # a loaded machine may let the server finish before the pause lands
        engine.add_request(prompt, params, n=2)
        samples = list(engine.running)
        while not any(s.tokens for s in samples):
            assert not engine.step()
        httpx.post(engine.server.url + "/pause", params={"mode": "abort"}, timeout=60).raise_for_status()
        httpx.post(engine.server.url + "/resume", timeout=60).raise_for_status()
        done = []
        while engine.has_work:
            done += engine.step()
        for c in done:
            assert len(c.token_ids) == n_new and c.versions == [v] * n_new
            assert (_trainer_logprobs(vllm_policy.model, vllm_policy, c) - torch.tensor(c.logprobs)).abs().max() < 1e-4
        if any(s.submission > 0 for s in samples):  # taken out and sent again
            break
    else:
        pytest.fail("in three tries the pause never cut a request in flight")


def test_a_version_pushed_again_replaces_its_file(server_engine, vllm_policy, problems):
    """The trainer's eval engine and a generator may push one version twice (a restart, a resync)."""
    prompt = [vllm_policy.encode(problems[0].prompt)]
    v = server_engine.version + 1
    for model in (perturbed(vllm_policy, 21), vllm_policy.model):
        server_engine.update_weights(model.state_dict(), version=v)
    assert server_engine.weights.versions[-1] == v and len(set(server_engine.weights.versions)) == len(
        server_engine.weights.versions
    )
    got = server_engine.generate(prompt, SamplingParams(greedy=True, max_new_tokens=8))[0]
    assert got.token_ids == hf_greedy(vllm_policy.model, vllm_policy, prompt[0], 8)


def test_attach_finds_the_served_model_and_the_weight_routes(server_engine):
    from gapless.generate.vllm.server import VLLMServer

    attached = VLLMServer.attach(server_engine.server.url)
    assert attached.model == server_engine.server.model and attached.process is None
    attached.close()  # leaves a server it did not start running
    assert server_engine.server.process.poll() is None
