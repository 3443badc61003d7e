"""An inspect-ai task for the client tests (test_serve_clients.py): one sample, one tool whose only
argument is an enum, so that even a random model's forced call is short and valid. Only inspect_ai
is imported: the file runs under .venv-openai3's `inspect eval`."""

from typing import Literal

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import tool


@tool
def paint():
    async def execute(colour: Literal["red", "blue"]):
        """Paint the wall.

        Args:
            colour: the colour to paint
        """
        return f"painted {colour}"

    return execute


@task
def painting():
    return Task(
        dataset=[Sample(input="Paint the wall red.", target="painted")],
        solver=[use_tools([paint()], tool_choice="any"), generate(tool_calls="single")],
        scorer=includes(),
    )
