"""An agent written against the OpenAI API, trained by `gapless train` through the gateway.

    gapless train --task.name agent --agent.command "python examples/openai_agent.py"

gapless runs this program once per episode. It reads its task from GAPLESS_PROMPT and its
endpoint from OPENAI_BASE_URL / OPENAI_API_KEY (the `openai` client reads both by itself), asks
the model, checks the reply, asks once more if the reply holds no number, and prints its final
answer as the last line of its output, which the task grades. Nothing in it knows about gapless:
the same program runs against any OpenAI-compatible server.
"""

from __future__ import annotations

import os
import re
import sys

from openai import OpenAI

RETRY = "\nThat is not a number. Answer: "


def number_in(text: str) -> str | None:
    match = re.search(r"-?\d+", text)
    return match.group(0) if match else None


def main() -> int:
    client = OpenAI(max_retries=0, timeout=120)
    prompt = os.environ["GAPLESS_PROMPT"]
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
        text = reply.choices[0].message.content or ""
        answer = number_in(text)
        if answer is not None:
            print(answer)
            return 0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": RETRY}]
    print(text.strip() or "(no answer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
