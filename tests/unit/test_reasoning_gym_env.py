"""reasoning-gym adapter: real data sets, their own extraction and scorers, statuses by table, hostile
output, and agreement with reasoning-gym's own pipeline on generated cases."""

import random

import pytest
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from gapless.envs.reasoning_gym.environment import ReasoningGymEnvironment
from gapless.types import Completion

DATASETS = ["basic_arithmetic", "leg_counting", "spell_backward"]
AGREEMENT_DATASETS = [
    "mini_sudoku",
    "basic_arithmetic",
    "leg_counting",
    "spell_backward",
    "chain_sum",
    "word_sorting",
    "number_sorting",
    "propositional_logic",
    "letter_counting",
    "simple_equations",
]


@pytest.fixture(scope="module", params=DATASETS)
def env(request):
    return ReasoningGymEnvironment(request.param, seed=0, num_train=20, num_eval=10)


def _answer(env):
    return str(env.tasks("train")[0].entry["answer"])


@pytest.mark.parametrize(
    "make_text, status, reward",
    [
        (lambda a: f"<answer>{a}</answer>", "ok", 1.0),
        (lambda a: f"<think>easy</think>\n<answer> {a}\n</answer> done", "ok", 1.0),
        (lambda a: f"<answer>0</answer> no wait <answer>{a}</answer>", "ok", 1.0),  # the last answer counts
        (lambda a: "<answer>#%&</answer>", "wrong_answer", 0.0),
        (lambda a: a, "no_answer", 0.0),  # a bare answer is not in the data set's format
        (lambda a: f"Answer: {a}", "no_answer", 0.0),
        (lambda a: f"\\boxed{{{a}}}", "no_answer", 0.0),
        (lambda a: "", "no_answer", 0.0),
        (lambda a: f"<answer>{a}", "no_answer", 0.0),  # unclosed tag
        (lambda a: "<answer>" + "9" * 10_000 + "</answer>", "wrong_answer", 0.0),
        (lambda a: "<answer>é中😀\x00</answer>", "wrong_answer", 0.0),
        (lambda a: "</answer>" + "<answer>" * 20_000, "no_answer", 0.0),  # hostile tail of unclosed tags: linear
    ],
)
def test_statuses_and_rewards(env, make_text, status, reward):
    task = env.tasks("train")[0]
    assert env.score(task, make_text(_answer(env))) == (reward, status)


def test_prompts_use_the_data_sets_own_answer_format(env):
    task = env.tasks("train")[0]
    assert task.prompt.startswith(SYSTEM_PROMPTS["default"].rstrip()) and "<answer>answer here</answer>" in task.prompt
    assert task.prompt.endswith(task.entry["question"].rstrip() + "\n")


def test_multi_line_answers_are_kept_whole_and_a_trailing_period_is_the_scorers_business():
    env = ReasoningGymEnvironment("mini_sudoku", seed=0, num_train=3, num_eval=1)
    task = env.tasks("train")[0]
    grid = task.entry["answer"]
    assert "\n" in grid
    assert env.score(task, f"<think>rows then columns</think>\n<answer>\n{grid}\n</answer>") == (1.0, "ok")
    first_row_only = env.score(task, f"<answer>{grid.splitlines()[0]}</answer>")
    assert first_row_only[1] != "ok"
    arithmetic = ReasoningGymEnvironment("basic_arithmetic", seed=0, num_train=3, num_eval=1)
    sum_task = arithmetic.tasks("train")[0]
    dotted = f"<answer>{sum_task.entry['answer']}.</answer>"
    assert arithmetic.score(sum_task, dotted)[0] == arithmetic.dataset.score_answer(
        f"{sum_task.entry['answer']}.", sum_task.entry
    )


