"""Read a score out of a judge model's free-text verdict, tolerating the ways judges write it.

Accepted, in this order of precedence (the first rule that matches decides):
    1. an explicit label: "Score: 7", "score = 7/10", "**Score:** 8.5", "Rating: 3" -- the LAST
       such label wins, because judges reason first and conclude at the end;
    2. a fraction of the scale: "7/10", "7 out of 10" (the denominator must equal `max_score`);
    3. a verdict that starts with a number: "7", "**8**", " 6. The answer is...".
The number must lie in [0, max_score]; anything else (no number, out of range, "ten", empty)
is unparsable and returns None: the environment turns that into the status `judge_unparsable`.

Not guaranteed: that a parsed number is what the judge meant (a verdict "3 errors, score 9"
reads 9 by rule 1, but "3 errors, 9" reads 3 by rule 3). Use a rubric that ends with
"Score:" so the judge's first token is the score.
"""

from __future__ import annotations

import re

_NUMBER = r"(\d+(?:\.\d+)?)"
_LABELLED = re.compile(
    r"(?:score|rating|grade)\s*[*_]*\s*(?:[:=]|is)\s*[*_]*\s*" + _NUMBER + r"(?:\s*(?:/|out of)\s*" + _NUMBER + r")?",
    re.IGNORECASE,
)
_FRACTION = re.compile(_NUMBER + r"\s*(?:/|out of)\s*" + _NUMBER, re.IGNORECASE)
_LEADING = re.compile(r"^[\s*_#`\"'(\[]*" + _NUMBER + r"(?![\d.]*[a-zA-Z])")


def parse_score(verdict: str, max_score: float) -> float | None:
    """The judge's score in [0, max_score], or None when the verdict holds no readable score."""
    labelled = _LABELLED.findall(verdict)
    if labelled:
        value, scale = labelled[-1]
        return _checked(value, scale, max_score)
    fraction = _FRACTION.search(verdict)
    if fraction:
        return _checked(fraction.group(1), fraction.group(2), max_score)
    leading = _LEADING.match(verdict)
    if leading:
        return _checked(leading.group(1), "", max_score)
    return None


def _checked(value: str, scale: str, max_score: float) -> float | None:
    number = float(value)
    if scale and float(scale) != max_score:
        return None  # "7/100" on a 10-point rubric: the judge used another scale
    return number if 0.0 <= number <= max_score else None
