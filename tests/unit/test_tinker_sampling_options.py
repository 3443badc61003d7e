"""The sampling options of the tinker 0.38 SDK through the real SDK against a live service: top-k
prompt and sample log-probs, target prompt log-probs (dense and sparse), prompt log-probs of the
last n, alternative prompt tokens. Each value is checked against the trainer's `forward` on the
same weights (and the top-k ids against a full forward of those weights) within 1e-4; options not
served, or out of range, are user errors naming the option."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_service import KEY, served

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-options")
    with served(root) as (server, policy):
        with tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
            yield (client, *_trained(client, server, policy), policy)


def _trained(client, server, policy):
    """A LoRA client after two steps, its sampler, and a local copy of the sampler's weights."""
    trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    text = policy.encode("Question 2: name 2 fruits. Answer: apple, red.")
    datum = _datum(text)
    for _ in range(2):  # weights that differ from the base's, so the sampler must use them
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    reference = copy.deepcopy(policy.model)  # the same weights, for the full distributions
    reference.load_state_dict(server.app.runs[trainer.model_id].sampler_state(), strict=False)
    return trainer, sampler, reference


def _datum(tokens: list[int], targets: list[int] | None = None) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(targets if targets is not None else tokens[1:], dtype=np.int64)},
    )


def _forward(trainer, tokens: list[int], targets: list[int] | None = None) -> np.ndarray:
    """The trainer's log-prob of targets[t-1] at position t of `tokens` (default: tokens[t])."""
    out = trainer.forward([_datum(tokens, targets)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def _full_logp(reference, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference(input_ids=torch.tensor([tokens])).logits[0, :-1].float() / temperature, -1)


def _prompt(policy) -> list[int]:
    return policy.encode("Question 5: name 3 fruits. Answer:")


def test_topk_prompt_and_last_n_equal_the_trainers_forward(setup):
    _, trainer, sampler, reference, policy = setup
    prompt, k, last_n = _prompt(policy), 5, 6
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=3, seed=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=k,
        prompt_logprobs_last_n=last_n,
    ).result()
    n = len(prompt)
    assert res.prompt_logprobs[: n - last_n] == [None] * (n - last_n)
    own = _forward(trainer, prompt)  # log p(prompt[t]) for t = 1..n-1
    assert np.abs(np.array(res.prompt_logprobs[n - last_n :]) - own[n - last_n - 1 :]).max() < TOL
    topk = res.topk_prompt_logprobs
    assert topk[: n - last_n] == [None] * (n - last_n) and all(len(row) == k for row in topk[n - last_n :])
    full = _full_logp(reference, prompt)
    for j in range(k):  # column j of the top-k, scored by the trainer as targets
        ids = [row[j][0] if row else prompt[t] for t, row in enumerate(topk)][1:]
        values = _forward(trainer, prompt, ids)
        for t in range(n - last_n, n):
            assert abs(topk[t][j][1] - values[t - 1]) < TOL
    for t in range(n - last_n, n):  # they are the k most likely tokens, in order
        assert [i for i, _ in topk[t]] == full[t - 1].topk(k).indices.tolist()


def test_topk_sample_logprobs_equal_the_trainers_forward(setup):
    _, trainer, sampler, reference, policy = setup
    prompt, k = _prompt(policy), 4
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=3), topk_sample_logprobs=k
    ).result()
    for seq in res.sequences:
        full_ids = prompt + list(seq.tokens)
        rows = seq.topk_logprobs
        assert len(rows) == len(seq.tokens) and all(len(r) == k for r in rows)
        for j in range(k):
            targets = full_ids[1 : len(prompt)] + [r[j][0] for r in rows]
            values = _forward(trainer, full_ids, targets)[len(prompt) - 1 :]
            assert np.abs(np.array([r[j][1] for r in rows]) - values).max() < TOL
        full = _full_logp(reference, full_ids)[len(prompt) - 1 :]
        assert [[i for i, _ in r] for r in rows] == full.topk(k).indices.tolist()
        for token, lp, row in zip(seq.tokens, seq.logprobs, rows):  # the sampled token's own log-prob agrees
            if token in dict(row):
                assert abs(dict(row)[token] - lp) < TOL


