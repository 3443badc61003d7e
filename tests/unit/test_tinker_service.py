"""`gapless serve-training` driven by the real `tinker` SDK (pinned 0.38.0) against a real uvicorn
server on a loopback port, over a tiny local checkpoint: supervised loss goes down, sampled
log-probs equal the trainer's, two clients training at once equal each alone, bad input and a
wrong key get the SDK's error types, and the built-in losses equal a hand computation (also
through the SDK, on the trainer's own log-probs)."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest
import tinker
import torch
from tinker import types
from tinker_service import KEY, served

from gapless.service.losses import LossInputError, cispo, cross_entropy, dro, gspo, importance_sampling, ppo


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker")
    with served(root, max_batch="16") as (server, policy):
        yield server, policy


@pytest.fixture(scope="module")
def client(service):
    with tinker.ServiceClient(base_url=service[0].base_url, api_key=KEY) as c:
        yield c


def _datum(tokens: list[int]) -> types.Datum:
    """Next-token prediction on `tokens`, every target weighted 1."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


def _data(policy, n: int = 4) -> list[types.Datum]:
    return [_datum(policy.encode(f"Question {i}: name {i % 7} fruits. Answer: apple, red, cat.")) for i in range(n)]


ADAM = types.AdamParams(learning_rate=1e-2)


def test_sft_lowers_loss_and_sampler_logprobs_equal_trainer(service, client):
    _, policy = service
    trainer = client.create_lora_training_client(base_model="tiny", rank=4).result()
    assert trainer.get_info().model_data.model_name == "tiny"
    text = "Question 12: name 3 fruits."
    assert trainer.get_tokenizer().encode(text, add_special_tokens=False) == policy.encode(text)  # the SDK's own loader
    data = _data(policy)
    losses = []
    for _ in range(6):
        out = trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(ADAM).result()
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses
    # the weights trained so far, visible to a sampler without a restart
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = policy.encode("Question 3: name")
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=12, temperature=1.0, seed=5),
    ).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        full = prompt + list(seq.tokens)
        fwd = trainer.forward([_datum(full)], "cross_entropy").result()
        trainer_lp = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        assert np.abs(np.array(seq.logprobs) - trainer_lp).max() < 1e-5
    # compute_logprobs: the prompt's own log-probs under the same weights
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert scored[0] is None
    fwd = trainer.forward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(np.array(scored[1:]) - fwd).max() < 1e-5


def test_two_clients_at_once_equal_each_alone(service, client):
    _, policy = service
    data_a, data_b = _data(policy, 3), _data(policy, 5)[2:]

    def losses(trainer, data, steps=3):
        out = []
        for _ in range(steps):
            out.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            trainer.optim_step(ADAM).result()
        return out

    alone_a = losses(client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result(), data_a)
    alone_b = losses(client.create_lora_training_client(base_model="tiny", rank=2, seed=2).result(), data_b)
    a = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    b = client.create_lora_training_client(base_model="tiny", rank=2, seed=2).result()
    together_a, together_b = [], []
    for _ in range(3):  # both clients' calls in flight at the same time, interleaved on the service
        fa, fb = a.forward_backward(data_a, "cross_entropy"), b.forward_backward(data_b, "cross_entropy")
        oa, ob = a.optim_step(ADAM), b.optim_step(ADAM)
        together_a.append(fa.result().metrics["loss:sum"])
        together_b.append(fb.result().metrics["loss:sum"])
        oa.result(), ob.result()
    assert together_a == alone_a and together_b == alone_b
    runs = service[0].app.runs
    assert runs[a.model_id].model is runs[b.model_id].model  # two adapters on one shared copy of the base
    assert runs[a.model_id].adapter != runs[b.model_id].adapter