def test_splits_are_disjoint_and_groups_keep_order(env):
    train, evalset = env.tasks("train"), env.tasks("eval")
    assert len(train) == 20 and 0 < len(evalset) <= 10
    assert not {t.prompt for t in train} & {t.prompt for t in evalset}
    task = train[1]
    right = f"<answer>{task.entry['answer']}</answer>"
    texts = [right, "<answer>nope</answer>", right]
    (group,) = env.score_groups([task], [[Completion([], [], [], [], "stop", t) for t in texts]])
    assert [r.status for r in group] == ["ok", "wrong_answer", "ok"] and group[0].prompt_uid == task.uid


def test_a_crashing_scorer_is_a_status(env, monkeypatch):
    def broken(answer, entry):
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(env.dataset, "score_answer", broken)
    assert env.score(env.tasks("train")[0], "<answer>1</answer>") == (0.0, "score_error")


def test_partial_credit_is_its_own_status():
    env = ReasoningGymEnvironment("spell_backward", seed=0, num_train=5, num_eval=2)
    task = env.tasks("train")[0]
    reward, status = env.score(
        task, f"<answer>{task.entry['answer'][:-1]}#</answer>"
    )  # the data set credits matching letters
    assert status == "partial" and 0.0 < reward < 1.0


def generated_completions(answer: str, other: str, rng: random.Random) -> list[str]:
    """Correct, wrong, malformed, multi-line, tagged, huge and adversarial completions of one entry."""
    noise = "".join(rng.choice("abc xyz 0123456789.,;\n") for _ in range(rng.randint(0, 60)))
    lines = answer.splitlines() or [""]
    return [
        f"<answer>{answer}</answer>",
        f"<think>{noise}</think>\n<answer>{answer}</answer>",
        f"{noise}<answer>\n{answer}\n</answer>{noise}",
        f"<answer>  {answer}  </answer>",
        f"<answer>{answer}.</answer>",  # a trailing period: the scorer decides
        f"<answer>{answer}</answer>.",
        f"<answer>{lines[0]}</answer>",  # first line of a multi-line answer only
        f"<answer>{answer.lower()}</answer>",
        f"<answer>{answer.replace(' ', '')}</answer>",
        f"<answer>{other}</answer>",
        f"<answer>{answer}</answer> no, <answer>{other}</answer>",
        f"<answer>{other}</answer> no, <answer>{answer}</answer>",
        f"<answer><answer>{answer}</answer></answer>",
        f"<ANSWER>{answer}</ANSWER>",
        f"<answer>{answer}",
        f"{answer}</answer>",
        answer,
        f"Answer: {answer}",
        f"\\boxed{{{answer}}}",
        "",
        "<answer></answer>",
        f"<answer>{answer} because {noise}</answer>",
        "x" * 20_000 + f"<answer>{answer}</answer>",  # huge
        f"<answer>{answer * 50}</answer>",
        "<answer>é中😀\x00\\}}{{</answer>",
        "</answer>" + "<answer>" * 500 + answer,
    ]


def test_agreement_with_reasoning_gyms_own_pipeline():
    """Every generated case scored by gapless and by reasoning-gym's own `extract_answer` +
    `score_answer` (on the whole completion): the rewards must agree on >= 99% (measured: 100%)."""
    rng = random.Random(21)
    cases = agree = 0
    disagreements = []
    for name in AGREEMENT_DATASETS:
        env = ReasoningGymEnvironment(name, seed=rng.randrange(1000), num_train=3, num_eval=1)
        tasks = env.tasks("train")
        for i, task in enumerate(tasks):
            answer, other = str(task.entry["answer"]), str(tasks[(i + 1) % len(tasks)].entry["answer"])
            for text in generated_completions(answer, other, rng):
                try:
                    peer = float(env.dataset.score_answer(extract_answer(text), task.entry))
                except Exception:  # noqa: BLE001 -- the peer's crash reads as no reward
                    peer = 0.0
                ours, _ = env.score(task, text)
                cases += 1
                if abs(ours - peer) < 1e-9:
                    agree += 1
                else:
                    disagreements.append((name, text[:80], ours, peer))
    assert cases >= 700
    assert agree / cases >= 0.99, disagreements[:10]
