"""Incremental detokenization against decoding the whole list: random token streams of a byte-level
BPE tokenizer (multi-byte characters split over tokens included), and stop strings."""

from __future__ import annotations

import random

import pytest
from serve_model import tiny_policy

from gapless.serve.detokenize import SampleText


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


def _feed(text: SampleText, tokens: list[int]) -> str:
    return "".join(text.add(tokens[: i + 1])[0] for i in range(len(tokens))) + text.rest()


def test_pieces_join_to_the_whole_decode(policy):
    rng = random.Random(0)
    vocab = len(policy.tokenizer)
    samples = [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 80))] for _ in range(40)]
    samples += [policy.encode("héllo wörld, naïve café — ok ✓ " * 3)]  # multi-byte characters
    for tokens in samples:
        text = SampleText(policy.decode)
        assert _feed(text, tokens) == text.final() == policy.decode(tokens)


def test_stop_strings_cut_the_text_and_are_never_streamed(policy):
    tokens = policy.encode("Answer: apple, red, cat. Question 2: name")
    for stop in ["cat", "Question", "t. Q", "n 2:"]:
        text = SampleText(policy.decode, [stop, "never"])
        pieces = []
        for i in range(len(tokens)):
            piece, stopped = text.add(tokens[: i + 1])
            pieces.append(piece)
            assert stop not in "".join(pieces)
            if stopped:
                break
        whole = policy.decode(tokens)
        assert stopped and "".join(pieces) + text.rest() == text.final() == whole[: whole.find(stop)]
        assert stop in policy.decode(tokens[: i + 1]) and stop not in policy.decode(tokens[:i])