def test_bad_input_gets_sdk_errors_and_service_stays_healthy(service, client):
    server, policy = service
    with pytest.raises(tinker.RequestFailedError, match="unknown base model 'nope'"):
        client.create_lora_training_client(base_model="nope", rank=2).result()
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    vocab = policy.model.config.vocab_size
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        trainer.forward_backward([_datum([1, 2, vocab + 5])], "cross_entropy").result()
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3], dtype=np.int64)},
    )
    with pytest.raises(tinker.RequestFailedError, match="target_tokens has shape"):
        trainer.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="not served here .*has not published"):
        trainer.forward_backward([_datum([1, 2, 3])], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_config=.*beta"):
        trainer.forward_backward([_datum([1, 2, 3])], "dro").result()
    # the run is untouched by the failures and goes on
    assert trainer.forward_backward([_datum([1, 2, 3])], "cross_entropy").result().metrics["loss:sum"] > 0
    with tinker.ServiceClient(base_url=server.base_url, api_key="tml-wrong") as wrong:
        with pytest.raises(tinker.AuthenticationError):
            wrong.create_lora_training_client(base_model="tiny", rank=2).result()


def test_save_and_load_state_round_trip(service, client):
    _, policy = service
    data = _data(policy, 2)
    trainer = client.create_lora_training_client(base_model="tiny", rank=2).result()
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    path = trainer.save_state("one").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/one")
    before = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    assert trainer.forward(data, "cross_entropy").result().metrics["loss:sum"] != before
    trainer.load_state(path).result()
    assert trainer.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, abs=1e-6)
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, abs=1e-6)


def test_losses_equal_hand_computation():
    # two target tokens with log-probs log(0.5) and log(0.25); the sampler gave them log(0.25), log(0.5)
    lp = torch.tensor([math.log(0.5), math.log(0.25)])
    q = torch.tensor([math.log(0.25), math.log(0.5)])  # ratios r = 2 and 0.5
    adv = torch.tensor([1.0, -1.0])
    inputs = {"logprobs": q, "advantages": adv, "weights": torch.tensor([1.0, 0.5])}
    # cross entropy: -(1 * log .5 + .5 * log .25) = log 2 + log 2 = 2 log 2
    assert float(cross_entropy(lp, inputs, {})) == pytest.approx(2 * math.log(2))
    # importance sampling: -(2 * 1 + 0.5 * -1) = -1.5
    assert float(importance_sampling(lp, inputs, {})) == pytest.approx(-1.5)
    # ppo, clip [0.8, 1.2]: token 1 min(2, 1.2) * 1 = 1.2; token 2 min(-0.5, -0.8) = -0.8 -> -(1.2 - 0.8) = -0.4
    assert float(ppo(lp, inputs, {})) == pytest.approx(-0.4)
    # cispo: -(1.2 * log .5 * 1 + 0.8 * log .25 * -1) = 1.2 log 2 - 1.6 log 2 = -0.4 log 2
    assert float(cispo(lp, inputs, {})) == pytest.approx(-0.4 * math.log(2))
    # cispo's gradient flows through log p only, scaled by the detached clipped ratio: d/dlp = -(1.2, -0.8)
    lp_g = lp.clone().requires_grad_(True)
    cispo(lp_g, inputs, {}).backward()
    assert lp_g.grad.tolist() == pytest.approx([-1.2, 0.8])


