"""Cost models: how long each piece of the pipeline takes, from measurement or a stated formula.

Every cost is in seconds on one unit of the resource that runs it. With `placement = "split"`
(generator replicas and trainer ranks on their own devices) a unit is a whole replica or the
whole trainer; with `placement = "shared"` (every actor on one pool of cores or devices, as on
this project's 2-core machine) a unit is one core (or device), and an actor given x units runs
at speed `speed(x) = min(x, 1) + parallel_efficiency * max(x - 1, 0)`; with `barrier_teams`
(CPU cores) a multi-threaded decode or training step runs at one thread's share while the cores
are oversubscribed (keeping `barrier_efficiency` of that share), every job keeps
`contention_efficiency` of its speed while the pool is oversubscribed, and with `decode_first` a
one-thread decode runs at its speed alone while the others share the rest (pool.py). On a shared
pool the sandbox's programs count for `sandbox_runnable` x their number (1.0: each a thread that
is always runnable; fitted below 1 where the scheduler gives them less than that, as it does on
some machines: docs/simulator.md; that they block on process start-up and pipes is the likely
reason, not an established one).

    decode step with b running sequences   step_s + row_s * b                (continuous batching)
    prefill of n tokens                     prefill_token_s * n
    one group's response lengths            LengthModel: truncated at the cap with probability
                                            truncated_frac, else lognormal(mean, sigma) below the cap
    scoring one group                       cpu_s on the pool (shared; its G programs use up to
                                            min(G, sandbox.concurrency) cores, the groups scored at
                                            once sandbox.concurrency in all, each times
                                            sandbox_runnable, the share of their threads the programs
                                            count for; lognormal across groups with mean cpu_s, shape
                                            cpu_sigma) + a wait with no CPU, lognormal through
                                            (wait_p50_s, wait_p99_s)
    training step on T token positions      step_s + token_s * T, T the step's rows (prompt_tokens +
                                            response) cut into micro-batches as the trainer cuts
                                            them, each padded to its longest row (micro_batches.py)
    weight relay                            latency_s + bytes / bandwidth_bps (trainer and generator)

`roofline_costs` derives them from a device spec (FLOP/s, memory bandwidth) and a model size:
a decode step reads the weights once (memory-bound) plus, per row, its KV cache and 2N FLOPs; a
trained token costs 6N FLOPs at the trainer's MFU. `calibrate.py` fits them to a real run.
Guaranteed: every cost is finite and non-negative (`Costs.check`). Not guaranteed: anything the
formulas leave out (attention FLOPs, communication inside a rank, memory limits on batch size
other than `generator.max_batch`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from statistics import NormalDist

QUANTILES = 1024


@dataclass
class GenerationCost:
    step_s: float  # fixed part of one decode step: reading the weights, per-op overhead
    row_s: float  # added per running sequence per decode step
    prefill_token_s: float = 0.0

    def decode_step_s(self, rows: float) -> float:
        return self.step_s + self.row_s * rows


@dataclass
class LengthModel:
    mean_untruncated: float  # mean response length (tokens) of the responses that end before the cap
    sigma: float = 0.5  # lognormal shape; > 1 is a heavy tail
    truncated_frac: float = 0.0  # share of responses that run to the cap

    def sample(self, rng: random.Random, cap: int, n: int = 1) -> list[int]:
        """n lengths, drawn from the distribution's 1,024 quantiles (exact enough for costs, and
        one C call per group instead of n lognormal draws)."""
        return rng.choices(self.quantiles(cap), k=n)

    def quantiles(self, cap: int) -> list[int]:
        cached = self.__dict__.get("_quantiles")
        if cached is not None and cached[0] == cap:
            return cached[1]
        mu = math.log(max(self.mean_untruncated, 1.0)) - self.sigma**2 / 2
        normal = NormalDist()
        table = []
        for i in range(QUANTILES):
            u = (i + 0.5) / QUANTILES
            if u >= 1 - self.truncated_frac:
                table.append(cap)
                continue
            z = normal.inv_cdf(u / (1 - self.truncated_frac))
            table.append(max(1, min(cap - 1 if cap > 1 else 1, round(math.exp(mu + self.sigma * z)))))
        self.__dict__["_quantiles"] = (cap, table)
        return table


@dataclass
class EnvCost:
    cpu_s: float = 0.0  # pool seconds per group (shared placement; split: counted as wait)
    wait_p50_s: float = 0.0  # per group, no CPU (a remote judge, a sandbox start)
    wait_p99_s: float = 0.0
    cpu_sigma: float = 0.5  # lognormal spread of cpu_s across groups (programs differ); 0 = constant

    def sample_cpu(self, rng: random.Random) -> float:
        if self.cpu_s <= 0 or self.cpu_sigma <= 0:
            return self.cpu_s
        return rng.lognormvariate(math.log(self.cpu_s) - self.cpu_sigma**2 / 2, self.cpu_sigma)

    def sample_wait(self, rng: random.Random) -> float:
        if self.wait_p50_s <= 0:
            return 0.0
        sigma = max(math.log(max(self.wait_p99_s, self.wait_p50_s) / self.wait_p50_s), 0.0) / 2.326  # z(0.99)
        return rng.lognormvariate(math.log(self.wait_p50_s), sigma) if sigma > 0 else self.wait_p50_s


@dataclass
class TrainerCost:
    token_s: float  # per padded token position (prompt + response) on one trainer rank (split) or core (shared)
    step_s: float = 0.0  # per optimizer step, whatever its size


@dataclass
class RelayCost:
    latency_s: float = 0.0
    bytes: float = 0.0
    bandwidth_bps: float = float("inf")

    @property
    def push_s(self) -> float:
        return self.latency_s + (self.bytes / self.bandwidth_bps if self.bandwidth_bps > 0 else 0.0)


@dataclass
class Costs:
    generation: GenerationCost
    lengths: LengthModel
    trainer: TrainerCost
    env: EnvCost = field(default_factory=EnvCost)
    relay: RelayCost = field(default_factory=RelayCost)
    prompt_tokens: int = 32  # mean prompt length (tokens)
    parallel_efficiency: float = 1.0  # shared placement: value of each unit beyond the first
    source: str = "given"  # where the figures come from (a run directory, a device spec)
    barrier_teams: bool = False  # shared placement on CPU cores: decode and training are OpenMP teams (pool.py)
    decode_first: bool = False  # shared placement on CPU cores: a one-thread decode is served first (pool.py)
    barrier_efficiency: float = 1.0  # with barrier_teams: share of one thread's speed an oversubscribed team keeps
    contention_efficiency: float = (
        1.0  # shared placement: share of its speed every job keeps while the pool is oversubscribed
    )
    sandbox_runnable: float = 1.0  # shared placement: share of their threads the sandbox's programs count for (run.py)

    def check(self) -> "Costs":
        for part in (self.generation, self.lengths, self.trainer, self.env, self.relay):
            for f in fields(part):
                value = getattr(part, f.name)
                if not (value >= 0) or (math.isinf(value) and f.name != "bandwidth_bps"):
                    raise ValueError(f"cost {type(part).__name__}.{f.name} = {value} must be finite and >= 0")
        if self.generation.step_s + self.generation.row_s <= 0 or self.trainer.token_s + self.trainer.step_s <= 0:
            raise ValueError("generation and training costs must not both be zero: the simulation would not advance")
        for name in ("parallel_efficiency", "barrier_efficiency", "contention_efficiency", "sandbox_runnable"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"cost {name} = {getattr(self, name)} must be in (0, 1]")
        return self

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "Costs":
        return cls(
            GenerationCost(**data["generation"]),
            LengthModel(**data["lengths"]),
            TrainerCost(**data["trainer"]),
            EnvCost(**data.get("env", {})),
            RelayCost(**data.get("relay", {})),
            data.get("prompt_tokens", 32),
            data.get("parallel_efficiency", 1.0),
            data.get("source", "given"),
            data.get("barrier_teams", False),
            data.get("decode_first", False),
            data.get("barrier_efficiency", 1.0),
            data.get("contention_efficiency", 1.0),
            data.get("sandbox_runnable", 1.0),
        ).check()

    @classmethod
    def load(cls, path: str | Path) -> "Costs":
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class DeviceSpec:
    flops: float  # dense peak FLOP/s of one device at the training precision
    memory_bw: float  # bytes/s of one device
    interconnect_bw: float = 50e9  # bytes/s for the weight relay (trainer -> generators)


def roofline_costs(
    device: DeviceSpec,
    params: float,
    bytes_per_param: float,
    kv_bytes_per_token: float,
    gpus_per_replica: int,
    mean_context: float,
    lengths: LengthModel,
    gen_efficiency: float,
    train_mfu: float,
    prompt_tokens: int,
    relay_latency_s: float = 0.0,
    decode_step_overhead_s: float = 0.0,
) -> Costs:
    """Costs of a replica of `gpus_per_replica` devices (tensor parallel, perfect scaling assumed)
    and a trainer rank (data parallel: a step divides its tokens among the ranks), from the roofline:
    decode step = `decode_step_overhead_s` + weight bytes / bandwidth (once per step) + per row (2N
    FLOPs at gen_efficiency of peak + its KV cache of `mean_context` tokens read once); trained
    token = 6N FLOPs at train_mfu."""
    g = gpus_per_replica
    step_s = decode_step_overhead_s + params * bytes_per_param / (device.memory_bw * g)  # the weights read once
    row_s = 2 * params / (device.flops * gen_efficiency * g) + kv_bytes_per_token * mean_context / (
        device.memory_bw * g
    )
    prefill_s = 2 * params / (device.flops * gen_efficiency * g)
    token_s = 6 * params / (device.flops * train_mfu)  # on one rank; the step divides by the ranks
    relay = RelayCost(relay_latency_s, params * bytes_per_param, device.interconnect_bw)
    return Costs(
        GenerationCost(step_s, row_s, prefill_s),
        lengths,
        TrainerCost(token_s),
        relay=relay,
        prompt_tokens=prompt_tokens,
        source="roofline",
    ).check()
