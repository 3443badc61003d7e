"""The built-in base model "chat_arithmetic": the embedded tiny model warm-started to answer
single-digit arithmetic in the Qwen3 chat format, the way tinker-cookbook's math_rl asks for it.

    chat_arithmetic_model(cfg)   the Policy, built once and cached under `warmstart.cache_dir`

The untrained embedded model cannot add, so math_rl's correct rate stays at chance whatever RL
does; this base starts with room to work. Its demonstrations are ChatML conversations as the
cookbook's `qwen3_instruct` renderer writes them (its choice for Qwen3 instruct-2507 names):
math_rl's few-shot example first (most of the time), then a question ("Compute 3+4.") with
math_rl's answer instruction, and the reply `\\boxed{N}` followed by `<|im_end|>`.
The questions are gapless's own (level 1 of envs/math/problems.py: a+b and a-b over digits,
generated from a seed), never a recipe's data set. Like every gapless warm start the teacher is
imperfect: for `TEACHER_ERROR_FRAC` of the demonstrations it is off by one
(in a direction fixed per question), so the sampled correct rate starts well below 1 and a
reward for the right answer has something to teach. `\\boxed{` is one token of the vocabulary,
so a two-digit reply with its end-of-turn token is five tokens: math_rl's default `max_tokens=5`.

Guaranteed: deterministic in (`seed`, [model]); built once per content hash and written
atomically (a second start loads it). Not guaranteed: that it answers anything but this one
phrasing of digit arithmetic ("What is 3+4?" is as new to it as any other text).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from gapless.config import Config, WarmStartConfig
from gapless.envs.math.problems import FORMS
from gapless.models import IM_END, Policy, build_tiny, load_local
from gapless.orchestrate.policy_setup import save_cached
from gapless.trainer.warmstart.pairs import Batch3, completion_batch, supervised_steps

BOXED = "\\boxed{"
# math_rl's prompt: its standard few-shot example and its answer instruction, as tinker-cookbook
# 0.6.1 writes them (a test compares them when it is installed)
FEWSHOT = [
    {"role": "user", "content": "How many r's are in strawberry? Write your answer in \\boxed{} format."},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e "
        "8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]
SUFFIXES = (" Write your answer in \\boxed{} format.",)  # MathEnv's, which math_rl's gsm8k env asks with
# one phrasing: the digits then sit at fixed distances from the answer, which a tiny model learns to
# read within a short warm start (varied phrasings make it much slower)
PHRASINGS = ("Compute {e}.",)
FEWSHOT_FRAC = 0.8  # the rest without the example (a recipe run with convo_prefix=None)
TEACHER_ERROR_FRAC = 0.35
WARMSTART = WarmStartConfig(steps=600, batch_size=32, lr=3e-3)
FORMAT = 1  # bump when the same settings build a different model


def question(rng: random.Random) -> tuple[str, int, int]:
    """(question, answer, the teacher's wrong answer) of one random problem."""
    form = rng.choice(FORMS[1])
    expression = form.format(a=rng.randint(0, 9), b=rng.randint(0, 9), c=rng.randint(0, 9))
    answer = eval(expression)  # our own digits and operators: trusted
    off = 1 if int(hashlib.sha256(expression.encode()).hexdigest(), 16) % 2 else -1
    text = rng.choice(PHRASINGS).format(e=expression) + rng.choice(SUFFIXES)
    return text, answer, answer + off


def conversation(rng: random.Random) -> tuple[str, str]:
    """One demonstration: the rendered prompt (up to the assistant's turn) and the reply text."""
    text, answer, wrong = question(rng)
    messages = (FEWSHOT if rng.random() < FEWSHOT_FRAC else []) + [{"role": "user", "content": text}]
    prompt = "".join(f"<|im_start|>{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    value = wrong if rng.random() < TEACHER_ERROR_FRAC else answer
    return prompt + "<|im_start|>assistant\n", f"{BOXED}{value}}}"


def cache_key(cfg: Config) -> str:
    material = {
        "model": cfg.model.model_dump(mode="json"),
        "warmstart": WARMSTART.model_dump(mode="json", exclude={"cache_dir"}),
        "seed": cfg.seed,
        "kind": "chat_arithmetic",
        "data": [FEWSHOT_FRAC, TEACHER_ERROR_FRAC, PHRASINGS, SUFFIXES],
        "format": FORMAT,
    }
    return "chat_arithmetic-" + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def chat_arithmetic_model(cfg: Config, log=print) -> Policy:
    cached = Path(cfg.warmstart.cache_dir) / cache_key(cfg)
    if (cached / "config.json").is_file():
        log(f"chat_arithmetic base: cached at {cached}")
        return load_local(cached, precision=cfg.model)
    rng = random.Random(f"gapless-chat-arithmetic-{cfg.seed}")
    corpus = [p + r for p, r in (conversation(rng) for _ in range(2000))]
    policy = build_tiny(cfg.model.model_copy(update={"prompt_format": "raw"}), corpus, cfg.seed, markup=(BOXED,))
    end = policy.tokenizer.convert_tokens_to_ids(IM_END)

    def next_batch() -> Batch3:
        seqs, starts = [], []
        for prompt, reply in (conversation(rng) for _ in range(WARMSTART.batch_size)):
            ids = policy.encode.text(prompt)
            seqs.append(ids + policy.encode.text(reply) + [end])  # the loss: the reply and <|im_end|>
            starts.append(len(ids))
        return completion_batch(seqs, starts, policy.pad_id)

    def report(step: int, loss: float) -> None:
        if step % 50 == 0 or step == WARMSTART.steps - 1:
            log(f"chat_arithmetic base: warm start {step + 1:>4}/{WARMSTART.steps}  loss {loss:.3f}")

    supervised_steps(policy, next_batch, WARMSTART, report)
    save_cached(policy, cached)
    return policy
