"""envs/swe/patches.py: unified diffs made and applied over trees (creation, deletion, offsets,
no newline at the end), and refused where they do not apply or leave the repository."""

from __future__ import annotations

import pytest

from gapless.envs.swe.patches import PatchError, apply_patch, make_patch, parse_patch

BEFORE = {"a.py": "one\ntwo\nthree\nfour\nfive\nsix\nseven\n", "gone.py": "x = 1\n", "tail.py": "no newline"}
AFTER = {"a.py": "one\nTWO\nthree\nfour\nfive\nsix\nseven\neight\n", "new/b.py": "print(1)\n", "tail.py": "no newline!"}


def test_make_then_apply_round_trips():
    patch = make_patch(BEFORE, AFTER)
    assert apply_patch(BEFORE, patch) == AFTER
    assert {p.path for p in parse_patch(patch)} == {"a.py", "gone.py", "new/b.py", "tail.py"}
    assert make_patch(BEFORE, BEFORE) == ""


def test_a_hunk_applies_at_an_offset():
    patch = make_patch({"a.py": BEFORE["a.py"]}, {"a.py": BEFORE["a.py"].replace("six", "SIX")})
    shifted = {"a.py": "zero\nzero\n" + BEFORE["a.py"]}
    assert apply_patch(shifted, patch)["a.py"] == "zero\nzero\n" + BEFORE["a.py"].replace("six", "SIX")


@pytest.mark.parametrize(
    "tree, patch",
    [
        ({"a.py": "other\n"}, make_patch({"a.py": "one\n"}, {"a.py": "two\n"})),  # context does not match
        ({}, make_patch({"a.py": "one\n"}, {"a.py": "two\n"})),  # the file is missing
        ({"a.py": "one\n"}, "--- a/../x\n+++ b/../x\n@@ -1 +1 @@\n-one\n+two\n"),  # leaves the repository
        ({"a.py": "one\n"}, "not a diff"),
    ],
)
def test_a_patch_that_does_not_apply_is_a_patch_error(tree, patch):
    with pytest.raises(PatchError):
        apply_patch(tree, patch)
