"""A base model as a client resolves it by name: its tokenizer in the local Hugging Face cache, its
tinker-cookbook renderer checked against that tokenizer.

    export_tokenizer(name, tokenizer_dir)   HF_HUB_CACHE/models--ORG--NAME/snapshots/REV/ <- the files
    recommended_renderer(name)              the cookbook's renderer for a name it knows, else None
    check_renderer(renderer, tokenizer)     a conversation renders and its reply parses back

The SDK's `get_tokenizer()` loads get_info's `tokenizer_id` (a directory), but the cookbook's
`get_tokenizer(model_name)` calls `AutoTokenizer.from_pretrained(model_name)`, which offline reads
the hub cache: a snapshot directory named by `refs/main`. The export writes the tokenizer there
under the served name (with an empty `config.json`: AutoTokenizer reads one to pick a class, and
an empty one leaves the choice to `tokenizer_config.json`, so the tokenizer loads as saved).
Guaranteed: the revision is a hash of the files, so an unchanged tokenizer rewrites nothing and a
changed one gets a new snapshot; a repository already in the cache that gapless did not write (a
real download of that name) is never touched: the export is skipped and the reason returned.
Not guaranteed: that a client on another machine, or with another HF_HUB_CACHE, sees the export.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MARKER = "gapless_export.json"  # in every snapshot this module writes: whose the repository is


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def export_tokenizer(name: str, tokenizer_dir: str | Path, cache: Path | None = None) -> str | None:
    """Write the tokenizer saved in `tokenizer_dir` into the hub cache as repository `name`;
    returns None when done, else why it was skipped."""
    cache = cache or hub_cache()
    files = sorted(p for p in Path(tokenizer_dir).iterdir() if p.is_file())
    digest = hashlib.sha1()
    for p in files:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    revision = digest.hexdigest()
    repo = cache / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        current = repo / "snapshots" / ref.read_text().strip()
        if not (current / MARKER).is_file():
            return f"{repo} holds another {name!r} (not written by gapless): left as is"
        if current.name == revision:
            return None
    snapshot = repo / "snapshots" / revision
    tmp = snapshot.with_name(f"{revision}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in files:
        shutil.copyfile(p, tmp / p.name)
    (tmp / "config.json").write_text("{}\n")
    (tmp / MARKER).write_text(json.dumps({"served_name": name}) + "\n")
    shutil.rmtree(snapshot, ignore_errors=True)
    os.replace(tmp, snapshot)
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref_tmp = ref.with_name(f"main.tmp{os.getpid()}")
    ref_tmp.write_text(revision)
    os.replace(ref_tmp, ref)
    return None


def recommended_renderer(name: str) -> str | None:
    try:
        from tinker_cookbook import model_info
    except ImportError:
        return None
    try:
        return model_info.get_recommended_renderer_name(name)
    except Exception:  # noqa: BLE001 -- a name the cookbook does not know (KeyError, ValueError, its own)
        return None


def check_renderer(renderer: str, tokenizer) -> str | None:
    """None if the cookbook's `renderer` renders a conversation with `tokenizer` and parses an
    assistant reply ended by its stop sequence back to the same message; else what failed.
    Without tinker-cookbook installed there is nothing to check (None)."""
    try:
        from tinker_cookbook import renderers
    except ImportError:
        return None
    reply = "apple, pear, fig"
    try:
        r = renderers.get_renderer(renderer, tokenizer)
        r.build_generation_prompt([{"role": "user", "content": "Name 3 fruits."}])
        stop = r.get_stop_sequences()[0]
        end = [stop] if isinstance(stop, int) else tokenizer.encode(stop, add_special_tokens=False)
        message, _ = r.parse_response(tokenizer.encode(reply, add_special_tokens=False) + end)
    except Exception as exc:  # noqa: BLE001 -- the renderer's own error, reported as a config error
        return f"{type(exc).__name__}: {exc}"
    content = renderers.get_text_content(message) if hasattr(renderers, "get_text_content") else message["content"]
    if content != reply:
        return f"a reply {reply!r} parses back as {content!r}"
    return None
