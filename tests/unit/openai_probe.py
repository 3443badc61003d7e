"""One pass over the served surface with whichever `openai` client the interpreter has (2.x or 3.x).

Run as a script against a live server: `python openai_probe.py BASE_URL`. It prints the client's
version and `ok N` after N checks, or fails with the first check that did not hold. The tests run it
under the suite's own venv and under the 3.x client's venv (scripts/setup.sh), so one list of
checks holds for both major versions. Only the `openai` package and pydantic are imported here.
"""

from __future__ import annotations

import json
import sys

import openai
from pydantic import BaseModel, Field

PROMPT = "Question 3: name"
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
            "required": ["a", "b"],
        },
    },
}


class Sum(BaseModel):
    total: int = Field(ge=0, le=99)
    sure: bool


def main(base_url: str) -> int:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    checks = 0

    def check(ok: bool, what: str) -> None:
        nonlocal checks
        if not ok:
            raise SystemExit(f"openai {openai.__version__}: {what}")
        checks += 1

    check(any(m.id == "tiny" for m in client.models.list()), "models.list names the served model")
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    check(len(done.choices[0].logprobs.token_logprobs) == done.usage.completion_tokens, "completion log-probs")
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    check(echo.choices[0].text == PROMPT and echo.choices[0].logprobs.token_logprobs[0] is None, "echo scoring")
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, n=2, seed=1)
    check(len(chat.choices) == 2 and chat.choices[0].message.role == "assistant", "chat with n=2")
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == chat.choices[0].message.content and chunks[-1].usage is not None, "chat stream equals chat")
    called = client.chat.completions.create(
        model="tiny", messages=messages, tools=[TOOL], tool_choice="required", max_tokens=200, temperature=0
    )
    calls = called.choices[0].message.tool_calls or []
    check(
        calls and calls[0].function.name == "add" and set(json.loads(calls[0].function.arguments)) == {"a", "b"},
        "tools",
    )
    parsed = client.chat.completions.parse(model="tiny", messages=messages, response_format=Sum, max_tokens=200)
    check(isinstance(parsed.choices[0].message.parsed, Sum), "chat.completions.parse")
    response = client.responses.create(model="tiny", input=PROMPT, max_output_tokens=8, temperature=0)
    check(response.output_text == chat.choices[0].message.content, "responses equal chat")
    with client.responses.stream(model="tiny", input=PROMPT, max_output_tokens=8, temperature=0) as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        check("".join(deltas) == events.get_final_response().output_text, "responses stream")
    tool = {"type": "function", "name": "add", "parameters": TOOL["function"]["parameters"]}
    items = client.responses.create(
        model="tiny", input="What is 2 + 3?", tools=[tool], tool_choice="required", max_output_tokens=200, temperature=0
    ).output
    check([i.type for i in items][-1:] == ["function_call"], "responses function tools")
    try:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)
        check(False, "an empty messages list is refused")
    except openai.BadRequestError as exc:
        check(exc.status_code == 400, "a refusal is a 400")
    print(f"openai {openai.__version__} ok {checks}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
