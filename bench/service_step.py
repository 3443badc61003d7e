"""The Tinker service's training step on a multi-turn RL batch: a baseline revision against this tree.

tinker-cookbook's multi-turn RL recipes (multiplayer_rl/guess_number) send one datum per turn, each
repeating the whole conversation before it: the rendered history of a turn is not the sampled
tokens of the turn before (the renderer closes the reply its own way), so the cookbook cannot merge
an episode's turns into one datum. This builds such a batch with the recipe's shape on the
service's own embedded model (the one `gapless serve-training --task.name math` serves) and times
`TrainingRun.forward_backward` + `optim_step` (importance_sampling, LoRA rank 16, one torch thread
as the slow test's service runs) in two worker processes, one importing `--baseline` (a git
revision, exported to a temporary directory) and one this working tree, interleaved round by
round (A B, B A, ...). Each worker builds the same model and batch and takes one warm-up step.
Shape (defaults): `--groups` 2 groups x `--group-size` 2 episodes x `--turns` 10 turns; a
240-token system prompt and question shared by a group; each turn samples 8 tokens, which the next
turn's history re-renders as 8 other tokens, then a 130-token reply. Reported: each round's
seconds, the medians, baseline / tree, the loss of each warm-up step (equal within float rounding:
same weights, same datums), and the CPU other processes used during each round.

    PYTHONPATH=src python bench/service_step.py --baseline REV [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def episode_datums(vocab: int, groups: int, group_size: int, turns: int, seed: int) -> list:
    """One datum per turn, as the cookbook's trajectory_to_data builds them when turns do not extend."""
    import torch

    from gapless.service.wire import DatumIn

    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    datums = []
    for _ in range(groups):
        first = tokens(240)  # system prompt + question: the same for the group's episodes
        for _ in range(group_size):
            history = list(first)
            for _ in range(turns):
                sampled = tokens(8)
                full = history + sampled
                n = len(full) - 1
                advantages = torch.zeros(n)
                advantages[len(history) - 1 :] = 0.5
                datums.append(
                    DatumIn(
                        full[:-1],
                        {
                            "target_tokens": torch.tensor(full[1:]),
                            "logprobs": torch.where(advantages != 0, -2.0, 0.0),
                            "advantages": advantages,
                        },
                    )
                )
                history = history + tokens(8) + tokens(130)  # the reply re-rendered, then the other player
    return datums


def worker(args) -> None:
    """Build the model, the batch and a run; one step per 'step' line on stdin, one JSON line out."""
    import torch

    from gapless.cli import _load
    from gapless.lora import LoraSpec
    from gapless.service.models import AdamParams, BaseModels, TrainingRun
    from gapless.service.server import default_model

    torch.set_num_threads(args.threads)
    cfg = _load(["--task.name", '"math"', "--warmstart.steps", "0"])
    base = BaseModels({}, builtin=lambda: default_model(cfg, log=lambda *a: None)).get("gapless-tiny")
    datums = episode_datums(base.vocab_size, args.groups, args.group_size, args.turns, seed=0)
    run = TrainingRun("bench", base, LoraSpec(rank=16, seed=0))
    print(json.dumps({"datums": len(datums), "tokens": sum(len(d.tokens) for d in datums)}), flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        _, metrics = run.forward_backward(datums, "importance_sampling", {}, forward_only=False)
        run.optim_step(AdamParams(learning_rate=1e-4))
        print(json.dumps({"s": time.perf_counter() - t0, "loss": metrics["loss:sum"]}), flush=True)


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` have used so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, idle and iowait excluded)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def start(src: Path, args) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--worker", "--threads", str(args.threads), "--groups", str(args.groups),
            "--group-size", str(args.group_size), "--turns", str(args.turns)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def ask(proc: subprocess.Popen) -> dict:
    proc.stdin.write("step\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="git revision to compare against (required unless --worker)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the slow test's service runs 1)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if not args.baseline:
        parser.error("--baseline REV is required")
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", args.baseline, "src"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        procs = {"baseline": start(Path(tmp) / "src", args), "tree": start(repo / "src", args)}
        shape = {name: json.loads(p.stdout.readline()) for name, p in procs.items()}
        warm = {name: ask(p) for name, p in procs.items()}
        times: dict[str, list[float]] = {"baseline": [], "tree": []}
        loads = []
        for r in range(args.rounds):
            order = ("baseline", "tree") if r % 2 == 0 else ("tree", "baseline")
            pids = [p.pid for p in procs.values()]
            t0, busy0, own0 = time.perf_counter(), busy_s(), cpu_s(pids)
            for name in order:
                times[name].append(ask(procs[name])["s"])
            loads.append(max(0.0, (busy_s() - busy0) - (cpu_s(pids) - own0)) / (time.perf_counter() - t0))
            print(f"round {r} ({', '.join(order)}): baseline {times['baseline'][-1]:.3f} s, tree "
                  f"{times['tree'][-1]:.3f} s, other processes {loads[-1]:.1f} cores", flush=True)  # fmt: skip
        for p in procs.values():
            p.stdin.close()
            p.wait()
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "baseline": args.baseline,
        **shape["tree"],
        "warmup_loss": {name: w["loss"] for name, w in warm.items()},
        "seconds": times,
        "median_s": med,
        "baseline_over_tree": med["baseline"] / med["tree"],
        "other_cores_median": statistics.median(loads),
        "threads": args.threads,
    }
    print(f"median: baseline {med['baseline']:.3f} s, tree {med['tree']:.3f} s, "
          f"baseline / tree {result['baseline_over_tree']:.2f}x")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
