"""Prefix-cache benchmark: a multi-turn workload on the torch engine with the cache on and off.

Workload: C conversations played together, T turns each. Turn 1's prompt is a shared system
prompt plus the conversation's own opening; each later prompt is the previous prompt, the
completion sampled for it (greedy, `new` tokens forced) and a user reply of `reply` tokens, as a
client that re-sends its whole conversation every call. All C prompts of a turn go to the
engine in one `generate` call. Measured: wall seconds for the whole workload, per round, with
the cache on (`prefix_cache_mb`) and off on engines built once; the two run in alternating order
round by round (on off, off on, ...), with the OpenMP threads passive (docs/engine.md, *Threads
on a shared machine*). Also checked each round: both give the same tokens. Prints each round,
the medians and their ratio, then one JSON object on the last line.

    PYTHONPATH=src python bench/prefix_cache.py [--rounds 5] [--turns 10] [--conversations 8]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from gapless.config import ModelConfig  # noqa: E402
from gapless.envs.code.problems import generate_problems  # noqa: E402
from gapless.generate.engine import TorchEngine  # noqa: E402
from gapless.models import build_tiny  # noqa: E402
from gapless.types import SamplingParams  # noqa: E402


def _tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def workload(engine: TorchEngine, args, vocab: int) -> tuple[float, list[list[int]]]:
    """Play the conversations; returns wall seconds and every completion's tokens."""
    gen = torch.Generator().manual_seed(0)
    system = _tokens(gen, args.system, vocab)
    contexts = [system + _tokens(gen, args.reply, vocab) for _ in range(args.conversations)]
    params = SamplingParams(greedy=True, max_new_tokens=args.new, ignore_eos=True)
    out, start = [], time.perf_counter()
    for _ in range(args.turns):
        completions = engine.generate(contexts, params)
        out += [c.token_ids for c in completions]
        contexts = [ctx + c.token_ids + _tokens(gen, args.reply, vocab) for ctx, c in zip(contexts, completions)]
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--system", type=int, default=256, help="tokens of the shared system prompt")
    parser.add_argument("--reply", type=int, default=48, help="tokens of each user turn")
    parser.add_argument("--new", type=int, default=24, help="tokens sampled per turn")
    parser.add_argument("--hidden", type=int, default=256, help="model width (4 layers, head dim 64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-cache-mb", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        hidden_size=args.hidden,
        num_layers=4,
        num_heads=args.hidden // 64,
        num_kv_heads=max(1, args.hidden // 128),
        intermediate_size=4 * args.hidden,
        vocab_size=512,
    )
    context = args.system + args.turns * (args.reply + args.new) + args.new
    policy = build_tiny(
        cfg, [p.prompt + p.solution for p in generate_problems(0, "train", 200, [1, 2, 3])], 0, max_positions=context
    )
    vocab = policy.model.config.vocab_size
    engines = {
        "on": TorchEngine(
            policy.model, policy.eos_id, max_batch=args.conversations, prefix_cache_mb=args.prefix_cache_mb
        ),
        "off": TorchEngine(policy.model, policy.eos_id, max_batch=args.conversations),
    }
    params_m = sum(p.numel() for p in policy.model.parameters()) / 1e6
    print(
        f"model {params_m:.1f}M parameters; {args.conversations} conversations x {args.turns} turns, "
        f"context {args.system + args.reply} -> {context} tokens"
    )
    workload(engines["on"], args, vocab), workload(engines["off"], args, vocab)  # warm both (kernels, cache sizes)
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    prefill = {}
    for r in range(args.rounds):
        order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
        tokens = {}
        for name in order:
            engine = engines[name]
            engine.update_weights(engine.state_dict(), engine.version + 1)  # a fresh cache each round
            before = engine.stats.prefill_tokens
            wall_s, tokens[name] = workload(engine, args, vocab)
            seconds[name].append(wall_s)
            prefill[name] = engine.stats.prefill_tokens - before
        assert tokens["on"] == tokens["off"], "the cache changed a greedy token"
        print(f"round {r}: on {seconds['on'][-1]:.3f} s, off {seconds['off'][-1]:.3f} s ({' then '.join(order)})")
    median = {k: statistics.median(v) for k, v in seconds.items()}
    stats = engines["on"].stats.prefix_cache
    result = {
        "model_params_m": round(params_m, 2),
        "conversations": args.conversations,
        "turns": args.turns,
        "seconds_on": seconds["on"],
        "seconds_off": seconds["off"],
        "median_on_s": median["on"],
        "median_off_s": median["off"],
        "speedup": median["off"] / median["on"],
        "prefill_tokens_per_round": prefill,
        "hits": stats.hits,
        "misses": stats.misses,
        "hit_tokens": stats.hit_tokens,
    }
    print(
        f"median: on {median['on']:.3f} s, off {median['off']:.3f} s: {result['speedup']:.2f}x with the cache; "
        f"prefilled tokens per round {prefill['on']} vs {prefill['off']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
