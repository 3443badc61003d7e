"""The engine's matmul kernel (`gl_linear`) against the other tile shape and against oneDNN.

On the matrices of one model shape (default Qwen2.5-0.5B: qkv, o, the gated gate | up, down and
the LM head), at decode's and prefill's row counts, three implementations side by side:
  native   the kernel as the engine builds it (`native.load()`: 8 x 32 tiles where the compiler
           targets AVX-512, 6 x 16 elsewhere)
  avx2     the same source built with -mno-avx512f (6 x 16 tiles); equal to `native` on a CPU
           without AVX-512
  onednn   torch's F.linear (and silu(gate) * up for the gated MLP), what the engine ran before
Each round times every (matrix, rows, implementation) once for about `--seconds`, in turn, so a
ratio compares runs seconds apart. Prints GFLOP/s per round and the median ratios native / avx2
and native / onednn; the last line is JSON.

    PYTHONPATH=src python bench/linear.py [--shape qwen2.5-0.5b|qwen3-0.6b] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from gapless.generate import native

SHAPES = {  # hidden, heads x head_dim, kv_heads x head_dim, mlp, vocab
    "qwen2.5-0.5b": (896, 14 * 64, 2 * 64, 4864, 151936),
    "qwen3-0.6b": (1024, 16 * 128, 8 * 128, 3072, 151936),
}
ROWS = (1, 4, 16, 64, 512)


def matrices(shape: str) -> list[tuple[str, int, int, bool]]:
    """(name, out_dim, in_dim, gated) of one layer's matmuls and the LM head."""
    hidden, q, kv, mlp, vocab = SHAPES[shape]
    return [
        ("qkv", q + 2 * kv, hidden, False),
        ("o", hidden, q, False),
        ("gate|up", mlp, hidden, True),
        ("down", hidden, mlp, False),
        ("head", vocab, hidden, False),
    ]


def timed(fn, seconds: float) -> float:
    """Seconds per call: one warm call, then as many as fit in `seconds` (at least 3)."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"native": native.load(), "avx2": native.load(("-mno-avx512f",))}
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, out_dim, in_dim, gated in matrices(args.shape):
        weight = torch.randn(2 * out_dim if gated else out_dim, in_dim, generator=gen) * in_dim**-0.5
        packed = kernels["native"].pack_linear(weight, gated=gated)
        for rows in ROWS:
            if name == "head" and rows > 64:  # prefill computes the last position's logits only
                continue
            x = torch.randn(rows, in_dim, generator=gen)
            flop = 2 * rows * in_dim * weight.shape[0]

            def onednn(x=x, weight=weight, gated=gated):
                y = F.linear(x, weight)
                return F.silu(y[:, : y.shape[1] // 2]) * y[:, y.shape[1] // 2 :] if gated else y

            impls = {
                key: (lambda k=k, x=x, p=packed, n=out_dim, g=gated: k.linear(x, p, n, gated=g))
                for key, k in kernels.items()
            }
            impls["onednn"] = onednn
            cases.append((name, rows, flop, impls))
    results = {}
    for round_ in range(args.rounds):
        for name, rows, flop, impls in cases:
            row = results.setdefault(f"{name} x{rows}", {key: [] for key in impls})
            for key, fn in impls.items():
                row[key].append(flop / timed(fn, args.seconds) / 1e9)
        print(
            f"round {round_ + 1}: "
            + ", ".join(
                f"{case} {r['native'][-1]:.0f}/{r['avx2'][-1]:.0f}/{r['onednn'][-1]:.0f}" for case, r in results.items()
            ),
            flush=True,
        )
    summary = {}
    print(
        f"{'matrix x rows':>16} {'native':>8} {'avx2':>8} {'onednn':>8}   GFLOP/s (median)   native/avx2  native/onednn"
    )
    for case, r in results.items():
        med = {key: statistics.median(v) for key, v in r.items()}
        vs_avx2 = statistics.median(a / b for a, b in zip(r["native"], r["avx2"]))
        vs_onednn = statistics.median(a / b for a, b in zip(r["native"], r["onednn"]))
        summary[case] = {"gflops": med, "native_vs_avx2": vs_avx2, "native_vs_onednn": vs_onednn}
        print(
            f"{case:>16} {med['native']:8.1f} {med['avx2']:8.1f} {med['onednn']:8.1f}{'':21}{vs_avx2:9.2f}x {vs_onednn:12.2f}x"
        )
    print(json.dumps({"shape": args.shape, "threads": args.threads, "rounds": args.rounds, "summary": summary}))


if __name__ == "__main__":
    main()
