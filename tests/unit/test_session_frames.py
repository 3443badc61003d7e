"""Reply frames of a session's live process (sandbox/frames.py), a property over arbitrary bytes:
any bytes, cut into any chunks, give a reply or a violation, never an exception, with memory
bounded by the cap of the frame being read; well-formed replies read back exactly."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gapless.sandbox.frames import HEADER_CAP_BYTES, LENGTH_BYTES, Reply, ReplyReader, clean_text

BLOB_CAP = 1 << 12


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(LENGTH_BYTES, "little") + body


def header(**fields) -> bytes:
    return frame(json.dumps(fields).encode())


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def read(chunks: list[bytes], expects_blob: bool, end: bool = False) -> ReplyReader:
    reader = ReplyReader(expects_blob, BLOB_CAP)
    for chunk in chunks:
        reader.feed(chunk)
        kept = len(reader._buffer)  # the one bound that matters: what is held at once
        assert kept <= LENGTH_BYTES + max(HEADER_CAP_BYTES, BLOB_CAP) + len(chunk)
    if end:
        reader.feed(b"")
    return reader


def pieces():
    """Frames a forger would try, and garbage: as bytes, concatenated in any order."""
    bodies = st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda v: json.dumps(v).encode(),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                lambda inner: (
                    st.lists(inner, max_size=3)
                    | st.dictionaries(
                        st.sampled_from(["ok", "error", "snapshot_bytes", "snapshot", "x"]), inner, max_size=3
                    )
                ),
                max_leaves=8,
            ),
        ),
        st.sampled_from(
            [
                b'{"ok": true}',
                b'{"ok": false, "error": "\\ud800"}',
                b'{"ok": true, "snapshot": "@@"}',
                b'{"ok": true, "snapshot_bytes": 3}',
                b'{"ok": true, "snapshot_bytes": 99999999}',
                b"[" * 5000,
                b"\xff\xfe",
                b"abc",
            ]
        ),
    )
    framed = st.builds(frame, bodies)
    lying = st.builds(lambda n, body: n.to_bytes(8, "little") + body, st.integers(0, 2**64 - 1), st.binary(max_size=32))
    return st.lists(st.one_of(framed, lying, st.binary(max_size=16)), max_size=4).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(data=pieces(), cuts=st.lists(st.integers(0, 200), max_size=6), expects_blob=st.booleans(), end=st.booleans())
def test_any_bytes_give_a_reply_or_a_violation(data, cuts, expects_blob, end):
    reader = read(chunked(data, cuts), expects_blob, end)
    if end:
        assert reader.is_done
    if reader.reply is not None and reader.violation is None:
        assert isinstance(reader.reply.ok, bool)
        assert reader.reply.error is None or reader.reply.error == clean_text(reader.reply.error)
        assert (reader.reply.blob is not None) == (expects_blob and reader.reply.ok)
        if reader.reply.blob is not None:
            assert len(reader.reply.blob) <= BLOB_CAP


@settings(max_examples=100, deadline=None)
@given(
    ok=st.booleans(),
    error=st.one_of(st.none(), st.text(max_size=50)),
    blob=st.binary(max_size=BLOB_CAP),
    cuts=st.lists(st.integers(0, BLOB_CAP), max_size=5),
)
def test_well_formed_replies_read_back(ok, error, blob, cuts):
    fields = {"ok": ok, "error": error} | ({"snapshot_bytes": len(blob)} if ok else {})
    data = header(**fields) + (frame(blob) if ok else b"")
    reader = read(chunked(data, cuts), expects_blob=True)
    assert reader.violation is None
    assert reader.reply == Reply(ok, clean_text(error), blob if ok else None)


def test_a_huge_frame_is_refused_from_its_length_alone():
    reader = ReplyReader(expects_blob=False)
    reader.feed((16 << 20).to_bytes(8, "little") + b"{" * 1000)
    assert reader.violation is not None and reader.violation.too_large and len(reader._buffer) == 0
    snapshot = ReplyReader(expects_blob=True, blob_cap_bytes=BLOB_CAP)
    snapshot.feed(header(ok=True, snapshot_bytes=BLOB_CAP + 1))
    assert snapshot.violation is not None and snapshot.violation.too_large


def test_several_replies_and_mismatched_sizes_are_violations():
    two = ReplyReader()
    two.feed(header(ok=True) + header(ok=True))
    assert two.violation is not None and "after the reply" in two.violation.reason
    late = ReplyReader()
    late.feed(header(ok=True))
    late.feed(b"\x00")
    assert late.violation is not None
    short = ReplyReader(expects_blob=True, blob_cap_bytes=BLOB_CAP)
    short.feed(header(ok=True, snapshot_bytes=10) + frame(b"12345"))
    assert short.violation is not None and not short.violation.too_large
    for forged in (
        {"ok": True, "snapshot": "!!not base64!!"},
        {"ok": 1},
        {"ok": True, "error": 5},
        {"ok": True, "snapshot_bytes": True},
        {"ok": True, "snapshot_bytes": -1},
    ):
        reader = ReplyReader(expects_blob=True, blob_cap_bytes=BLOB_CAP)
        reader.feed(header(**forged))
        assert reader.violation is not None, forged
