"""Core lending: with a staleness budget, the trainer borrows the generator's threads while the
generator has nothing to decode, and hands them back when it has.

With a budget the generator and the trainer run at once and split the cores (generator_threads +
trainer_threads <= cores). On a small machine the trainer is then usually the bottleneck while the
generator waits for admission (it may not run further ahead than the budget): measured on 2
cores with the native decode kernels, the trainer at 1 thread was never idle while the generator
was idle 70-90% of the time and the machine 20-45% idle. Lending makes the split
work-conserving without oversubscribing the cores:

- the generator raises `wants` before each decode step and lowers it when it goes idle or blocks
  on a full queue to the environment; before decoding it waits until the trainer has handed its
  threads back, at most `max_wait_s`;
- the trainer, inside a training step (`TrainerLending.borrowing`), looks at the flag at every
  decoder layer's forward and backward (a few ms apart): it takes the generator's threads when
  they are not wanted and gives them back when they are; leaving the step gives them back.

Guaranteed: outside a training step the trainer runs on its own threads; the generator never
waits longer than `max_wait_s` for its threads (after that it decodes anyway, and the two
oversubscribe the cores until the trainer's next layer boundary); results do not change (only
thread counts do; float sums may round differently with more threads).
Not guaranteed: that borrowing pays. It does when the trainer is the bottleneck and the
generator idles; `pipeline.lend_idle_cores = false` turns it off.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

WAIT_POLL_S = 0.0002


class LendingFlags:
    """Two integers in shared memory: [generator wants its threads, trainer holds them].
    Created by the trainer, handed to the generator process with its spec (picklable at spawn)."""

    def __init__(self, ctx):
        self._flags = ctx.Array("i", 2, lock=False)

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

    # ---- trainer side ----------------------------------------------------------------------
    @property
    def wanted(self) -> bool:
        return bool(self._flags[0])

    def set_held(self, held: bool) -> None:
        self._flags[1] = int(held)


class TrainerLending:
    """The trainer's half: hooks on the policy's decoder layers that take or return the
    generator's `lent_threads` on top of the trainer's `own_threads`."""

    def __init__(self, flags: LendingFlags, own_threads: int, lent_threads: int):
        self.flags, self.own, self.lent = flags, own_threads, lent_threads
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
        """Take the lent threads if the generator does not want them; give them back if it does."""
        if not self.active:
            return
        wanted = self.flags.wanted
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
