"""Core lending: with a staleness budget, the trainer borrows the generator's threads while the
generator has nothing to decode and the environment scores nothing, and hands them back when
either needs the cores.

With a budget the generator and the trainer run at once and split the cores (generator_threads +
trainer_threads <= cores). On a small machine the trainer is then usually the bottleneck while the
generator waits for admission (it may not run further ahead than the budget): measured on 2
cores with the native decode kernels, the trainer at 1 thread was never idle while the generator
was idle 70-90% of the time and the machine 20-45% idle. Lending makes the split
work-conserving without oversubscribing the cores:

- the generator raises `wants` before each decode step and lowers it when it goes idle or blocks
  on a full queue to the environment; before decoding it waits until the trainer has handed its
  threads back, at most `max_wait_s`;
- an environment actor counts the groups it is scoring (`scoring()`): the sandbox's programs run
  on the same cores, and a trainer team of two threads beside them is slower than one thread
  (below); with `pipeline.lend_while_scoring = false` (the default) the trainer treats a busy
  environment as a generator that wants its threads;
- the trainer, inside a training step (`TrainerLending.borrowing`), looks at the flags at every
  decoder layer's forward and backward (a few ms apart): it takes the generator's threads when
  nobody needs them and gives them back when somebody does; leaving the step gives them back.

Why the environment counts: torch's threads meet at a barrier after every parallel region, and
one preempted thread holds the rest: beside the sandbox's scoring a two-thread training step is
slower than a one-thread one, so a borrowed thread costs more than it gives
(`bench/contention.py --part train-threads`; the pipeline figures: bench/pipeline.py's
`B:lend-scoring` cells, recorded in docs/lab/).

Guaranteed: outside a training step the trainer runs on its own threads; the generator never
waits longer than `max_wait_s` for its threads (after that it decodes anyway, and the two
oversubscribe the cores until the trainer's next layer boundary); results do not change (only
thread counts do; float sums may round differently with more threads).
Not guaranteed: that borrowing pays. It does when the trainer is the bottleneck and the
generator idles; `pipeline.lend_idle_cores = false` turns it off. The environment's count covers
a group's whole scoring, its waits without CPU included (a remote judge, `task.score_delay_s`):
where scoring uses no local CPU, `pipeline.lend_while_scoring = true` lends through it. A
multi-turn task's episodes (their tool calls) are not counted.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

WAIT_POLL_S = 0.0002


class LendingFlags:
    """Shared memory: [generator wants its threads, trainer holds them], and the number of groups
    the environment actors are scoring (a counter with a lock: several processes and their
    worker threads add to it). Created by the trainer, handed to the generator and environment
    processes with their specs (picklable at spawn)."""

    def __init__(self, ctx):
        self._flags = ctx.Array("i", 2, lock=False)
        self._scoring = ctx.Value("i", 0)

    # ---- generator side --------------------------------------------------------------------
    def want(self, max_wait_s: float) -> float:
        """Ask for the threads back before decoding; returns the seconds waited."""
        self._flags[0] = 1
        if not self._flags[1]:
            return 0.0
        start = time.perf_counter()
        while self._flags[1] and time.perf_counter() - start < max_wait_s:
            time.sleep(WAIT_POLL_S)
        return time.perf_counter() - start

    def idle(self) -> None:
        """Nothing to decode: the trainer may borrow the threads."""
        self._flags[0] = 0

    # ---- environment side ------------------------------------------------------------------
    @contextmanager
    def scoring(self) -> Iterator[None]:
        """Around the scoring of one group: the sandbox's programs are on the cores meanwhile."""
        with self._scoring.get_lock():
            self._scoring.value += 1
        try:
            yield
        finally:
            with self._scoring.get_lock():
                self._scoring.value -= 1

    # ---- trainer side ----------------------------------------------------------------------
    @property
    def wanted(self) -> bool:
        return bool(self._flags[0])

    @property
    def environment_busy(self) -> bool:
        return self._scoring.get_obj().value > 0  # an aligned int read: no lock on the layer-check path

    def set_held(self, held: bool) -> None:
        self._flags[1] = int(held)


class TrainerLending:
    """The trainer's half: hooks on the policy's decoder layers that take or return the
    generator's `lent_threads` on top of the trainer's `own_threads`; `while_scoring`: borrow
    also while the environment scores (pipeline.lend_while_scoring)."""

    def __init__(self, flags: LendingFlags, own_threads: int, lent_threads: int, while_scoring: bool = False):
        self.flags, self.own, self.lent, self.while_scoring = flags, own_threads, lent_threads, while_scoring
        self.active = self.held = False
        self.checks = self.held_checks = 0  # for the borrowed fraction

    def install(self, model: torch.nn.Module) -> int:
        """Hook every decoder layer (`model.model.layers`); returns how many were hooked (0: the
        model has no such list, and lending never happens)."""
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        for layer in layers:
            layer.register_forward_pre_hook(self._forward_hook, with_kwargs=True)
        return len(layers)

    def _forward_hook(self, module, args, kwargs) -> None:
        self.check()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._backward_hook)  # runs when this layer's backward is done

    def _backward_hook(self, grad: torch.Tensor) -> None:
        self.check()

    def check(self) -> None:
        """Take the lent threads if neither the generator nor (unless `while_scoring`) the
        environment needs the cores; give them back if one does."""
        if not self.active:
            return
        wanted = self.flags.wanted or (not self.while_scoring and self.flags.environment_busy)
        if wanted and self.held:
            self._give_back()
        elif not wanted and not self.held:
            self.flags.set_held(True)
            torch.set_num_threads(self.own + self.lent)
            self.held = True
        self.checks += 1
        self.held_checks += self.held

    def _give_back(self) -> None:
        torch.set_num_threads(self.own)
        self.held = False
        self.flags.set_held(False)

    @contextmanager
    def borrowing(self) -> Iterator[None]:
        """The span in which the hooks may borrow (a training step)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
            if self.held:
                self._give_back()

    def borrowed_frac(self) -> float:
        """Share of the layer checks since the last call at which the trainer held the lent threads."""
        frac = self.held_checks / self.checks if self.checks else 0.0
        self.checks = self.held_checks = 0
        return frac
