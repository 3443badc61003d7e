"""The transcript warm start trains on exactly the token sequences the tool environment builds
during rollouts (segments tokenized one by one, model turns ending at EOS), loss on model turns
only; and the imperfect teacher is imperfect in the documented proportions."""

import random

from gapless.envs.episode import Episode
from gapless.envs.tools.tasks import ToolTask, demonstration, generate_tool_tasks, parse_turn
from gapless.trainer.warmstart.transcripts import transcript_batch
from gapless.types import Completion

TASK = ToolTask("t", "Q: 12*34\n", "12*34", "408")


def test_batch_matches_the_episode_token_record(tiny_policy):
    segments = [("<py>12*34</py>", True), ("<out>408</out>\n", False), ("Answer: 408", True)]
    ids, attn, mask = transcript_batch(tiny_policy, [(TASK.prompt, segments), (TASK.prompt, segments[-1:])])
    episode = Episode(TASK, tiny_policy.encode(TASK.prompt))
    for text, is_model in segments:
        piece = tiny_policy.encode(text)
        if is_model:
            piece = piece + [tiny_policy.eos_id]
            episode.add_model_turn(Completion([], piece, [0.0] * len(piece), [0] * len(piece), "stop", text))
        else:
            episode.add_environment_text(text, piece)
    full = episode.context
    assert ids[0, : len(full)].tolist() == full and int(attn[0].sum()) == len(full)
    n_prompt = len(episode.prompt_ids)
    assert mask[0, n_prompt - 1 : len(full) - 1].tolist() == episode.loss_mask  # position t predicts t + 1
    assert mask[0, : n_prompt - 1].sum() == 0 and mask[0, len(full) - 1 :].sum() == 0


def test_teacher_mix():
    rng = random.Random(0)
    tasks = generate_tool_tasks(0, "train", 50)
    kinds = {"right": 0, "skip": 0, "typo": 0}
    for i in range(2000):
        task = tasks[i % 50]
        segments = demonstration(task, rng, skip_frac=0.3, typo_frac=0.2)
        final = parse_turn(segments[-1][0])
        assert final.kind == "answer"
        if len(segments) == 1:
            assert final.content != task.answer
            kinds["skip"] += 1
        else:
            call = parse_turn(segments[0][0])
            assert call.kind == "call" and final.content == str(eval(call.content))
            kinds["right" if call.content == task.expression else "typo"] += 1
    assert abs(kinds["skip"] / 2000 - 0.3) < 0.04 and abs(kinds["typo"] / 2000 - 0.2) < 0.04


def test_splits_are_disjoint_and_deterministic():
    train, again = generate_tool_tasks(3, "train", 300), generate_tool_tasks(3, "train", 300)
    evals = generate_tool_tasks(3, "eval", 100)
    assert train == again and not {t.expression for t in train} & {t.expression for t in evals}
    assert all(str(eval(t.expression)) == t.answer for t in train + evals)
