"""The vLLM backend on the same contract as the torch engine. Needs CUDA and vLLM; skipped otherwise.

Run where a GPU is available:  pytest -q -m gpu tests/unit/test_vllm_engine.py
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the vLLM backend needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from gapless.generate.vllm_engine import VLLMEngine  # noqa: E402
from gapless.trainer.batch import build_batch, token_logprobs  # noqa: E402
from gapless.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def served(tiny_policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "policy"
    tiny_policy.save(path)
    engine = VLLMEngine(str(path), tiny_policy.eos_id, dtype="float32", max_seq_len=256, gpu_memory_utilization=0.2,
                        prefix_caching=False, enforce_eager=True)
    return engine


def _prompts(policy, problems, k=6):
    return [policy.encode(p.prompt) for p in problems[:k]]


def test_greedy_equals_transformers_generate(served, tiny_policy, problems):
    prompts = _prompts(tiny_policy, problems)
    got = served.generate(prompts, SamplingParams(greedy=True, max_new_tokens=8))
    for prompt, c in zip(prompts, got):
        with torch.no_grad():
            ref = tiny_policy.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                             do_sample=False, max_new_tokens=8, pad_token_id=tiny_policy.pad_id)
        assert c.token_ids == ref[0, len(prompt):].tolist()[: len(c.token_ids)]


def test_logprobs_equal_trainer_logprobs(served, tiny_policy, problems):
    completions = served.generate(_prompts(tiny_policy, problems), SamplingParams(temperature=0.7, max_new_tokens=10, seed=3))
    batch = build_batch(completions, [1.0] * len(completions), [True] * len(completions), tiny_policy.pad_id)
    with torch.no_grad():
        trainer_lp = token_logprobs(tiny_policy.model, batch.input_ids, batch.attention_mask, temperature=0.7)
    assert ((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max() < 1e-4


def test_in_flight_swap_records_versions_and_abort_resumes(served, tiny_policy, problems):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=1)
    ids = [served.add_request(p, params, n=2) for p in _prompts(tiny_policy, problems, 3)]
    for _ in range(4):
        served.step()
    served.update_weights(tiny_policy.model.state_dict(), version=1)
    partials = served.abort([ids[0]])
    assert partials and all(c.finish_reason == "abort" for c in partials)
    served.resume(partials, params)
    done = []
    while served.has_work:
        done += served.step()
    assert len(done) == 6
    for c in done:
        assert len(c.token_ids) == 12 and c.versions[0] == 0 and c.versions[-1] == 1
        assert c.versions == sorted(c.versions)


def test_one_engine_per_process(served, tiny_policy, tmp_path):
    with pytest.raises(RuntimeError, match="one engine per process"):
        VLLMEngine(str(tmp_path), tiny_policy.eos_id)
