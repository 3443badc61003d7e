"""The live process of a sandbox session: runs the host's requests in one persistent namespace.

It is shipped into the sandbox as a job file and runs as the (unprivileged) program, in the
session's cwd /work/session, which keeps its files for the session's lifetime. Requests come on
stdin: an 8-byte little-endian length, then a marshal dict from the host (trusted). Replies go to
fd 3, framed the same way, as JSON: the host treats them as untrusted data. The model's code runs
in this very process (that is the point of a session), so it can break the protocol; it can
only ever spoil its own session's answers.

Operations: run (exec code in the namespace), snapshot (pickle what pickles of the namespace
into /work/session, then a tar.gz of /work/session, base64), restore (replace /work/session with
a snapshot and reload its namespace). Importing this module does nothing.
"""

import base64
import io
import json
import marshal
import os
import pickle
import shutil
import sys
import tarfile
import traceback

STATE_FILE = ".gapless-session-state.pickle"


def _handle(request, namespace):
    op = request["op"]
    if op == "run":
        try:
            exec(compile(request["code"], "<session>", "exec"), namespace)
        except SystemExit as stop:  # ends the call, not the session
            return {"ok": False, "error": f"SystemExit: {stop.code!r}"}
        except BaseException as error:
            traceback.print_exc()
            return {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        return {"ok": True}
    if op == "snapshot":
        kept = {}
        for name, value in namespace.items():
            try:
                pickle.dumps(value)
            except Exception:
                continue  # modules, open files, lambdas...: files and data survive, these not
            kept[name] = value
        with open(STATE_FILE, "wb") as state:
            pickle.dump({k: v for k, v in kept.items() if k != "__builtins__"}, state)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            for entry in sorted(os.listdir(".")):
                tar.add(entry)
        return {"ok": True, "snapshot": base64.b64encode(archive.getvalue()).decode()}
    if op == "restore":
        for entry in os.listdir("."):
            path = os.path.join(".", entry)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        with tarfile.open(fileobj=io.BytesIO(request["snapshot"]), mode="r:gz") as tar:
            tar.extractall(".")
        namespace.clear()
        namespace.update(_initial_namespace())
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}"}


def _initial_namespace():
    namespace = {"__name__": "__main__"}
    if os.path.exists(STATE_FILE):
        with open(STATE_FILE, "rb") as state:
            namespace.update(pickle.load(state))
    return namespace


def main():
    requests = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the model's input() sees end of file, not the protocol
    replies = os.fdopen(3, "wb")
    namespace = _initial_namespace()
    while True:
        header = requests.read(8)
        if len(header) < 8:
            return
        request = marshal.loads(requests.read(int.from_bytes(header, "little")))
        reply = json.dumps(_handle(request, namespace)).encode()
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(len(reply).to_bytes(8, "little") + reply)
        replies.flush()


if __name__ == "__main__":
    main()