def test_dro_and_gspo_equal_hand_computation():
    lp = torch.tensor([math.log(0.5), math.log(0.25)])
    q = torch.tensor([math.log(0.25), math.log(0.5)])  # log-ratios +log 2, -log 2
    adv = torch.tensor([1.0, -1.0])
    inputs = {"logprobs": q, "advantages": adv}
    # dro, beta 0.5: -(log .5 * 1 - .25 (log 2)^2 + log .25 * -1 - .25 (log 2)^2) = -log 2 + 0.5 (log 2)^2
    L2 = math.log(2)
    assert float(dro(lp, inputs, {"beta": 0.5})) == pytest.approx(-L2 + 0.5 * L2**2)
    # its gradient: -(A_t - beta (logp_t - log q_t)) = -(1 - .5 log 2, -1 + .5 log 2)
    lp_g = lp.clone().requires_grad_(True)
    dro(lp_g, inputs, {"beta": 0.5}).backward()
    assert lp_g.grad.tolist() == pytest.approx([-(1 - 0.5 * L2), 1 - 0.5 * L2])
    with pytest.raises(LossInputError, match="beta"):
        dro(lp, inputs, {})
    # gspo over both tokens: s = exp(mean(log 2, -log 2)) = 1, inside [0.8, 1.2], so the loss is
    # -(1 * 1 + 1 * -1) = 0 and each token's gradient is -s * A_t = (-1, 1)
    both = dict(inputs, sequence_ratio_mask=torch.tensor([1.0, 1.0]))
    lp_g = lp.clone().requires_grad_(True)
    loss = gspo(lp_g, both, {})
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    assert lp_g.grad.tolist() == pytest.approx([-1.0, 1.0])
    # ratio over the first token only: s = 2 at both tokens (clip 1.2). Token 1 (A = 1): min(2, 1.2) = 1.2,
    # the clipped branch, no gradient; token 2 (A = -1): min(-2, -1.2) = -2, the unclipped one,
    # gradient -s * A = 2. Loss -(1.2 - 2) = 0.8. A token outside the mask still carries s.
    first = dict(inputs, sequence_ratio_mask=torch.tensor([1.0, 0.0]))
    lp_g = lp.clone().requires_grad_(True)
    loss = gspo(lp_g, first, {})
    loss.backward()
    assert loss.item() == pytest.approx(0.8)
    assert lp_g.grad.tolist() == pytest.approx([0.0, 2.0])
    # with sequence ratio 1 and constant advantages, gspo equals ppo on on-policy tokens
    on_policy = {"logprobs": lp, "advantages": adv, "sequence_ratio_mask": torch.ones(2)}
    assert float(gspo(lp, on_policy, {})) == pytest.approx(float(ppo(lp, on_policy, {})))
    with pytest.raises(LossInputError, match="sequence_ratio_mask"):
        gspo(lp, inputs, {})
    with pytest.raises(LossInputError, match="marks no token"):
        gspo(lp, dict(inputs, sequence_ratio_mask=torch.zeros(2)), {})


