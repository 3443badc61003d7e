"""Automatic prefix caching: the cache's own bookkeeping, and the torch engine with it against the
same engine without it (greedy tokens equal, sampled log-probs equal the trainer's) over
multi-turn conversations, partial matches, a prefix longer than the new prompt, eviction and a
weight update between calls. Engine tests run on the native kernels and on the torch path."""

import copy

import pytest
import torch
from engine_model import tiny_in

from gapless.generate.engine import TorchEngine
from gapless.generate.prefix_cache import BLOCK, PrefixCache
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.types import SamplingParams


def _kv(n: int, fill: float = 0.0, layers: int = 2):
    """Stand-in keys/values of n tokens (1, 1, n, 4) per layer: 2 * layers * n * 4 floats."""
    return [(torch.full((1, 1, n, 4), fill), torch.full((1, 1, n, 4), fill)) for _ in range(layers)]


def _bytes(n: int, layers: int = 2) -> int:
    return 2 * layers * n * 4 * 4


def test_lookup_returns_the_longest_shared_prefix_within_a_block():
    cache = PrefixCache(1 << 20)
    a = tuple(range(50))
    cache.insert(a, _kv(50, 1.0))
    b = a[:37] + (999,) * 20  # diverges inside the third block
    kv, length = cache.lookup(b)
    assert length == 37 and kv[0][0].shape[2] == 37
    kv, length = cache.lookup(a[:20])  # the entry is longer than the new context
    assert length == 20
    assert cache.lookup((7,) + a[1:]) is None  # the first block differs
    assert cache.lookup(a[: BLOCK - 1]) is None  # shorter than a block: not looked for
    s = cache.stats
    assert (s.hits, s.misses, s.hit_tokens) == (2, 2, 57)


def test_a_longer_entry_covers_its_prefixes_and_duplicates_are_not_kept():
    cache = PrefixCache(1 << 20)
    turn1, turn2 = tuple(range(40)), tuple(range(70))
    cache.insert(turn1, _kv(40))
    cache.insert(turn2, _kv(70))
    assert len(cache) == 1 and cache.num_bytes == _bytes(70)  # turn 1 dropped: turn 2 holds it
    cache.insert(turn1, _kv(40))  # already inside turn 2
    assert len(cache) == 1 and cache.lookup(turn1)[1] == 40


def test_least_recently_used_entries_are_evicted_within_the_budget():
    cache = PrefixCache(_bytes(100))
    a, b, c = (tuple([i] * 40) for i in (1, 2, 3))
    cache.insert(a, _kv(40))
    cache.insert(b, _kv(40))
    cache.lookup(a)  # a is now the most recently used
    cache.insert(c, _kv(40))  # 120 tokens > budget: b goes
    assert cache.lookup(b) is None and cache.lookup(a) is not None and cache.lookup(c) is not None
    assert cache.num_bytes <= cache.budget_bytes and cache.stats.evictions == 1
    cache.insert(tuple([4] * 200), _kv(200))  # larger than the whole budget: not kept, nothing evicted
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.num_bytes == 0 and cache.stats.invalidations == 1


