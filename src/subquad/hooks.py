"""Explicit hooks between mechanisms, gradient checkpointing and the training loop.

**Auxiliary losses.** A mechanism that trains something besides the task (routing's commitment
loss β·‖x̂ − sg(μ)‖² pulls queries and keys towards their centroids) hands the loss of each
forward to the innermost active collector, and the training loop adds them to its loss::

    with subquad.hooks.auxiliary_losses() as losses:
        task_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss = task_loss + sum(losses)

Without an active collector ``add_auxiliary_loss`` drops the loss: evaluation code need not know
about them. A loss that could train something (it carries a gradient) warns once per place, with
``UncollectedLossWarning``, as a training loop that forgot the collector would otherwise train
without it silently; filter that warning where dropping it is meant.

**Recomputation.** Gradient checkpointing (``torch.utils.checkpoint``, non-reentrant) runs a
forward a second time during the backward pass, to rebuild the activations it did not keep. A
forward that moves state (routing's EMA update of its centroids) or reports a loss must do either
once, and the recomputation must see the state as the original forward saw it, or it rebuilds
other activations than those the forward used. Pass ``checkpoint_contexts`` as ``context_fn``:

- the recomputation runs under ``recomputing()``: ``is_recomputing()`` is True there, and a
  mechanism skips its state updates and its auxiliary losses;
- ``replayed(x)`` returns ``x`` in the original forward and keeps a copy of it; in the
  recomputation it returns that copy (the k-th call gets the k-th copy: the recomputation runs the
  same code in the same order). Routing passes its centroids through it.

This module imports nothing from subquad, so mechanisms and layers can all use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "AuxiliaryLosses",
    "UncollectedLossWarning",
    "add_auxiliary_loss",
    "auxiliary_losses",
    "checkpoint_contexts",
    "is_recomputing",
    "recomputing",
    "replayed",
]


class AuxiliaryLosses(list["Tensor"]):
    """The auxiliary losses (scalar tensors) of the forwards run inside one ``auxiliary_losses()``
    block, in the order they were added; ``names`` holds the name of each."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def named(self) -> list[tuple[str, Tensor]]:
        """``(name, loss)`` pairs, e.g. to log each."""
        return list(zip(self.names, self, strict=True))


class _Replay:
    """The values ``replayed`` kept in one checkpointed forward, and how many its recomputation read."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.read = 0

    def next(self) -> Any:
        if self.read >= len(self.values):
            raise RuntimeError(
                "a checkpoint's recomputation replayed more values than its forward kept: the checkpointed "
                "function must run the same code in the same order both times"
            )
        self.read += 1
        return self.values[self.read - 1]


class _Frame:
    """One checkpointed call the running code is inside: its original forward (``replaying``
    False: ``replayed`` keeps values in ``replay``) or its recomputation (True: it reads them
    back). A context manager that can be entered again, as a recomputation can run again."""

    def __init__(self, replay: _Replay | None, replaying: bool) -> None:
        self.replay, self.replaying = replay, replaying
        self._tokens: list[contextvars.Token[tuple[_Frame, ...]]] = []

    def __enter__(self) -> None:
        if self.replaying and self.replay is not None:
            self.replay.read = 0  # each recomputation reads the values from the start
        self._tokens.append(_FRAMES.set((*_FRAMES.get(), self)))

    def __exit__(self, *exc: object) -> None:
        _FRAMES.reset(self._tokens.pop())


_COLLECTOR: contextvars.ContextVar[AuxiliaryLosses | None] = contextvars.ContextVar("subquad_collector", default=None)
_FRAMES: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar("subquad_frames", default=())


@contextlib.contextmanager
def auxiliary_losses() -> Iterator[AuxiliaryLosses]:
    """Collect the auxiliary losses of the forwards run inside the block: a list of scalar tensors
    to add to the task loss, ``loss = task_loss + sum(losses)``. Blocks nest; a loss goes to the
    innermost one only."""
    losses = AuxiliaryLosses()
    token = _COLLECTOR.set(losses)
    try:
        yield losses
    finally:
        _COLLECTOR.reset(token)


class UncollectedLossWarning(UserWarning):
    """An auxiliary loss that could train something was dropped: no ``auxiliary_losses()`` collector
    was active around the forward that computed it."""


def add_auxiliary_loss(name: str, loss: Tensor) -> None:
    """Hand ``loss`` (a scalar tensor, differentiable) to the innermost active collector. Nothing
    happens while a checkpoint recomputes (its forward already handed it over); without a collector
    the loss is dropped, with an ``UncollectedLossWarning`` (once per place) where it carries a
    gradient."""
    if is_recomputing():
        return
    losses = _COLLECTOR.get()
    if losses is not None:
        losses.append(loss)
        losses.names.append(name)
    elif loss.requires_grad:
        warnings.warn(
            f"the auxiliary loss {name!r} of this training forward is dropped: no collector is active. Run the "
            "forward inside `with subquad.hooks.auxiliary_losses() as losses:` and add sum(losses) to the loss "
            "(or give the loss a weight of 0 to train without it)",
            UncollectedLossWarning,
            stacklevel=3,
        )


def recomputing(replay: _Replay | None = None) -> _Frame:
    """A context manager marking the code inside as the recomputation of a checkpointed forward
    (``is_recomputing()`` is True there). With ``replay`` (``checkpoint_contexts`` passes it),
    ``replayed`` returns the values the original forward kept; without, its argument."""
    return _Frame(replay, True)


def is_recomputing() -> bool:
    """Whether the running code is a checkpoint's recomputation of a forward already run once:
    the state updates and auxiliary losses of that forward have happened, and must not again."""
    return any(frame.replaying for frame in _FRAMES.get())


def checkpoint_contexts() -> tuple[_Frame, _Frame]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the
    original forward keeps what it passes through ``replayed``, and its recomputation runs under
    ``recomputing()`` with those values. Torch calls it once per checkpointed call."""
    replay = _Replay()
    return _Frame(replay, False), recomputing(replay)


def replayed(x: Tensor) -> Tensor:
    """``x`` as the original forward saw it: in a checkpointed forward, ``x`` (a copy is kept); in
    its recomputation, that copy; elsewhere, ``x``. For state that the forward itself changes in
    place afterwards (routing's centroids). Checkpoints may nest: a forward inside a
    recomputation keeps the replayed value for its own recomputation."""
    value, recording = x, []
    for frame in reversed(_FRAMES.get()):  # innermost first, down to the recomputation being run
        if not frame.replaying:
            recording.append(frame.replay)
            continue
        if frame.replay is not None:
            value = frame.replay.next()
        break
    for replay in recording:
        replay.values.append(value.clone())
    return value
