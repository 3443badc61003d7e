"""One tool request in an episode's sandbox session, and who is blamed when the session fails
(the `repo` and `swe` tasks share these rules).

    call(episode, open_session, request)   the session's result, or None: the episode has ended
        no session could be opened (or seeded), or the host closed it   ──> infra_error
        the session never started (its status is infra_error)           ──> infra_error
        the slot was lost under the model's code (`is_lost`)            ──> tool_error, reward 0
    tool_text(result)                       what the model is shown of a result that came back

`open_session(episode)` sets `episode.session`, and raises `SandboxError` for a failure of the
host's own (seeding included); the session is closed on every failure. Model output is
untrusted: nothing here raises for anything the model's code does.
"""

from __future__ import annotations

from typing import Callable

from gapless.envs.commands import session_code
from gapless.envs.episode import Episode
from gapless.sandbox import SandboxError, Status
from gapless.sandbox.frames import clean_text
from gapless.sandbox.worker import SlotFailure


def call(episode: Episode, open_session: Callable[[Episode], None], request: dict):
    try:
        if episode.session is None:
            open_session(episode)
        result = episode.session.run(session_code(request))
    except (SandboxError, SlotFailure) as exc:  # no session, or one the host closed (idle)
        close_session(episode)
        episode.finish("infra_error", error=str(exc)[:300])
        return None
    if result.status is Status.INFRA_ERROR:  # the session never started: nothing of the model ran
        close_session(episode)
        episode.finish("infra_error", error=clean_text(result.stderr, 300))
        return None
    if result.is_lost:  # the slot failed under the model's code: its own outcome, scored
        close_session(episode)
        episode.finish("tool_error", 0.0, tool_status="crashed")
        return None
    return result


def tool_text(result) -> str:
    if result.status in (Status.OK, Status.NONZERO_EXIT):
        return result.stdout if result.error is None else f"{result.stdout}error: {result.error}"
    # the live process was stopped; the files are kept and the next call gets a new one
    return f"error: the command hit the sandbox's {result.status.value} limit"


def close_session(episode: Episode) -> None:
    if episode.session is not None:
        episode.session.close()
        episode.session = None
