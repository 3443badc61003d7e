"""The request scheduler over a real TorchEngine and a tiny model: samples equal the engine's own,
requests from many threads share engine steps, stop strings end decoding with exact token counts,
aborts free slots, and what cannot be served is refused before it reaches the engine."""

from __future__ import annotations

import threading

import pytest
import torch
from serve_model import tiny_policy

from gapless.generate.engine import TorchEngine
from gapless.serve.protocol import ContextLengthExceeded, InvalidRequest, QueueFull, SampleRequest, SchedulerClosed
from gapless.serve.scheduler import EngineFailed, Scheduler
from gapless.types import SamplingParams


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    return tiny_policy()


@pytest.fixture()
def scheduler(policy):
    sched = Scheduler(
        TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=16), policy.decode, max_samples=24
    )
    yield sched
    sched.close()


def _prompt(policy, i=0):
    return tuple(policy.encode(f"Question {i}: name"))


def test_samples_equal_the_engines_own(policy, scheduler):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7)
    prompt = _prompt(policy)
    engine = TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=16)
    engine.add_request(list(prompt), params, n=3)
    own = {}
    while engine.has_work:
        own.update((c.index, c) for c in engine.step())
    results = scheduler.submit(SampleRequest(prompt, params, n=3)).result(timeout_s=60)
    for r in results:
        assert r.token_ids == own[r.index].token_ids and r.finish_reason == own[r.index].finish_reason
        assert r.logprobs == pytest.approx(own[r.index].logprobs, abs=1e-5)
        assert r.text == own[r.index].text and r.versions == [0] * len(r.token_ids)
    assert len({tuple(r.token_ids) for r in results}) > 1  # sample j has its own stream
    assert scheduler.num_handles == 0 and scheduler.samples_in_flight == 0


def test_requests_from_many_threads_share_engine_steps(policy, scheduler):
    params = SamplingParams(max_new_tokens=24, seed=1, ignore_eos=True)
    barrier, results = threading.Barrier(8), {}

    def client(i):
        barrier.wait()
        results[i] = scheduler.submit(SampleRequest(_prompt(policy, i), params, source=f"t{i % 2}")).result(
            timeout_s=60
        )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(len(results[i][0].token_ids) == 24 for i in range(8))
    assert scheduler.stats.steps < 8 * 24  # one step decodes several clients' samples
    assert any(len(sources) == 2 for sources in scheduler.stats.batch_sources)


def test_stop_string_ends_decoding_with_exact_counts(policy, scheduler):
    params = SamplingParams(greedy=True, max_new_tokens=40, ignore_eos=True)
    prompt = _prompt(policy, 3)
    full = scheduler.submit(SampleRequest(prompt, params)).result(timeout_s=60)[0]
    stop = full.text[5:8]  # a piece of what greedy decoding writes, found in the stream
    assert stop and len(full.text) > 10
    cut = scheduler.submit(SampleRequest(prompt, params, stop=(stop,), stream=True))
    pieces = [d.text for batch in cut.deltas() for d in batch]
    r = cut.results[0]
    assert r.finish_reason == "stop" and r.text == full.text[: full.text.find(stop)] == "".join(pieces)
    assert len(r.token_ids) < 40 and r.token_ids == full.token_ids[: len(r.token_ids)]  # decoding ended there
    assert len(r.logprobs) == len(r.versions) == len(r.token_ids)
    assert stop in policy.decode(r.token_ids) and stop not in policy.decode(r.token_ids[:-1])


def test_abort_frees_slots_at_once(policy, scheduler):
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    handles = [scheduler.submit(SampleRequest(_prompt(policy, i), params, n=2, stream=True)) for i in range(10)]
    next(handles[0].deltas())  # running
    for h in handles:
        h.abort()
    for h in handles:
        results = h.result(timeout_s=60)
        assert all(r.finish_reason == "abort" and len(r.token_ids) < 200 for r in results)
    handles[0].abort()  # a no-op once finished
    assert scheduler.num_handles == 0 and scheduler.samples_in_flight == 0 and not scheduler.engine.has_work


def test_refusals_happen_before_the_engine(policy, scheduler):
    with pytest.raises(ContextLengthExceeded, match="context is 256"):
        scheduler.submit(SampleRequest(tuple(range(250)), SamplingParams(max_new_tokens=10)))
    with pytest.raises(InvalidRequest, match="empty"):
        scheduler.submit(SampleRequest((), SamplingParams()))
    long = SamplingParams(max_new_tokens=100, ignore_eos=True)
    first = scheduler.submit(SampleRequest(_prompt(policy), long, n=20))
    with pytest.raises(QueueFull):
        scheduler.submit(SampleRequest(_prompt(policy), long, n=5))
    first.abort()
    first.result(timeout_s=60)
    assert scheduler.submit(SampleRequest(_prompt(policy), SamplingParams(max_new_tokens=2), n=5)).result(timeout_s=60)
    assert scheduler.stats.rejected == 1


def test_close_and_engine_failures_fail_requests_not_hang_them(policy):
    class Broken(TorchEngine):
        def step(self):
            raise RuntimeError("boom")

    broken = Scheduler(Broken(policy.model, policy.eos_id, policy.decode, max_batch=4), policy.decode)
    with pytest.raises(EngineFailed, match="boom"):
        broken.submit(SampleRequest(_prompt(policy), SamplingParams(max_new_tokens=4))).result(timeout_s=60)
    assert broken.num_handles == 0 and broken.samples_in_flight == 0
    broken.close()
    sched = Scheduler(TorchEngine(policy.model, policy.eos_id, policy.decode, max_batch=4), policy.decode)
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    handles = [sched.submit(SampleRequest(_prompt(policy), long, n=3)) for _ in range(3)]  # running and waiting
    sched.close()
    for h in handles:
        with pytest.raises(SchedulerClosed):
            h.result(timeout_s=60)
    with pytest.raises(SchedulerClosed):
        sched.submit(SampleRequest(_prompt(policy), long))
    assert sched.num_handles == 0 and sched.samples_in_flight == 0
