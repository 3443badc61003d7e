"""The torch engine against references: HF `generate`, full recomputation, the trainer's
log-probs, and HF forward passes around an in-flight weight swap. Every test runs on the native
decode kernels and on the torch path (the fallback where no C compiler is available)."""

import copy

import pytest
import torch
from engine_model import tiny_in
from transformers import DynamicCache

from gapless.generate import kv_cache
from gapless.generate.engine import TorchEngine, decode_rows
from gapless.generate.runner import DecoderRunner, attention_ranges
from gapless.trainer.batch import build_batch, token_logprobs
from gapless.types import SamplingParams


def _peaked(model, seed: int, std: float = 0.15):
    """A copy with larger random weights: its greedy outputs vary instead of repeating one token."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def policy(request, problems):
    pol = tiny_in(request.param, [p.prompt + p.solution for p in problems])
    pol.model = _peaked(pol.model, seed=1)
    return pol


@pytest.fixture(scope="module", params=["native", "torch"])
def kernels(request):
    return request.param


def _prompts(policy, problems, k=6):
    prompts = [policy.encode(p.prompt) for p in problems[:k]]
    assert k == 1 or len({len(p) for p in prompts}) > 1  # mixed lengths
    return prompts


def _engine(policy, kernels, **kw):
    return TorchEngine(policy.model, policy.eos_id, kernels=kernels, **kw)


def _hf_forward(model, ids, cache=None):
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=cache is not None)
    return out.logits[0]  # (L, V)


def test_greedy_equals_transformers_generate(policy, problems, kernels):
    prompts = _prompts(policy, problems)
    engine = _engine(policy, kernels, max_batch=4)  # fewer slots than prompts: slots are refilled mid-run
    got = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12))
    width = max(map(len, prompts))
    ids = torch.tensor([[policy.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ref = policy.model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=policy.pad_id,
        eos_token_id=policy.eos_id,
    )[:, width:]
    for c, row in zip(got, ref.tolist()):
        assert c.token_ids == row[: len(c.token_ids)]
        assert len(c.token_ids) == 12 or c.token_ids[-1] == policy.eos_id
    assert len({tuple(c.token_ids) for c in got}) > 1


@pytest.mark.parametrize(
    ("starts", "ranges"),
    [
        ([6, 9, 4, 7, 5], None),
        ([40, 3, 4, 3, 5, 4, 3, 6], [(0, 1), (1, 8)]),
        ([3, 40, 4, 30, 5, 4, 3, 6], [(0, 1), (1, 4), (4, 5), (5, 8)]),
    ],
    ids=["mixed", "one-long", "split"],
)
def test_cached_decode_logits_equal_full_recomputation(policy, problems, starts, ranges, kernels):
    """Runner level: prefill of prefixes of different lengths, then batched decode steps with
    every row at its own position, attending in one range or in several (each its own length)."""
    seqs = [policy.encode(p.prompt + p.solution) * 3 for p in problems[: len(starts)]]  # any tokens will do
    assert all(len(s) >= n + 8 for s, n in zip(seqs, starts))
    runner = DecoderRunner(policy.model, 128, kernels)
    cache = runner.new_cache(len(starts))
    rows = range(len(starts))
    for layer, (k, v) in enumerate(runner.prefill([tuple(s[:n]) for s, n in zip(seqs, starts)])):
        cache.write_prefix(layer, k, v, torch.arange(len(starts)), torch.arange(len(starts)))
    with torch.no_grad():
        full = [_hf_forward(policy.model, s) for s in seqs]
    positions = torch.tensor(starts)
    for _ in range(8):
        tokens = torch.tensor([seqs[r][int(positions[r])] for r in rows])
        step = runner.decode(tokens, positions, cache, ranges)
        want = torch.stack([full[r][int(positions[r])] for r in rows])
        assert torch.allclose(step, want, atol=1e-5), (step - want).abs().max()
        positions += 1


def test_attention_ranges_split_where_it_saves_reading():
    """Cost of a split = sum over ranges of rows x (longest position + 1), + 256 per range."""
    assert attention_ranges([5, 6, 4, 7]) == [(0, 4)]  # nothing to save
    # one range: 4 x 301 + 256 = 1460; the long row alone: 301 + 256 + 3 x 8 + 256 = 837
    assert attention_ranges([300, 5, 6, 7]) == [(0, 1), (1, 4)]
    # two cohorts of long rows, then short ones (32 rows): one range 32 x 301 + 256 = 9888;
    # (0, 4) (4, 32): 4 x 301 + 28 x 8 + 2 x 256 = 1940; (0, 2) (2, 4) (4, 32): 602 + 202 + 224 + 768 = 1796
    assert attention_ranges([300, 290, 100, 95, 5, 7] + [6] * 26) == [(0, 2), (2, 4), (4, 32)]


def test_engine_tokens_and_logprobs_equal_full_recomputation(policy, problems, kernels):
    engine = _engine(policy, kernels, max_batch=3)
    for c in engine.generate(_prompts(policy, problems), SamplingParams(greedy=True, max_new_tokens=8)):
        with torch.no_grad():
            logits = _hf_forward(policy.model, c.prompt_ids + c.token_ids)
        steps = logits[len(c.prompt_ids) - 1 : -1]
        assert steps.argmax(-1).tolist() == c.token_ids
        full = torch.log_softmax(steps, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(full, torch.tensor(c.logprobs), atol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampling_logprobs_equal_trainer_logprobs(policy, problems, temperature, kernels):
    """Invariant 5 with groups (shared prefill) and slot refills: importance ratio exactly 1."""
    engine = _engine(policy, kernels, max_batch=5)
    prompts = [p for p in _prompts(policy, problems, 4) for _ in range(3)]
    completions = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=10, seed=3))
    batch = build_batch(completions, [1.0] * len(completions), [True] * len(completions), policy.pad_id)
    with torch.no_grad():
        trainer_lp = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, temperature=temperature)
    assert ((trainer_lp - batch.behaviour_logprobs) * batch.loss_mask).abs().max() < 1e-5
    assert batch.num_tokens == sum(len(c.token_ids) for c in completions)


def _step_until(engine, steps):
    done = []
    for _ in range(steps):
        done += engine.step()
    return done


def test_in_flight_swap_keeps_cache_and_versions(policy, problems, kernels):
    """Tokens after the swap are what the new weights produce from the old weights' cache."""
    new_model = _peaked(policy.model, seed=2)
    engine = _engine(policy, kernels, max_batch=8)
    params = SamplingParams(greedy=True, max_new_tokens=10)
    for prompt in _prompts(policy, problems, 4):
        engine.add_request(prompt, params)
    assert _step_until(engine, 4) == []
    engine.update_weights(new_model.state_dict(), version=1)
    done = []
    while engine.has_work:
        done += engine.step()
    assert len(done) == 4
    for c in done:
        assert c.versions == [0] * 4 + [1] * 6
        before, after = c.token_ids[:4], c.token_ids[4:]
        with torch.no_grad():
            cache = DynamicCache()
            _hf_forward(policy.model, c.prompt_ids + before[:-1], cache)  # cache built by the old weights
            token, want = before[-1], []
            for _ in after:
                token = int(
                    new_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1].argmax()
                )
                want.append(token)
        assert after == want


