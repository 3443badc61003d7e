"""The live process of a sandbox session: runs the host's requests in one persistent namespace.

It is shipped into the sandbox as a job file and runs as the (unprivileged) program, in the
session's cwd /work/session, which keeps its files for the session's lifetime. Requests come on
stdin: an 8-byte little-endian length, then a marshal dict from the host (trusted). Replies go to
fd 3, framed the same way: a JSON header `{"ok", "error"}`, and for a snapshot
`"snapshot_bytes": N` then a raw frame of the N archive bytes (frames.py has the grammar; the
host treats every byte as untrusted). The model's code runs in this very process (that is the
point of a session), so it can break the protocol; it can only ever spoil its own session's
answers.

Operations: run (exec code in the namespace), snapshot (a tar.gz of /work/session under
`files/` plus the pickle of what pickles of the namespace as the member `namespace.pickle`, made
in memory), restore (replace /work/session with a snapshot's files, then load its
namespace). A request whose handling raises (a snapshot the archive cannot hold, a forged
archive) is answered with an error; the process goes on. The namespace's pickle never touches the session's file system: the model cannot
read or rewrite it between calls, and a new live process (after a crash) starts with an empty
namespace, so "the variables are lost" is exactly true. A namespace that pickled but does not
unpickle (a value whose `__reduce__` fails on load) fails the restore with an error after the
files are back; the namespace is then empty. Importing this module does nothing.
"""

import io
import json
import marshal
import os
import pickle
import shutil
import sys
import tarfile
import traceback

FILES_PREFIX = "files/"
NAMESPACE_MEMBER = "namespace.pickle"
# The sandbox, not tarfile, is the boundary here: the archive was made in this very sandbox, so
# its links are restored as they were (newer Pythons would otherwise refuse links out of cwd).
EXTRACT_AS_IS = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def _handle(request, namespace):
    """The JSON header of the reply, or (header, archive) for a snapshot."""
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
        return {"ok": True}, _snapshot(namespace)
    if op == "restore":
        return _restore(request["snapshot"], namespace)
    return {"ok": False, "error": f"unknown op {op!r}"}


def _snapshot(namespace):
    kept = {}
    for name, value in namespace.items():
        if name == "__builtins__":
            continue
        try:
            pickle.dumps(value)
        except Exception:
            continue  # modules, open files, lambdas...: files and data survive, these not
        kept[name] = value
    state = pickle.dumps(kept)
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for entry in sorted(os.listdir(".")):
            tar.add(entry, arcname=FILES_PREFIX + entry)
        member = tarfile.TarInfo(NAMESPACE_MEMBER)
        member.size = len(state)
        tar.addfile(member, io.BytesIO(state))
    return archive.getvalue()


def _restore(snapshot, namespace):
    for entry in os.listdir("."):
        path = os.path.join(".", entry)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    namespace.clear()
    namespace.update(_initial_namespace())
    state = b""
    with tarfile.open(fileobj=io.BytesIO(snapshot), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.name == NAMESPACE_MEMBER:
                state = tar.extractfile(member).read()
            elif member.name.startswith(FILES_PREFIX) and len(member.name) > len(FILES_PREFIX):
                member.name = member.name[len(FILES_PREFIX) :]
                tar.extract(member, ".", **EXTRACT_AS_IS)
    try:
        values = pickle.loads(state) if state else {}
    except Exception as error:  # pickled by the model's own objects: their load may fail
        return {
            "ok": False,
            "error": f"the files were restored, the variables were not ({type(error).__name__}: {error})"[:2000],
        }
    namespace.update(values)
    return {"ok": True}


def _initial_namespace():
    return {"__name__": "__main__"}


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
        try:
            answer = _handle(request, namespace)
        except Exception as error:  # noqa: BLE001 -- e.g. a snapshot the archive cannot hold, a forged archive
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        head, blob = answer if isinstance(answer, tuple) else (answer, None)
        if blob is not None:
            head["snapshot_bytes"] = len(blob)
        sys.stdout.flush()
        sys.stderr.flush()
        for frame in (json.dumps(head).encode(), blob):
            if frame is not None:  # length and body apart: the archive is never copied
                replies.write(len(frame).to_bytes(8, "little"))
                replies.write(frame)
        replies.flush()


if __name__ == "__main__":
    main()
