"""What the coding-agent tasks share: the command syntax, the in-session toolbox, the turn format.

A model turn holds one command, `<cmd>...</cmd>`, its first line the verb (each task names the
verbs it offers: envs/repo/tools.py, envs/swe/tools.py). The environment answers
`<out>...</out>\n` (loss-masked), at most `max_output_bytes` of it (head and tail of longer
output). A turn without `<cmd>` ends the episode like `done`.

Containment (what each tool guarantees, on top of the sandbox, which is the real boundary):
- paths: absolute paths and `..` are refused on the host before anything runs; inside the
  session every path is resolved (symlinks followed) and refused unless it stays in the
  repository (/work/session), so a symlink planted by `run` leads nowhere;
- sizes: a write over `max_file_bytes` is refused; a file over it is not shown (a line range
  of it is), nor searched; `run` keeps at most `max_output_bytes` of output however much the
  command prints (it reads and discards);
- processes: `run` starts its command in a new session (process group) and kills the whole
  group when it exits or at its deadline, so background children die with the call; a fork
  bomb meets the sandbox's process cap and the deadline; whatever escapes the group dies with
  the sandbox session;
- hidden tests are never in the session's file system (the environments grade elsewhere).
Every malformed command (unknown verb, missing path, a patch without `---`) is an error message
to the model, never an exception. Not guaranteed: atomicity between a path check and its use
against a background process racing it (it can only reach what the sandbox lets it reach).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

CMD_OPEN, CMD_CLOSE = "<cmd>", "</cmd>"
PATCH_SEPARATOR = "\n---\n"
_BARE = ("ls", "test", "done")  # verbs whose argument is optional and free text


@dataclass(frozen=True)
class Command:
    kind: str  # a verb, or "invalid" / "none"
    path: str = ""  # cat, write, patch, grep (optional), ls (optional)
    text: str = ""  # write: the file's text; run: the shell command; grep: the pattern; test: its argument
    old: str = ""  # patch
    new: str = ""  # patch
    error: str = ""  # invalid: what to tell the model; none: why there was no command
    first: int = 0  # cat with a line range: first and last line (1-based, inclusive); 0: none
    last: int = 0


def parse_command(turn: str, verbs: tuple[str, ...], has_ranges: bool = False) -> Command:
    """Read one model turn offering `verbs`; untrusted: any text gives a Command, never an
    exception. `has_ranges`: `cat PATH A-B` reads lines A to B."""
    start = turn.find(CMD_OPEN)
    if start < 0:
        return Command("none", error="no <cmd>")
    end = turn.find(CMD_CLOSE, start)
    if end < 0:
        return Command("invalid", error="unclosed <cmd>")
    body = turn[start + len(CMD_OPEN) : end]
    head, _, rest = body.partition("\n")
    verb, _, argument = head.strip().partition(" ")
    argument = argument.strip()
    if verb not in verbs:
        return Command("invalid", error=f"unknown command {verb[:20]!r}; use one of {', '.join(verbs)}")
    if verb in _BARE:
        return Command(verb, path=argument if verb == "ls" else "", text=argument if verb == "test" else "")
    if verb == "run":
        command = (argument + ("\n" + rest if rest else "")).strip()
        return Command("run", text=command) if command else Command("invalid", error="run needs a command")
    if verb == "grep":
        where = rest.strip()
        problem = path_problem(where) if where else ""
        if not argument or problem:
            return Command("invalid", error=problem or "grep needs a pattern (a Python regular expression)")
        return Command("grep", where, text=argument)
    first = last = 0
    if verb == "cat" and has_ranges:
        path, _, span = argument.rpartition(" ")
        bounds = span.split("-")
        if path and len(bounds) == 2 and all(b.isdigit() and len(b) < 9 for b in bounds):
            argument, first, last = path.strip(), int(bounds[0]), int(bounds[1])
            if not 1 <= first <= last:
                return Command("invalid", error="a line range is FIRST-LAST, 1 <= FIRST <= LAST")
    problem = path_problem(argument)
    if problem:
        return Command("invalid", error=problem)
    if verb == "cat":
        return Command("cat", argument, first=first, last=last)
    if verb == "write":
        return Command("write", argument, text=rest)
    old, separator, new = rest.partition(PATCH_SEPARATOR)
    if not separator or not old:
        return Command("invalid", error="patch needs PATH, then the old text, a line ---, the new text")
    return Command("patch", argument, old=old, new=new)


def path_problem(path: str) -> str:
    """Why `path` is refused before anything runs ('' if it is not)."""
    if not path:
        return "a path is needed"
    if path.startswith("/") or ".." in PurePosixPath(path).parts or "\x00" in path:
        return f"{path[:40]!r} is outside the repository: use a relative path without '..'"
    return ""


# Runs in the session's live process (cwd = the repository), defined and removed on every call
# so that a crash of the live process loses nothing the next call needs.
TOOLBOX = r"""
def __g_tool(request):
    import os, select, signal, stat, subprocess, sys, time
    root = os.path.realpath(".")
    limit = request["max_file_bytes"]

    def inside(path):
        full = os.path.realpath(os.path.join(root, path))
        if full != root and not full.startswith(root + os.sep):
            raise PermissionError(f"{path} leads outside the repository")
        return full

    def files():
        found = []
        for folder, dirs, names in os.walk(root):
            dirs.sort()
            found += sorted(os.path.relpath(os.path.join(folder, n), root) for n in names)
        return found

    def run(command):
        started = time.monotonic()
        deadline = started + request["run_timeout_s"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": root, "PYTHONDONTWRITEBYTECODE": "1",
               "GAPLESS_PYTHON": sys.executable, **request.get("env", {})}
        command = 'python() { "$GAPLESS_PYTHON" "$@"; }\n' + command  # `python` is the sandbox's
        proc = subprocess.Popen(command, shell=True, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        kept, fd, timed_out = bytearray(), proc.stdout.fileno(), False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            kept += chunk[: max(request["max_output_bytes"] - len(kept), 0)]
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # background children die with the call
        except ProcessLookupError:
            pass
        proc.stdout.close()
        code = proc.wait()
        tail = "[timed out]" if timed_out else f"[exit {code}]"
        return kept.decode("utf-8", "replace") + tail

    def lines(full, first, last):
        shown, total = [], 0
        with open(full, encoding="utf-8", errors="replace") as handle:
            for total, line in enumerate(handle, 1):
                if first <= total <= last:
                    shown.append(f"{total:>5} {line.rstrip(chr(10))}")
        more = f"\n[lines {first}-{min(last, total)} of {total}]" if total > last or first > 1 else ""
        return "\n".join(shown) + more

    def grep(pattern, where):
        import re
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            return f"error: bad pattern: {exc}"
        found, full = [], inside(where or ".")
        paths = [os.path.relpath(full, root)] if os.path.isfile(full) else [
            p for p in files() if (os.path.join(root, p) + os.sep).startswith(full.rstrip(os.sep) + os.sep)]
        for path in paths:
            if os.path.getsize(os.path.join(root, path)) > limit:
                continue
            with open(os.path.join(root, path), encoding="utf-8", errors="replace") as handle:
                for number, line in enumerate(handle, 1):
                    if regex.search(line):
                        found.append(f"{path}:{number}: {line.strip()[:200]}")
                        if len(found) >= request["max_matches"]:
                            return "\n".join(found) + "\n[more matches: narrow the pattern or the path]"
        return "\n".join(found) or "no match"

    def changes():  # the session's tree against the shared base it started from (cow sessions)
        import hashlib, json
        base, out, deleted = request["base"], {}, []

        def skip(path):  # caches the tools' own runs leave (pytest's, bytecode)
            return any(part in request["skip_dirs"] for part in path.split(os.sep)) or path.endswith(".pyc")

        def digest(path):
            with open(path, "rb") as handle:
                return hashlib.sha256(handle.read()).digest()

        now = set(p for p in files() if not skip(p))
        for folder, dirs, names in os.walk(base):
            for name in names:
                rel = os.path.relpath(os.path.join(folder, name), base)
                if rel not in now and not skip(rel):
                    deleted.append(rel)
        for path in sorted(now):
            full, info = os.path.join(root, path), os.lstat(os.path.join(root, path))
            original = os.path.join(base, path)
            if not stat.S_ISREG(info.st_mode):
                continue
            if os.path.isfile(original) and os.path.getsize(original) == info.st_size and digest(original) == digest(full):
                continue
            if len(out) >= request["max_files"] or info.st_size > limit:
                return "\n" + json.dumps({"error": f"too many or too large changed files ({path})"})
            with open(full, encoding="utf-8", errors="replace") as handle:
                out[path] = handle.read()
        return "\n" + json.dumps({"changed": out, "deleted": sorted(deleted)})

    op = request["op"]
    if op == "ls":
        under = (request.get("path") or "").strip("/")
        return request.get("sep", " ").join(p for p in files() if not under or p.startswith(under + "/"))
    if op == "grep":
        return grep(request["pattern"], request.get("path", ""))
    if op == "changes":
        return changes()
    if op == "cat" and request.get("last"):
        return lines(inside(request["path"]), request["first"], request["last"])
    if op in ("cat", "patch"):
        full = inside(request["path"])
        if os.path.getsize(full) > limit:
            return f"{request['path']} is larger than {limit} bytes"
        with open(full, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        if op == "cat":
            return text
        count = text.count(request["old"])
        if count != 1:
            return f"the old text occurs {count} times in {request['path']}; it must occur once"
        text = text.replace(request["old"], request["new"], 1)
    if op == "write":
        text = request["text"]
    if op in ("patch", "write"):
        full = inside(request["path"])
        if len(text.encode()) > limit:
            return f"refused: the file would be larger than {limit} bytes"
        os.makedirs(os.path.dirname(full), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(full, flags, 0o644), "w", encoding="utf-8") as handle:
            handle.write(text)
        return "patched" if op == "patch" else f"wrote {request['path']}"
    if op == "run":
        return run(request["command"])
    if op == "collect":  # the final files, for grading: regular files only, never a link
        out = {}
        for path in files()[: request["max_files"]]:
            info = os.lstat(os.path.join(root, path))
            if stat.S_ISREG(info.st_mode) and info.st_size <= limit:
                with open(os.path.join(root, path), encoding="utf-8", errors="replace") as handle:
                    out[path] = handle.read()
        import json
        return "\n" + json.dumps(out)
    if op == "seed":
        for path, text in request["files"].items():
            with open(os.path.join(root, path), "w", encoding="utf-8") as handle:
                handle.write(text)
        return "seeded"
    raise ValueError(op)
"""
CALL = """\
{toolbox}
try:
    try:
        print(__g_tool({request!r}), end="")
    except OSError as __g_error:
        print(f"error: {{__g_error.strerror or __g_error}}", end="")
finally:
    for __g_name in [n for n in globals() if n.startswith("__g_")]:
        globals().pop(__g_name, None)
"""


def session_code(request: dict) -> str:
    """The Python a session runs for one tool request (`op` plus its fields); it prints the
    observation."""
    return CALL.format(toolbox=TOOLBOX, request=request)


def shown(text: str, max_bytes: int) -> str:
    """At most `max_bytes` UTF-8 bytes of `text`: its head and tail around '...' if longer."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    half = (max_bytes - 3) // 2
    return (data[:half] + b"..." + data[len(data) - (max_bytes - 3 - half) :]).decode("utf-8", "ignore")


def output_text(observation: str) -> str:
    """What the environment appends after a command, in the plain format."""
    return f"<out>{observation}</out>\n"


@dataclass(frozen=True)
class TurnFormat:
    """How an episode's text is framed, in one place. Plain (the default, and the embedded tiny
    model's): the prompt as it is, each observation `<out>...</out>\n`. Chat (`chat_format`,
    for instruct checkpoints whose tokenizer has a chat template): the prompt is the rendered
    user message plus the generation prompt; an observation is what the template puts after the
    model's end-of-turn token up to the next generation prompt, so that prompt + turns + EOS +
    replies is exactly the rendered conversation (token-exact: nothing is re-tokenised)."""

    prompt_prefix: str = ""
    prompt_suffix: str = ""
    reply_prefix: str = ""
    reply_suffix: str = ""

    def prompt(self, text: str) -> str:
        return f"{self.prompt_prefix}{text}{self.prompt_suffix}"

    def reply(self, observation: str) -> str:
        return f"{self.reply_prefix}{output_text(observation)}{self.reply_suffix}"


PLAIN = TurnFormat()


def chat_format(tokenizer) -> TurnFormat:
    """The chat framing of `tokenizer`'s template (PLAIN when it has none), found by rendering
    a probe conversation and cutting it at the probe's texts."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN
    user, said, seen = "\x01user\x01", "\x01said\x01", "\x01seen\x01"

    def render(messages, generation):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    first = render([{"role": "user", "content": user}], True)
    full = render(
        [{"role": "user", "content": user}, {"role": "assistant", "content": said}, {"role": "user", "content": seen}],
        True,
    )
    if not full.startswith(first + said):
        raise ValueError(
            "the tokenizer's chat template does not extend a conversation by appending to it; "
            "use a plain prompt format for this checkpoint"
        )
    between, after = full[len(first + said) :].split(seen, 1)
    eos = tokenizer.eos_token or ""
    if eos and between.startswith(eos):  # the model's own end-of-turn token ends its turn
        between = between[len(eos) :]
    head, tail = first.split(user, 1)
    return TurnFormat(head, tail, between, after)


def command_text(verb: str, path: str = "", body: str | None = None) -> str:
    head = f"{verb} {path}".strip()
    return f"{CMD_OPEN}{head}{'' if body is None else chr(10) + body}{CMD_CLOSE}"


Segment = tuple[str, bool]  # (text, written by the model); a model segment ends its turn (EOS)


def observe(observation: str, max_output_bytes: int, turn_format: TurnFormat = PLAIN) -> str:
    return turn_format.reply(shown(observation, max_output_bytes))