def test_in_flight_swap_with_recompute_uses_only_new_weights(policy, problems, kernels):
    new_model = _peaked(policy.model, seed=2)
    engine = _engine(policy, kernels, max_batch=8, recompute_kv=True)
    params = SamplingParams(greedy=True, max_new_tokens=9)
    for prompt in _prompts(policy, problems, 3):
        engine.add_request(prompt, params)
    _step_until(engine, 3)
    engine.update_weights(new_model.state_dict(), version=5)
    done = []
    while engine.has_work:
        done += engine.step()
    for c in done:
        assert c.versions == [0] * 3 + [5] * 6
        ids = c.prompt_ids + c.token_ids[:3]
        for token in c.token_ids[3:]:
            with torch.no_grad():
                assert int(_hf_forward(new_model, ids)[-1].argmax()) == token
            ids.append(token)


def test_abort_returns_partials_that_resume_to_the_uninterrupted_result(policy, problems, kernels):
    prompts = _prompts(policy, problems, 3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)
    reference = _engine(policy, kernels, max_batch=8)
    ids = [reference.add_request(p, params, n=2) for p in prompts]
    full = {(c.request_id, c.index): c.token_ids for c in _step_until(reference, 12)}

    engine = _engine(policy, kernels, max_batch=8)
    assert [engine.add_request(p, params, n=2) for p in prompts] == ids
    _step_until(engine, 5)
    partials = engine.abort([ids[1]])
    assert [(c.index, c.finish_reason, len(c.token_ids)) for c in partials] == [(0, "abort", 5), (1, "abort", 5)]
    assert engine.num_running == 4
    engine.update_weights(policy.model.state_dict(), version=1)  # same weights, new version
    engine.resume(partials, params)
    done = {(c.request_id, c.index): c for c in _step_until(engine, 12)}
    assert not engine.has_work
    assert {k: c.token_ids for k, c in done.items()} == full
    for j in (0, 1):
        assert done[(ids[1], j)].versions == [0] * 5 + [1] * 7