def test_sdk_dro_and_gspo_equal_the_formula_on_the_trainers_logprobs(client):
    """Through the SDK: loss:sum of dro (beta via loss_fn_config) and gspo (sequence_ratio_mask over
    the completion) equals the formula applied to the log-probs that `forward` returns."""
    trainer = client.create_lora_training_client(base_model="tiny", rank=2, seed=3).result()
    tokens = [5, 9, 14, 3, 22, 7, 11]
    base = _datum(tokens)
    logp = torch.tensor(trainer.forward([base], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    n = len(logp)
    sampled = logp + torch.linspace(-0.3, 0.3, n)  # a sampler that disagrees a little
    adv = torch.tensor([0.0, 0.0] + [1.0] * (n - 2))
    mask = torch.tensor([0.0, 0.0] + [1.0] * (n - 2))
    inputs = {
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "logprobs": sampled.numpy(),
        "advantages": adv.numpy(),
    }
    dro_out = trainer.forward(
        [types.Datum(model_input=base.model_input, loss_fn_inputs=inputs)], "dro", loss_fn_config={"beta": 0.1}
    ).result()
    expect = float(dro(logp, {"logprobs": sampled, "advantages": adv}, {"beta": 0.1}))
    assert dro_out.metrics["loss:sum"] == pytest.approx(expect, rel=1e-4, abs=1e-5)
    gspo_in = dict(inputs, sequence_ratio_mask=mask.numpy())
    gspo_out = trainer.forward_backward(
        [types.Datum(model_input=base.model_input, loss_fn_inputs=gspo_in)], "gspo"
    ).result()
    expect = float(gspo(logp, {"logprobs": sampled, "advantages": adv, "sequence_ratio_mask": mask}, {}))
    assert gspo_out.metrics["loss:sum"] == pytest.approx(expect, rel=1e-4, abs=1e-5)


def _idle(app, timeout_s: float = 30.0) -> bool:
    """Wait (bounded) until no sampling engine of the service holds anything."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(s.num_handles == 0 and s.samples_in_flight == 0 for s in app.pool.schedulers):
            return True
        time.sleep(0.02)
    return False


def test_stops_and_a_client_that_disconnects_mid_request(service, client):
    import httpx

    server, policy = service
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(policy.encode("Question 3: name"))
    free = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=20, seed=1, stop=[])).result()
    assert [len(s.tokens) for s in free.sequences] == [20, 20] and {s.stop_reason for s in free.sequences} == {"length"}
    stop_id = free.sequences[0].tokens[3]  # a token the first sample draws at position 3: stopping on it ends it there
    stopped = (
        sampler.sample(prompt, 2, types.SamplingParams(max_tokens=20, seed=1, stop=[stop_id])).result().sequences[0]
    )
    assert stopped.stop_reason == "stop" and list(stopped.tokens) == list(
        free.sequences[0].tokens[: stopped.tokens.index(stop_id) + 1]
    )
    # raw HTTP: ask for a long sample, then give up on its result mid-poll and on the connection
    headers = {"X-API-Key": KEY}
    # 256 samples of 100 tokens: 100 decode steps of 64 rows and a queue behind them, far longer than
    # the 50 ms poll on any machine (a short request could finish within the poll on a fast one)
    body = {
        "sampling_session_id": None,
        "base_model": "tiny",
        "num_samples": 256,
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt.to_ints()}]},
        "sampling_params": {"max_tokens": 100, "stop": []},
    }
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as http:
        future = http.post("/api/v1/asample", json=body).json()
        assert len(future["sample_sequence_ids"]) == 256
        with pytest.raises(httpx.TimeoutException):
            http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}, timeout=0.05)
    assert _idle(server.app)  # the abandoned samples finished and left nothing behind
    again = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, seed=1, stop=[])).result()
    assert len(again.sequences[0].tokens) == 5  # and the service goes on serving


def test_cli_needs_an_api_key(monkeypatch, capsys):
    from gapless.cli import main

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    assert main(["serve-training", "--port", "0"]) == 2
    assert "TINKER_API_KEY" in capsys.readouterr().err


def test_full_fine_tuning_run_learns(service):
    """lora_config absent (a raw create_model; the SDK 0.38 creates LoRA clients only): every weight trains."""
    from gapless.service.models import AdamParams, BaseModel, TrainingRun
    from gapless.service.wire import DatumIn

    _, policy = service
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    run = TrainingRun("full", BaseModel("tiny", policy, "", context=256), spec=None)
    tokens = policy.encode("Question 1: name 1 fruits. Answer: apple.")
    datum = DatumIn(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:])})
    losses = []
    for _ in range(4):
        losses.append(run.forward_backward([datum], "cross_entropy", {}, forward_only=False)[1]["loss:sum"])
        run.optim_step(AdamParams(learning_rate=1e-2))
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.requires_grad for p in run.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())  # the base is untouched


def test_sdk_sample_request_translation():
    from gapless.service.models import UserError
    from gapless.service.params import scheduler_request

    def request(**params):
        return types.SampleRequest(
            num_samples=2, prompt=types.ModelInput.from_ints([3, 4]), sampling_params=types.SamplingParams(**params)
        )

    greedy = scheduler_request(request(temperature=0, max_tokens=5, stop=[7, 8]), 10, 64, 256)
    assert greedy.params.greedy and greedy.params.stop_token_ids == (7, 8) and greedy.params.ignore_eos
    strings = scheduler_request(request(stop=["\n\n"], top_k=-1), 10, 64, 256)
    assert strings.stop == ("\n\n",) and not strings.params.ignore_eos and strings.params.top_k == 0
    assert strings.params.max_new_tokens == 62  # no max_tokens: the rest of the 64-token context
    assert (
        scheduler_request(request(), 10, 64, 256).params.seed != scheduler_request(request(), 10, 64, 256).params.seed
    )
    assert scheduler_request(request(seed=3), 10, 64, 256).params.seed == 3
    with pytest.raises(UserError, match="stop token id 12 is outside the vocabulary"):
        scheduler_request(request(stop=[12]), 10, 64, 256)


def test_sampler_snapshots_are_bounded(service, tmp_path):
    from gapless.service.models import BaseModels, UserError
    from gapless.service.samplers import SamplerPool

    _, policy = service
    pool = SamplerPool(BaseModels({}, builtin=lambda: policy, tokenizer_root=tmp_path), max_snapshots=2)
    state = policy.model.state_dict()
    for name in ("a", "b", "c"):  # an RL loop saving a snapshot per step
        pool.register(f"tinker://run/sampler_weights/{name}", "gapless-tiny", state)
    assert pool.base_of("tinker://run/sampler_weights/c").name == "gapless-tiny"
    with pytest.raises(UserError, match="were dropped"):
        pool.base_of("tinker://run/sampler_weights/a")
    with pytest.raises(UserError, match="save them first"):
        pool.base_of("tinker://run/sampler_weights/never")


def test_full_sampler_is_backpressure_the_sdk_retries(service, client):
    import httpx

    server, policy = service
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(policy.encode("Question 5: name"))
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0)).result()  # the engine exists
    scheduler = server.app.pool._engines["tiny"]
    limit, rejected = scheduler.max_samples, scheduler.stats.rejected
    scheduler.max_samples = 4
    try:
        body = {
            "base_model": "tiny",
            "num_samples": 4,
            "seq_id": 0,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt.to_ints()}]},
            "sampling_params": {"max_tokens": 100, "stop": []},
        }
        with httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY}, timeout=30) as http:
            assert http.post("/api/v1/asample", json=body).status_code == 200  # fills the scheduler
            out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, seed=0, stop=[])).result()
        assert len(out.sequences[0].tokens) == 3  # answered 429 at first, then served after the SDK's backoff
        assert scheduler.stats.rejected > rejected
    finally:
        scheduler.max_samples = limit


def test_micro_batching_leaves_loss_and_gradient_unchanged(service):
    from gapless.lora import LoraSpec
    from gapless.service.models import BaseModel, TrainingRun, micro_batches
    from gapless.service.wire import DatumIn

    # lengths 3, 5, 2, 4 within 10 padded tokens: [3, 5] pads to 10, then [2, 4] pads to 8
    assert micro_batches([3, 5, 2, 4], 10) == [(0, 2), (2, 4)]
    assert micro_batches([12, 1], 10) == [(0, 1), (1, 2)]  # a long datum alone
    _, policy = service
    texts = [f"Question {i}: name {i} fruits." * (1 + i % 3) for i in range(5)]
    datums = [
        DatumIn(
            t[:-1],
            {
                "target_tokens": torch.tensor(t[1:]),
                "advantages": torch.full((len(t) - 1,), 0.5 - i / 4),
                "logprobs": torch.full((len(t) - 1,), -3.0),
            },
        )
        for i, t in enumerate(policy.encode(x) for x in texts)
    ]
    results = []
    for budget in (1 << 20, 16):  # one forward for all; one per datum or two
        run = TrainingRun(
            "m", BaseModel("tiny", policy, "", context=256), LoraSpec(rank=2, seed=0), micro_batch_tokens=budget
        )
        for name, p in run.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        logprobs, metrics = run.forward_backward(datums, "ppo", {}, forward_only=False)
        results.append((metrics["loss:sum"], [p.grad.clone() for p in run.params], logprobs))
    (loss_a, grads_a, lp_a), (loss_b, grads_b, lp_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    # other padded widths round the forward differently: gradients of magnitude ~3 move by ~2e-5
    # (transformers 5.25); a wrong normaliser would move them by factors
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads_a, grads_b))
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(lp_a, lp_b))


def test_openai_and_tinker_requests_share_engine_steps(service, client):
    """The OpenAI routes (/v1, bearer key) serve the base model on the scheduler Tinker samples use."""
    server, policy = service
    oa = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = policy.encode("Question 4: name")
    scheduler = server.app.openai.scheduler
    assert scheduler is server.app.pool.scheduler_for("tiny")
    mixed = frozenset({"http", "tinker"})
    for _ in range(5):  # both long enough to overlap; a few tries make a miss on a loaded box negligible
        future = sampler.sample(
            types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=60, seed=2, stop=[])
        )
        out = oa.completions.create(
            model="tiny", prompt=prompt, max_tokens=60, n=2, seed=2, extra_body={"ignore_eos": True}
        )
        assert len(future.result().sequences) == 4 and len(out.choices) == 2
        if scheduler.stats.batch_sources[mixed] > 0:
            break
    assert scheduler.stats.batch_sources[mixed] > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()
