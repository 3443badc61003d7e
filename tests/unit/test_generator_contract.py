"""One contract over every generator: what the loop, the pipeline (actors.py, partial.py) and
the serving scheduler touch is declared in `generate/protocol.py` and behaves the same on the
torch engine (lean and generic paths), the reference sampler (`Generator` only) and vLLM (under
`-m vllm`, where vLLM is installed: its CPU build here, `bash scripts/setup.sh --vllm`; the
session's shared engine, weights pushed by vLLM's in-place reload)."""

import pytest

from gapless.generate.protocol import Generator, SteppedGenerator, StreamingGenerator
from gapless.types import SamplingParams

STEPPED = ["torch", "torch-generic", pytest.param("vllm", marks=pytest.mark.vllm)]


def _build(kind, policy, tmp_path):
    if kind == "torch":
        from gapless.generate.engine import TorchEngine

        return TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=4, max_seq_len=128)
    if kind == "torch-generic":  # the generic runner on a model the lean one also serves
        from gapless.generate.engine import TorchEngine

        return TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=4, max_seq_len=128, path="generic")
    if kind == "reference":
        from gapless.generate.sampler import TorchSampler

        return TorchSampler(policy.model, policy.eos_id, policy.pad_id, policy.decode)
    raise ValueError(kind)


_ENGINES: dict = {}


@pytest.fixture(params=STEPPED)
def stepped(request, tiny_policy, tmp_path_factory):
    if request.param == "vllm":  # the session's one engine (vLLM allows one per process), head dim 32
        engine = request.getfixturevalue("vllm_engine")
    else:
        if request.param not in _ENGINES:
            _ENGINES[request.param] = _build(request.param, tiny_policy, tmp_path_factory.mktemp("engine"))
        engine = _ENGINES[request.param]
    yield engine
    engine.abort({s.request_id for s in engine.running})
    assert not engine.has_work


@pytest.mark.parametrize("kind", ["torch", "reference"])
def test_every_generator_generates_in_order_with_versions(kind, tiny_policy, problems, tmp_path):
    gen = _build(kind, tiny_policy, tmp_path)
    assert isinstance(gen, Generator)
    prompts = [tiny_policy.encode(p.prompt) for p in problems[:3]]
    gen.update_weights(tiny_policy.model.state_dict(), version=5)
    out = gen.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4))
    assert [c.prompt_ids for c in out] == prompts
    assert all(c.versions == [5] * len(c.token_ids) for c in out) and gen.version == 5


@pytest.fixture
def stepped_policy(request, tiny_policy):
    """The policy whose weights the `stepped` engine holds."""
    return request.getfixturevalue("vllm_policy") if request.node.callspec.params["stepped"] == "vllm" else tiny_policy


def test_stepped_surface(stepped, stepped_policy, problems):
    """Declared and live: counts, the running view, steps, abort/resume, an in-flight swap."""
    tiny_policy = stepped_policy
    assert isinstance(stepped, SteppedGenerator) and isinstance(stepped, StreamingGenerator)
    assert stepped.max_seq_len >= 64
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=2)
    prompts = [tiny_policy.encode(p.prompt) for p in problems[:3]]
    ids = [stepped.add_request(p, params, n=2) for p in prompts]  # 6 samples, 4 slots
    assert stepped.has_work and stepped.num_running + stepped.num_waiting == 6
    stepped.step()
    assert stepped.num_running == 4 and stepped.num_waiting == 2
    running = list(stepped.running)
    assert len(running) == 4 and all(s.request_id in ids and len(s.tokens) == 1 for s in running)
    assert [(r.request_id, r.index, list(r.token_ids)) for r in stepped.running_samples()] == [
        (s.request_id, s.index, s.tokens) for s in running
    ]
    version = stepped.version
    stepped.update_weights(tiny_policy.model.state_dict(), version=version + 1)  # in flight
    partials = stepped.abort([ids[0]])
    assert [c.finish_reason for c in partials] == ["abort", "abort"]
    stepped.resume(partials, params)
    done = []
    while stepped.has_work:
        done += stepped.step()
    assert len(done) == 6 and all(len(c.token_ids) == 6 for c in done)
    assert all(c.versions[-1] == version + 1 and c.versions == sorted(c.versions) for c in done)
    assert stepped.num_running == stepped.num_waiting == 0 and list(stepped.running) == []