def test_group_prompt_is_prefilled_once_and_matches_generate(policy, problems, kernels):
    prompt = _prompts(policy, problems, 2)[1]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9, ignore_eos=True)
    engine = _engine(policy, kernels, max_batch=3)  # the group of 8 is admitted in three waves
    engine.add_request(prompt, params, n=8)
    done = sorted(_step_until(engine, 20), key=lambda c: c.index)
    assert engine.stats.prefill_tokens == len(prompt) - 1  # the last prompt token is decoded, per sample
    assert len({tuple(c.token_ids) for c in done}) > 1
    again = _engine(policy, kernels, max_batch=16).generate([prompt] * 8, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in done]


def test_freed_slot_is_refilled_at_the_next_step(policy, problems, kernels):
    prompts = _prompts(policy, problems, 3)
    engine = _engine(policy, kernels, max_batch=2)
    for prompt, length in zip(prompts, [2, 6, 3]):
        engine.add_request(prompt, SamplingParams(greedy=True, max_new_tokens=length, ignore_eos=True))
    running = []
    while engine.has_work:
        engine.step()
        running.append(engine.num_running)
    # step 2 retires the first request; step 3 admits the third into its slot
    assert running == [2, 1, 2, 2, 1, 0]


def test_stop_tokens_end_a_completion(policy, problems, kernels):
    prompt = _prompts(policy, problems, 1)[0]
    engine = _engine(policy, kernels)
    free = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=8, ignore_eos=True))[0]
    stop = free.token_ids[3]
    cut = engine.generate(
        [prompt], SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(stop,), ignore_eos=True)
    )[0]
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"


def test_sequence_tokens_do_not_depend_on_batch_mates(policy, problems, kernels):
    prompts = _prompts(policy, problems, 4)
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=10, seed=4, ignore_eos=True)
    alone = _engine(policy, kernels).generate(prompts[:1], params)[0]
    crowd = _engine(policy, kernels, max_batch=2).generate(prompts, params)[0]
    assert alone.token_ids == crowd.token_ids