def test_a_hash_collision_never_serves_another_context(monkeypatch):
    import gapless.generate.prefix_cache as pc

    monkeypatch.setattr(pc, "_chain", lambda tokens: [0] * (len(tokens) // BLOCK))  # every block collides
    cache = PrefixCache(1 << 20)
    cache.insert(tuple(range(40)), _kv(40))
    assert cache.lookup(tuple(range(100, 140))) is None


# ---- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def policy(request, problems):
    pol = tiny_in(request.param, [p.prompt + p.solution for p in problems])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger weights: greedy outputs vary instead of repeating one token
        for p in pol.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return pol


@pytest.fixture(scope="module", params=["native", "torch"])
def kernels(request):
    return request.param


def _engines(policy, kernels, mb=64, **kw):
    on = TorchEngine(policy.model, policy.eos_id, kernels=kernels, prefix_cache_mb=mb, **kw)
    off = TorchEngine(policy.model, policy.eos_id, kernels=kernels, **kw)
    return on, off


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _conversation(engine, params, turns=4, seed=0):
    """Turns of one conversation: each prompt is the last prompt, its completion and a new
    'user' message, as a multi-turn client sends them. Returns every turn's completion."""
    context, out = _tokens(seed, 24), []
    for turn in range(turns):
        (c,) = engine.generate([context], params)
        out.append(c)
        context = context + c.token_ids + _tokens(seed * 100 + turn + 1, 9)
    return out


def _assert_same(a, b):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
        assert x.versions == y.versions and x.finish_reason == y.finish_reason


def _assert_trainer_logprobs(policy, completions, temperature):
    batch = build_batch(completions, [1.0] * len(completions), [True] * len(completions), policy.pad_id)
    with torch.no_grad():
        trainer_lp = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, temperature=temperature)
    assert ((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max() < 1e-5


@pytest.mark.parametrize("greedy", [True, False])
def test_multi_turn_conversation_equals_the_engine_without_the_cache(policy, kernels, greedy):
    params = SamplingParams(greedy=greedy, temperature=0.9, max_new_tokens=12, seed=5, ignore_eos=True)
    on, off = _engines(policy, kernels)
    with_cache = _conversation(on, params)
    _assert_same(with_cache, _conversation(off, params))
    s = on.stats.prefix_cache
    assert s.hits == 3 and s.misses == 1  # every turn after the first reuses the one before
    assert on.stats.prefill_tokens < off.stats.prefill_tokens / 2
    if not greedy:
        _assert_trainer_logprobs(policy, with_cache, 0.9)


def test_partial_matches_longer_cached_prefixes_and_groups(policy, kernels):
    """Prompts branching from a shared head at different points, one shorter than what is
    cached, groups of samples, all in batches mixing hits and misses."""
    params = SamplingParams(temperature=1.1, max_new_tokens=10, seed=2, ignore_eos=True)
    head = _tokens(1, 50)
    first = [head + _tokens(2, 20), _tokens(3, 30)]
    second = (
        [
            head[:37] + _tokens(4, 12),  # diverges inside a block of a cached prompt
            head + _tokens(2, 20)[:5],  # shares part of the first prompt's tail
            head[:30],  # shorter than the cached prefix: a whole-prompt hit
            _tokens(5, 8),  # shorter than a block
        ]
        * 2
    )  # each twice: samples of one prefix in one batch
    on, off = _engines(policy, kernels, max_batch=3)  # fewer slots than sequences: stashes and refills
    a = on.generate(first, params) + on.generate(second, params)
    b = off.generate(first, params) + off.generate(second, params)
    _assert_same(a, b)
    assert on.stats.prefix_cache.hits >= 3 and on.stats.prefix_cache.hit_tokens >= 37 + 54 + 29
    _assert_trainer_logprobs(policy, a, 1.1)


def test_eviction_under_a_small_budget_changes_no_output(policy, kernels):
    params = SamplingParams(greedy=True, max_new_tokens=8, ignore_eos=True)
    per_token = 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 KV heads, head_dim 8, fp32
    on, off = _engines(policy, kernels, mb=1)
    on.prefix_cache.budget_bytes = 100 * per_token  # room for about two conversations' contexts
    a = [c for seed in (1, 2, 3, 1, 2, 3) for c in _conversation(on, params, turns=2, seed=seed)]
    b = [c for seed in (1, 2, 3, 1, 2, 3) for c in _conversation(off, params, turns=2, seed=seed)]
    _assert_same(a, b)
    assert on.stats.prefix_cache.evictions > 0 and on.prefix_cache.num_bytes <= on.prefix_cache.budget_bytes


def test_a_weight_update_invalidates_every_cached_prefix(policy, kernels):
    """After a push no request sees keys/values of the old weights: the tokens equal an engine
    without the cache under the same push, and carry the new version."""
    params = SamplingParams(temperature=0.8, max_new_tokens=10, seed=4, ignore_eos=True)
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in policy.model.state_dict().items()}
    prompt = _tokens(7, 40)
    on, off = _engines(policy, kernels)
    results = []
    for engine in (on, off):
        (before,) = engine.generate([prompt], params)
        engine.update_weights(new_weights, version=3)
        (again,) = engine.generate([prompt], params)
        (turn2,) = engine.generate([prompt + again.token_ids + _tokens(8, 5)], params)
        results.append([before, again, turn2])
    _assert_same(*results)
    assert results[0][1].versions == [3] * 10
    assert on.stats.prefix_cache.invalidations == 1 and on.stats.prefix_cache.hits == 1  # only turn 2, after the push
    updated = copy.deepcopy(policy)
    updated.model.load_state_dict(new_weights)
    _assert_trainer_logprobs(updated, results[0][1:], 0.8)


def test_a_sequence_spanning_a_swap_is_not_cached(policy, kernels):
    """KV kept through an in-flight swap mixes two policies: such a context never enters the cache."""
    params = SamplingParams(greedy=True, max_new_tokens=10, ignore_eos=True)
    on, _ = _engines(policy, kernels)
    on.add_request(_tokens(9, 30), params)
    for _ in range(3):
        on.step()
    on.update_weights(policy.model.state_dict(), version=1)
    while on.has_work:
        on.step()
    assert len(on.prefix_cache) == 0


def test_the_generic_path_keeps_no_prefix_cache(policy):
    engine = TorchEngine(policy.model, policy.eos_id, prefix_cache_mb=64, path="generic")
    assert engine.prefix_cache is None


def test_served_conversation_hits_the_cache_and_metrics_count_it():
    """`gapless serve`'s path (the scheduler, the OpenAI routes): a growing conversation gives the
    same text with the cache as without, and /metrics counts the hits."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from serve_model import tiny_policy

    from gapless.serve.openai.server import ServerThread, build_app

    policy = tiny_policy()
    texts = {}
    for mb in (0, 16):
        srv = ServerThread(build_app(policy, "tiny", max_batch=4, prefix_cache_mb=mb))
        try:
            client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
            prompt, turns = "Question 3: name 3 fruits, colours or animals. Answer:", []
            for turn in range(4):
                out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
                turns.append(out.choices[0].text)
                prompt += out.choices[0].text + f" Question {turn}: name"
            texts[mb] = turns
            with httpx.Client(base_url=srv.url.removesuffix("/v1"), timeout=30) as http:
                metrics = {
                    f.name: f.samples[0].value for f in text_string_to_metric_families(http.get("/metrics").text)
                }
        finally:
            srv.close()
    assert texts[16] == texts[0]
    assert metrics["gapless_prefix_cache_hits"] == 3 and metrics["gapless_prefix_cache_hit_tokens"] > 40


def test_tinker_service_conversation_reuses_keys_values_only_under_the_same_weights(tmp_path):
    """The Tinker service (cache on by default): a conversation on a LoRA snapshot hits the cache;
    after another step its engine is re-keyed to the new snapshot (one engine allowed), and the
    same conversation's log-probs are the new weights', checked against `compute_logprobs`."""
    import numpy as np
    import tinker
    from tinker import types
    from tinker_service import KEY, served

    with served(tmp_path, max_engines="1") as (server, policy):
        with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
            trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
            text = policy.encode("Question 2: name 2 fruits. Answer: apple, red.")
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(text[:-1]),
                loss_fn_inputs={"target_tokens": np.array(text[1:], dtype=np.int64)},
            )
            prompt = policy.encode("Question 4: name 4 fruits, colours or animals. Answer:")
            params = types.SamplingParams(max_tokens=6, seed=3)
            hits = []
            for _ in range(2):  # a training step, then a new snapshot sampled turn by turn
                trainer.forward_backward([datum], "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
                sampler = trainer.save_weights_and_get_sampling_client().result()
                context = list(prompt)
                for turn in range(3):
                    seq = sampler.sample(types.ModelInput.from_ints(context), 1, params).result().sequences[0]
                    full = context + list(seq.tokens)
                    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[len(context) :]
                    assert np.abs(np.array(seq.logprobs) - np.array(scored)).max() < 1e-4
                    context = full + policy.encode(f" Question {turn}: name")
                engines = {id(s.engine): s.engine for s in server.app.pool.schedulers}.values()
                assert len(engines) == 2  # the base's (the OpenAI routes') and one for the snapshots
                hits.append(sum(e.stats.prefix_cache.hits for e in engines))
            misses = sum(e.stats.prefix_cache.misses for e in engines)
            invalidations = sum(e.stats.prefix_cache.invalidations for e in engines)
    # the SDK's compute_logprobs is a one-token sample of its prompt: per conversation the first
    # sample misses, and its scoring and both later turns' samples and scorings hit
    assert hits == [5, 10]
    assert misses == 2 and invalidations == 1  # re-keyed to the second snapshot: nothing of the first is reused
