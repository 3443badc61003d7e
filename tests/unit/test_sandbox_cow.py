"""Copy-on-write sessions (sandbox/cow.py): a shared tree seen at /work/session, each session's
writes its own, the tree itself untouched, the upper layer capped; the host is clean after."""

from __future__ import annotations

import pytest
from sandbox_host import IS_ROOT, SLOT_UID_BASE, needs_bwrap

from gapless.sandbox import BwrapSandbox, SandboxLimits, SessionBase, Status, prepare_tree

pytestmark = [needs_bwrap, pytest.mark.skipif(not IS_ROOT, reason="copy-on-write sessions need root")]
LIMITS = SandboxLimits(timeout_s=5.0, tmp_size_mb=1, max_files=64)


@pytest.fixture
def box(clean_host):
    with BwrapSandbox(slot_uid_base=SLOT_UID_BASE, max_concurrency=2) as sandbox:
        yield sandbox
        assert sandbox.leftovers() == []


@pytest.fixture
def base(tmp_path):
    source = tmp_path / "source"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (source / "notes.txt").write_text("shared\n")
    (source / "link").symlink_to("/etc/passwd")  # dropped by prepare_tree
    env = tmp_path / "env"
    (env / "helper").mkdir(parents=True)
    (env / "helper" / "__init__.py").write_text("NAME = 'helper'\n")
    env.chmod(0o755)
    tmp_path.chmod(0o700)  # the prepared tree's parent: only root enters
    return SessionBase(prepare_tree(source, tmp_path / "tree"), env)


def test_sessions_share_the_tree_and_keep_their_writes(box, base):
    with box.open_session(LIMITS, base=base) as one, box.open_session(LIMITS, base=base) as two:
        wrote = one.run("open('pkg/mod.py', 'a').write('VALUE = 2\\n')\nimport os\nos.remove('notes.txt')\nprint('ok')")
        assert wrote.status is Status.OK, wrote.stderr
        seen_one = one.run("import os\nprint(open('pkg/mod.py').read().count('VALUE'), os.path.exists('notes.txt'))")
        seen_two = two.run("import os\nprint(open('pkg/mod.py').read().count('VALUE'), os.path.exists('notes.txt'))")
        assert seen_one.stdout == "2 False\n" and seen_two.stdout == "1 True\n"
        assert two.run("import os\nprint(os.path.lexists('link'))").stdout == "False\n"
    assert (base.tree / "pkg" / "mod.py").read_text() == "VALUE = 1\n" and (base.tree / "notes.txt").exists()


def test_env_is_read_only_and_importable(box, base):
    with box.open_session(LIMITS, base=base) as session:
        result = session.run(
            "import sys\nsys.path.insert(0, '/work/env')\nimport helper\nprint(helper.NAME)\n"
            "try:\n    open('/work/env/x', 'w')\nexcept OSError as e:\n    print(type(e).__name__)"
        )
        assert result.stdout == "helper\nOSError\n", result.stderr


def test_the_upper_layer_is_capped(box, base):
    with box.open_session(LIMITS, base=base) as session:
        result = session.run(
            "try:\n    open('big', 'wb').write(b'x' * (4 << 20))\nexcept OSError as e:\n    print(e.errno)"
        )
        assert result.stdout.strip() == "28", result.stderr  # ENOSPC: 1 MiB upper layer
        many = session.run(
            "n = 0\ntry:\n    for n in range(1000):\n        open(f'f{n}', 'w').close()\n"
            "except OSError as e:\n    print(e.errno, n < 100)"
        )
        assert many.stdout.strip() == "28 True", many.stderr


def test_the_shared_tree_cannot_be_written_directly(box, base):
    with box.open_session(LIMITS, base=base) as session:
        probe = session.run("import os\nprint(sorted(os.listdir('/work')))")
        assert probe.stdout == "['base', 'env', 'job', 'session']\n"  # neither the host path nor the layers
        untouched = session.run("open('/work/base/notes.txt', 'a').write('x')")
        assert untouched.status is Status.NONZERO_EXIT and "Read-only" in untouched.error