def test_update_weights_rejects_a_mismatched_state(policy, kernels):
    engine = _engine(policy, kernels)
    state = dict(policy.model.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights(state, 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request([1] * 500, SamplingParams(max_new_tokens=24))


def test_partial_rollouts_resume_under_new_weights_with_versions(policy, problems, kernels):
    """The pipeline's partial-rollout lever: cut at 3 tokens while another group waits, swap
    weights, resume. Tokens before the cut keep version 0, tokens after it carry version 1 and
    are what the new weights produce from that context (greedy, KV recomputed)."""
    from gapless.orchestrate.partial import PartialRollouts

    prompts = _prompts(policy, problems, 3)
    params = SamplingParams(greedy=True, max_new_tokens=6, ignore_eos=True)
    engine = _engine(policy, kernels, max_batch=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, 1, request_id=str(i))
    for _ in range(3):
        engine.step()
    assert PartialRollouts(every_tokens=3).cut(engine, lambda _: params) == ["0", "1"]
    assert [seq.request_id for seq in engine.waiting] == ["2", "0", "1"]  # cut groups go to the back
    new_model = _peaked(policy.model, seed=7)
    engine.update_weights(new_model.state_dict(), version=1)
    done = {}
    while engine.has_work:
        done.update((c.request_id, c) for c in engine.step())
    reference = TorchEngine(new_model, policy.eos_id, max_batch=4, kernels=kernels)
    for i in ("0", "1"):
        c = done[i]
        assert c.versions == [0, 0, 0, 1, 1, 1]
        cont = reference.generate(
            [c.prompt_ids + c.token_ids[:3]], SamplingParams(greedy=True, max_new_tokens=3, ignore_eos=True)
        )[0]
        assert c.token_ids[3:] == cont.token_ids
    assert done["2"].versions == [1] * 6  # started after the swap


def test_decode_runs_on_a_few_row_counts_and_padding_rows_change_nothing(policy, problems, kernels):
    """A batch shrinking through every size from 20 to 1 runs the forward on rounded row counts
    only (one oneDNN kernel per count and layer is cached for the process's life), and every
    completion equals the full recomputation of its own tokens: the parked slots that pad the
    batch do not leak into the real rows."""
    engine = _engine(policy, kernels, max_batch=20)
    seen, decode = [], engine.runner.decode
    engine.runner.decode = lambda tokens, *a, **kw: (seen.append(len(tokens)), decode(tokens, *a, **kw))[1]
    prompts = [policy.encode(p.prompt) for p in problems[:20]]
    for i, prompt in enumerate(prompts):  # sequence i stops after i + 1 tokens: the batch shrinks by one a step
        engine.add_request(prompt, SamplingParams(greedy=True, max_new_tokens=i + 1, ignore_eos=True))
    done = []
    while engine.has_work:
        done += engine.step()
    assert sorted(set(seen)) == [8, 16, 20] and {decode_rows(b, 20) for b in range(1, 21)} == {8, 16, 20}
    assert sorted(len(c.token_ids) for c in done) == list(range(1, 21))
    assert engine.slots.position.tolist() == [0] * 20  # every slot parked again
    for c in done:
        with torch.no_grad():
            steps = _hf_forward(policy.model, c.prompt_ids + c.token_ids)[len(c.prompt_ids) - 1 : -1]
        assert steps.argmax(-1).tolist() == c.token_ids
        full = torch.log_softmax(steps, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(full, torch.tensor(c.logprobs), atol=1e-5)


def test_partial_rollouts_cut_at_a_time_deadline_only_while_others_wait(policy, problems, kernels):
    """A group running for `deadline_s` since it got a slot is cut and queued at the back; its
    clock restarts when it runs again; nothing is cut while no sequence waits. The resumed
    completion equals the uninterrupted one (same weights, greedy)."""
    from gapless.orchestrate.partial import PartialRollouts

    now = [0.0]
    partial = PartialRollouts(deadline_s=1.0, clock=lambda: now[0])
    prompts = _prompts(policy, problems, 3)
    params = SamplingParams(greedy=True, max_new_tokens=6, ignore_eos=True)
    engine = _engine(policy, kernels, max_batch=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, 1, request_id=str(i))
    engine.step()
    assert partial.cut(engine, lambda _: params) == []  # "0" and "1" start their clocks at t = 0
    now[0] = 0.9
    engine.step()
    assert partial.cut(engine, lambda _: params) == []  # before the deadline
    now[0] = 1.0
    engine.step()
    assert partial.cut(engine, lambda _: params) == ["0", "1"]
    assert [seq.request_id for seq in engine.waiting] == ["2", "0", "1"] and partial.running_since == {}
    engine.step()  # "2" and "0" take the slots; "1" waits
    now[0] = 1.5
    assert partial.cut(engine, lambda _: params) == []  # the clocks of "2" and "0" started at 1.5
    done = {}
    while engine.has_work:
        done.update((c.request_id, c) for c in engine.step())
        now[0] += 0.1
        partial.cut(engine, lambda _: params)
    reference = _engine(policy, kernels, max_batch=4).generate(prompts, params)
    assert [done[str(i)].token_ids for i in range(3)] == [c.token_ids for c in reference]
    idle = PartialRollouts(deadline_s=1.0, clock=lambda: 100.0)
    lone = _engine(policy, kernels, max_batch=4)
    lone.add_request(prompts[0], params, 1, request_id="x")
    lone.step()
    assert idle.cut(lone, lambda _: params) == [] and lone.num_waiting == 0  # nobody waits: no cut


def test_kv_cache_grows_with_the_contexts_and_growth_changes_no_token(policy, problems, kernels, monkeypatch):
    """Slots hold the longest context so far, not max_seq_len: a cache that doubles its positions
    while sequences run (from 8 here) gives every token and log-prob of one sized at max_seq_len."""
    monkeypatch.setattr(kv_cache, "INITIAL_POSITIONS", 8)
    prompts = [policy.encode(p.prompt) for p in problems[:5]]
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5, ignore_eos=True)
    grown = _engine(policy, kernels, max_batch=4, max_seq_len=400)
    full = _engine(policy, kernels, max_batch=4, max_seq_len=400)
    full.cache.hold(400)
    got, want = grown.generate(prompts, params), full.generate(prompts, params)
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in want]
    longest = max(len(p) for p in prompts) + 40
    assert longest <= grown.cache.capacity < 2 * longest and full.cache.capacity == 400
    assert grown.cache.num_bytes < full.cache.num_bytes


def test_kv_cache_grows_with_the_batch_and_growth_changes_no_token(policy, problems, kernels):
    """The cache holds the busiest batch's slots, not max_batch's: sequences in flight while it
    grows keep their keys/values, so every token and log-prob equals those of an engine whose
    cache was sized at max_batch from the start."""
    prompts = [policy.encode(p.prompt) for p in problems[:12]]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)

    def run(engine):
        slots, done = [], []
        for prompt in prompts[:3]:
            engine.add_request(prompt, params)
        for _ in range(4):  # three sequences part-way through when nine more arrive
            done += engine.step()
            slots.append(engine.cache.slots)
        for prompt in prompts[3:]:
            engine.add_request(prompt, params)
        while engine.has_work:
            done += engine.step()
            slots.append(engine.cache.slots)
        return sorted((c.prompt_ids, c.token_ids, c.logprobs) for c in done), slots

    grown = _engine(policy, kernels, max_batch=64)
    assert grown.cache.slots == 0 and grown.cache.num_bytes == 0
    got, slots = run(grown)
    assert slots[0] == decode_rows(3, 64) == 8 and max(slots) == 16  # 12 running: 16 padded rows, not 64
    full = _engine(policy, kernels, max_batch=64)
    full.cache.reserve(64)
    want, _ = run(full)
    assert got == want and len(got) == 12
