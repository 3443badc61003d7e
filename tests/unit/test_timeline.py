"""Timeline: one file per actor process, and a Chrome trace that lines them up."""

import json
import multiprocessing
import os
import time

from gapless.timeline import NullTimeline, Timeline, export_chrome_trace, open_timeline, read_records


def _actor(run_dir: str, actor: str, names: list[str]) -> None:
    timeline = Timeline(run_dir, actor)
    for i, name in enumerate(names):
        with timeline.span(name, step=i):
            time.sleep(0.01)
    timeline.instant("done")
    timeline.close()


def _complete_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_each_process_appends_to_its_own_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per actor, as the pipeline starts them
    procs = [
        ctx.Process(target=_actor, args=(str(tmp_path), "generator", ["generate", "wait_weights"] * 2)),
        ctx.Process(target=_actor, args=(str(tmp_path), "trainer", ["wait_rollouts", "train", "weight_push"])),
    ]
    for p in procs:
        p.start()
    _actor(str(tmp_path), "trainer", ["eval"])  # this process too, under the same actor name
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    files = sorted(f.name for f in (tmp_path / "timeline").iterdir())
    assert len(files) == 3
    assert f"trainer-{os.getpid()}.jsonl" in files
    for path in (tmp_path / "timeline").iterdir():
        for line in path.read_text().splitlines():
            record = json.loads(line)  # every line complete
            assert record["end"] >= record["start"] > 1e9  # wall-clock seconds since the epoch


def test_chrome_trace_is_valid_and_spans_do_not_overlap_per_thread(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_actor, args=(str(tmp_path), actor, names))
        for actor, names in (
            ("generator", ["generate", "wait_weights", "generate"]),
            ("trainer", ["wait_rollouts", "train", "weight_push"]),
            ("sandbox", ["score"] * 3),
        )
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    path = export_chrome_trace(tmp_path)
    assert path == tmp_path / "trace.json"
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"generator", "trainer", "sandbox"}
    spans = _complete_events(trace)
    assert {e["name"] for e in spans} == {"generate", "wait_weights", "wait_rollouts", "train", "weight_push", "score"}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
    assert len({e["pid"] for e in spans}) == 3  # one trace process per actor
    by_thread: dict[tuple, list] = {}
    for e in spans:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(instants) == 3


def test_threads_of_one_process_are_told_apart(tmp_path):
    import threading

    timeline = Timeline(tmp_path, "env")
    threads = [threading.Thread(target=_spans, args=(timeline,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = read_records(tmp_path)
    assert len(records) == 3 * 5 and len({r["tid"] for r in records}) == 3
    trace = json.loads(export_chrome_trace(tmp_path).read_text())
    assert len({e["tid"] for e in _complete_events(trace)}) == 3


def _spans(timeline: Timeline) -> None:
    for _ in range(5):
        with timeline.span("score"):
            time.sleep(0.002)


def test_span_is_recorded_when_the_block_raises(tmp_path):
    timeline = Timeline(tmp_path, "trainer")
    try:
        with timeline.span("train"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert [r["name"] for r in read_records(tmp_path)] == ["train"]


def test_disabled_timeline_writes_nothing(tmp_path):
    timeline = open_timeline(tmp_path, "trainer", enabled=False)
    assert isinstance(timeline, NullTimeline)
    with timeline.span("train"):
        pass
    timeline.instant("x")
    assert not (tmp_path / "timeline").exists()
    assert read_records(tmp_path) == []
    assert json.loads(export_chrome_trace(tmp_path).read_text())["traceEvents"] == []