@pytest.mark.parametrize("sparse", [False, True])
def test_target_prompt_logprobs_equal_the_trainers_forward(setup, sparse):
    _, trainer, sampler, _, policy = setup
    prompt = _prompt(policy)
    ids = torch.full((len(prompt) - 1, 2), -1, dtype=torch.int64)
    ids[3] = torch.tensor([7, 11])
    ids[-1, 0] = 42
    ids[-2, 1] = prompt[-2]
    tensor = types.TensorData.from_torch_sparse(ids, pad_value=-1) if sparse else types.TensorData.from_torch(ids)
    assert (tensor.sparse_crow_indices is not None) == sparse
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=tensor
    ).result()
    got = res.target_prompt_logprobs.to_torch()
    assert tuple(got.shape) == tuple(ids.shape)
    for j in range(2):
        expected = _forward(trainer, prompt, torch.where(ids[:, j] >= 0, ids[:, j], 0).tolist())
        for i in range(len(prompt) - 1):
            want = expected[i] if ids[i, j] >= 0 else 0.0
            assert abs(float(got[i, j]) - want) < TOL, (i, j)


def test_prompt_alt_tokens_are_draws_with_exact_logprobs(setup):
    _, trainer, sampler, reference, policy = setup
    prompt, k = _prompt(policy), 6
    prompt_input = types.ModelInput.from_ints(prompt)

    def alt(temperature: float, seed: int):
        params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
        out = sampler.sample(prompt_input, 1, params, prompt_alt_tokens_k=k).result().prompt_alt_tokens
        return out.tokens.to_torch(), out.logprobs.to_torch()

    tokens, logps = alt(1.0, 5)
    assert tuple(tokens.shape) == (len(prompt) - 1, k) and tokens.dtype == torch.int64
    for j in range(k):
        assert np.abs(logps[:, j].numpy() - _forward(trainer, prompt, tokens[:, j].tolist())).max() < TOL
    assert torch.equal(alt(1.0, 5)[0], tokens) and not torch.equal(alt(1.0, 6)[0], tokens)  # seeded draws
    warm_tokens, warm_logps = alt(0.5, 5)  # log-probs of the tempered distribution they come from
    tempered = _full_logp(reference, prompt, 0.5)
    assert torch.allclose(warm_logps, tempered.gather(-1, warm_tokens), atol=TOL)
    greedy_tokens, _ = alt(0.0, 5)
    assert torch.equal(greedy_tokens, tempered.argmax(-1, keepdim=True).expand(-1, k))
    # the draws follow the tempered distribution p: at each position the mean of p(draw) is sum p^2
    # (within 6 standard errors); draws from any other distribution miss it
    n_draws = 3000
    out = sampler.sample(
        prompt_input, 1, types.SamplingParams(max_tokens=1, temperature=0.3, seed=11), prompt_alt_tokens_k=n_draws
    ).result()
    drawn = out.prompt_alt_tokens.tokens.to_torch()  # (P-1, n_draws)
    p = _full_logp(reference, prompt, 0.3).exp()  # (P-1, V)
    mean = p.gather(-1, drawn).mean(-1)
    expect = (p**2).sum(-1)
    stderr = (((p**3).sum(-1) - expect**2) / n_draws).sqrt()
    assert torch.all((mean - expect).abs() < 6 * stderr), (mean, expect, stderr)


def test_unserved_or_bad_options_are_user_errors_naming_them(setup):
    client, _, sampler, _, policy = setup
    prompt = types.ModelInput.from_ints(_prompt(policy))
    params = types.SamplingParams(max_tokens=2)
    stable = client.create_sampling_client(base_model="tiny", record_stability_info=True).result()
    with pytest.raises(tinker.RequestFailedError, match="record_stability_info is not served"):
        stable.sample(prompt, 1, params).result()
    with pytest.raises(tinker.RequestFailedError, match="prompt_logprobs_last_n must be between 1 and"):
        sampler.sample(prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=999).result()
    wrong_rows = types.TensorData.from_torch(torch.zeros((3, 1), dtype=torch.int64))
    with pytest.raises(tinker.RequestFailedError, match="target_prompt_logprobs has 3 rows"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=wrong_rows).result()
    out_of_vocab = torch.full((prompt.length - 1, 1), -1, dtype=torch.int64)
    out_of_vocab[0, 0] = 10**6
    with pytest.raises(tinker.RequestFailedError, match="target_prompt_logprobs holds token id 1000000"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(out_of_vocab)).result()
    # the service goes on: a plain sample right after
    assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 2
