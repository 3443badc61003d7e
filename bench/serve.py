"""Serving benchmark: batching across HTTP requests, measured side by side in one run.

`gapless serve` runs in a subprocess over a locally built model (bench/generate.py's TINY shape,
context 512); the official `openai` async client (max_retries=0, one keep-alive pool of 100
connections) drives it from this process. Workloads, interleaved round by round (A B C D A B C D ...):
  concurrent   50 requests of one sequence each (prompts p_0..p_49), sent at once
  one_request  one request carrying the same 50 sequences (prompt = [p_0..p_49])
  streams      the 50 concurrent requests again, streamed (SSE, a chunk per engine step)
  raw_streams  the same streams read by plain httpx (lines counted, not parsed into models): how
               much of the streams' cost is the openai client's parsing on these same cores
  constrained  the 50 concurrent requests again, each constrained by a JSON schema (vLLM's
               `structured_outputs.json`: an array of at least 200 digits, so every sequence runs to
               `--tokens` like the unconstrained ones): the grammar masks' cost in the batch,
               reported as constrained / concurrent tokens/s
Every sequence is forced to `--tokens` new tokens (ignore_eos), sampled at T = 1. tokens/s is
completion tokens (from `usage`) over the workload's wall time; the ratio is concurrent over
one_request, per round, then the median. A connection error is any request that raised
(APIConnectionError, timeout, reset). Also timed once: a ~1 MB prompt refused against the
context (context_length_exceeded), and the CPU other processes used during each run.

    PYTHONPATH=src python bench/serve.py [--rounds 3] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from generate import TINY, LoadMeter

from gapless.models import build_tiny

SRC = Path(__file__).resolve().parents[1] / "src"
PROMPTS = [f"Question {i}: name {i % 7} fruits, colours or animals, then explain why." for i in range(50)]


def start_server(model_dir: Path, threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gapless.cli",
            "serve",
            "--model.path",
            str(model_dir),
            "--port",
            "0",
            "--model-name",
            "bench",
            "--threads",
            str(threads),
            "--max-batch",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if " at http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r} {proc.stderr.read()}")
    return proc, line.rsplit(" at ", 1)[1].strip()


LONG_JSON = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 200}


async def concurrent(client: openai.AsyncOpenAI, tokens: int, stream: bool, constrained: bool = False) -> dict:
    async def one(i: int) -> int:
        extra = {"structured_outputs": {"json": LONG_JSON}} if constrained else {"ignore_eos": True}
        kw = dict(model="bench", prompt=PROMPTS[i], max_tokens=tokens, seed=i, extra_body=extra)
        if not stream:
            return (await client.completions.create(**kw)).usage.completion_tokens
        chunks = await client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        usage = 0
        async for chunk in chunks:
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return usage

    outcomes = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    return {
        "tokens": sum(o for o in outcomes if isinstance(o, int)),
        "errors": len(errors),
        "error_kinds": sorted({type(e).__name__ for e in errors}),
    }


async def raw_streams(url: str, tokens: int) -> dict:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:

        async def one(i: int) -> int:
            body = {
                "model": "bench",
                "prompt": PROMPTS[i],
                "max_tokens": tokens,
                "seed": i,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            usage = 0
            async with http.stream("POST", f"{url}/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith('data: {"') and '"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]["completion_tokens"]
            return usage

        outcomes = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))), return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    return {
        "tokens": sum(o for o in outcomes if isinstance(o, int)),
        "errors": len(errors),
        "error_kinds": sorted({type(e).__name__ for e in errors}),
    }


async def one_request(client: openai.AsyncOpenAI, tokens: int) -> dict:
    out = await client.completions.create(
        model="bench", prompt=PROMPTS, max_tokens=tokens, seed=0, extra_body={"ignore_eos": True}
    )
    return {"tokens": out.usage.completion_tokens, "errors": 0, "error_kinds": []}


def timed(coro_fn) -> dict:
    with LoadMeter() as meter:
        result = asyncio.run(coro_fn())
    return {
        **result,
        "wall_s": meter.wall_s,
        "tokens_per_s": result["tokens"] / meter.wall_s,
        "outside_cores": meter.outside_cores,
    }


def refusal_s(url: str) -> dict:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    started = time.perf_counter()
    try:
        client.completions.create(model="bench", prompt="Question " * 110_000, max_tokens=16)  # ~1 MB
        code = "accepted"
    except openai.BadRequestError as exc:
        code = exc.code
    return {"code": code, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="forced new tokens per sequence")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny(TINY, PROMPTS, seed=0, max_positions=512).save(Path(tmp))
        proc, url = start_server(Path(tmp), args.threads)
        try:

            def client() -> openai.AsyncOpenAI:
                limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
                return openai.AsyncOpenAI(
                    base_url=url,
                    api_key="unused",
                    max_retries=0,
                    timeout=300,
                    http_client=openai.DefaultAsyncHttpxClient(limits=limits),
                )

            async def warm():
                await one_request(client(), 4)

            asyncio.run(warm())
            runs = {"concurrent": [], "one_request": [], "streams": [], "raw_streams": [], "constrained": []}
            for _ in range(args.rounds):
                runs["concurrent"].append(timed(lambda: concurrent(client(), args.tokens, stream=False)))
                runs["one_request"].append(timed(lambda: one_request(client(), args.tokens)))
                runs["streams"].append(timed(lambda: concurrent(client(), args.tokens, stream=True)))
                runs["raw_streams"].append(timed(lambda: raw_streams(url, args.tokens)))
                runs["constrained"].append(
                    timed(lambda: concurrent(client(), args.tokens, stream=False, constrained=True))
                )
            refusal = refusal_s(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ratios = [c["tokens_per_s"] / o["tokens_per_s"] for c, o in zip(runs["concurrent"], runs["one_request"])]
    stream_ratios = [s["tokens_per_s"] / o["tokens_per_s"] for s, o in zip(runs["streams"], runs["one_request"])]
    raw_ratios = [s["tokens_per_s"] / o["tokens_per_s"] for s, o in zip(runs["raw_streams"], runs["one_request"])]
    constrained_ratios = [
        k["tokens_per_s"] / c["tokens_per_s"] for k, c in zip(runs["constrained"], runs["concurrent"])
    ]
    summary = {
        name: {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
            "error_kinds": sorted({k for r in rs for k in r["error_kinds"]}),
            "outside_cores_max": max(r["outside_cores"] for r in rs),
        }
        for name, rs in runs.items()
    }
    result = {
        "rounds": args.rounds,
        "tokens": args.tokens,
        "threads": args.threads,
        "sequences": len(PROMPTS),
        "ratio_concurrent_vs_one_request": statistics.median(ratios),
        "ratios": ratios,
        "ratio_streams_vs_one_request": statistics.median(stream_ratios),
        "ratio_raw_streams_vs_one_request": statistics.median(raw_ratios),
        "ratio_constrained_vs_concurrent": statistics.median(constrained_ratios),
        "workloads": summary,
        "refusal_1mb_prompt": refusal,
        "runs": runs,
    }
    for name, s in summary.items():
        print(
            f"{name:<12} {s['tokens_per_s_median']:8.0f} tokens/s   errors {s['errors']}   "
            f"other processes <= {s['outside_cores_max']:.2f} cores"
        )
    print(
        f"concurrent / one_request: {result['ratio_concurrent_vs_one_request']:.2f}x (rounds: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"); streams / one_request: {result['ratio_streams_vs_one_request']:.2f}x (read raw: "
        f"{result['ratio_raw_streams_vs_one_request']:.2f}x)"
    )
    print(
        f"constrained / concurrent (JSON schema, 50 requests): {result['ratio_constrained_vs_concurrent']:.2f}x (rounds: "
        + ", ".join(f"{r:.2f}" for r in constrained_ratios)
        + ")"
    )
    print(f"1 MB prompt: {refusal['code']} in {refusal['seconds']:.3f} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
