"""Decoding caches for autoregressive generation.

A mechanism names its decoder in its registry record (``Mechanism.decoder``): a subclass of
``Decoder``. Layers build one per head group with ``decoder(mechanism, config, state)`` and call
``step(q, k, v, **tensors)`` with the new tokens. ``Decoder.step`` checks every step the same way
and keeps the length; a subclass writes only its maths, in ``_step``. A mechanism without a decoder
cannot decode from a cache: generate without one.

**The handover.** ``absorb(q, k, v, key_padding_mask, **tensors)`` takes a prompt that the parallel
causal pass has just attended and builds the decoder's state from it (the keys a window still
reaches, the running sums), so the prompt is attended once. Under padding, each row's positions
count its real tokens: a row's sinks are its first real tokens, and rows of different lengths
decode as if alone. Decoders that can (``absorbs``) implement ``_absorb``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from subquad._contain import contained
from subquad._validate import check_grouped_inputs
from subquad.kernels.tuning import TUNING
from subquad.ops.kept_window import Kept

if TYPE_CHECKING:
    from subquad.registry import Config, Mechanism

__all__ = ["Decoder", "KVCache", "room_for"]

_SIZES = ("B", "H", "D", "Dv")  # the sizes of a step, in the order of ``Decoder.shape``


class Decoder(ABC):
    """Base class of decoding caches: the checks every step needs, and the length bookkeeping.

    ``step(q, k, v, **tensors)`` takes the next ``T`` tokens of a causal self-attention sequence,
    their queries and keys ``(B, H, T, D)``, values ``(B, H, T, Dv)`` and the mechanism's extra
    tensors for them, and returns their outputs ``(B, H, T, Dv)``. It checks, once, here:

    - the attention contract (``check_attention_inputs``: 4-D tensors of one dtype on one device),
      and as many queries as keys, since a step's tokens are both; a ``grouped`` decoder takes
      grouped-query keys and values as they are (a divisor of q's heads, as ``enable_gqa``);
    - that B, H, D and Dv (those of them named in ``fixed``), the dtype and the device are those of
      the first step: what the decoder holds was computed for them, so a new batch needs a new
      cache. This is checked before anything is written, so a refused step leaves the cache as it
      was;
    - that the extra tensors are named in ``Mechanism.tensor_args`` and lie on the inputs' device
      (None ones are left out, as if not passed);

    then runs the subclass's ``_step`` on the checked inputs and advances ``length`` by ``T``.
    Inside ``_step``, ``length`` is still the number of tokens before this step: the position of
    the step's first token.

    Class attributes of a subclass:
        recurrent: what it holds is O(1) per head in the prefix length (``Mechanism.recurrent``).
        description: one line for ``subquad list``.
        holds: ``"keys"`` for a cache of past keys and values, ``"state"`` for a summary of them;
            it words the error for a step of other sizes.
        fixed: the sizes, of ``("B", "H", "D", "Dv")``, that a later step must repeat.
        absorbs: it implements ``_absorb``, the handover from a parallel prefill.
        grouped: it holds grouped-query keys and values unrepeated (its ``_step`` and ``_absorb``
            get k and v with a divisor of q's heads, and keep that count).
        scale: the softmax scale of decoders that have one (None: 1/√D); set it after building.

    Args:
        mechanism: the mechanism's registry record.
        config: its config.
        state: the layer's state module for it (``Mechanism.state``), or None.
    """

    recurrent: ClassVar[bool] = False
    description: ClassVar[str] = ""
    holds: ClassVar[str] = "state"
    fixed: ClassVar[tuple[str, ...]] = _SIZES
    absorbs: ClassVar[bool] = False
    grouped: ClassVar[bool] = False
    scale: float | None = None

    def __init__(self, mechanism: Mechanism, config: Config, state: torch.nn.Module | None) -> None:
        self.mechanism, self.config, self.state = mechanism, config, state
        self.shape: tuple[int, int, int, int] | None = None  # (B, H, D, Dv) of the first step
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.length = 0  # tokens decoded so far

    def step(self, q: Tensor, k: Tensor, v: Tensor, **tensors: Tensor | None) -> Tensor:
        """Attend the ``T`` new queries ``(B, H, T, D)`` causally to the prefix and the new keys.

        Args:
            q, k: ``(B, H, T, D)``; v: ``(B, H, T, Dv)``: the next ``T`` tokens.
            **tensors: the mechanism's extra tensors for those tokens.

        Returns:
            ``(B, H, T, Dv)``.
        """
        shape = check_grouped_inputs(q, k, v, None, True, None, self.grouped)
        if shape.queries != shape.keys:
            raise ValueError(f"a decoding step takes as many queries as keys, got {shape.queries} and {shape.keys}")
        sizes = (shape.batch, shape.heads, shape.head_dim, shape.value_dim)
        _check_held(self, sizes, q, k, v)
        given = _check_tensors(self.mechanism, tensors, q.device)
        out = self._step(q, k, v, **given)
        if self.shape is None:
            self.shape, self.dtype, self.device = sizes, q.dtype, q.device
        self.length += shape.keys
        return out

    def absorb(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None, **tensors: Tensor | None
    ) -> None:
        """Take over a prompt the parallel causal pass has attended: ``q``, ``k`` ``(B, H, S, D)``,
        ``v`` ``(B, H, S, Dv)``, its real tokens ``key_padding_mask`` ``(B, S)`` (None: all) and the
        mechanism's extra tensors for it. The decoder must be new; ``step`` continues after it."""
        if not self.absorbs:
            raise ValueError(
                f"{self.mechanism.name}'s decoder cannot take over a parallel prefill; step it over the prompt instead"
            )
        if self.length:
            raise ValueError(f"this decoder has already decoded {self.length} tokens; absorb a prompt into a new one")
        shape = check_grouped_inputs(q, k, v, key_padding_mask, True, None, self.grouped)
        if shape.queries != shape.keys:
            raise ValueError(f"a prompt has as many queries as keys, got {shape.queries} and {shape.keys}")
        given = _check_tensors(self.mechanism, tensors, q.device)
        self._absorb(q, k, v, key_padding_mask, **given)
        self.shape = (shape.batch, shape.heads, shape.head_dim, shape.value_dim)
        self.dtype, self.device, self.length = q.dtype, q.device, shape.keys

    def _absorb(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, **tensors: Tensor) -> None:
        """Build the state of a checked prompt (``absorbs`` decoders)."""
        raise NotImplementedError

    def select_rows(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (in that order, repeats allowed): beam search's reorder, a
        batch's selection. Every tensor the decoder holds is batch-first."""
        for name, held in vars(self).items():
            if isinstance(held, Tensor):
                setattr(self, name, held.index_select(0, index.to(held.device)))
            elif isinstance(held, Kept):
                setattr(self, name, held.select(index))
        if self.shape is not None:
            self.shape = (len(index), *self.shape[1:])

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors the decoder holds."""
        return sum(held.nbytes for held in vars(self).values() if isinstance(held, (Tensor, Kept)))

    @abstractmethod
    def _step(self, q: Tensor, k: Tensor, v: Tensor, **tensors: Tensor) -> Tensor:
        """The outputs ``(B, H, T, Dv)`` of ``T`` checked new tokens, at positions ``length`` to
        ``length + T - 1``; updates what the decoder holds."""


def _check_held(self: Decoder, sizes: tuple[int, int, int, int], q: Tensor, k: Tensor, v: Tensor) -> None:
    """A later step must have the sizes in ``fixed``, the dtype and the device of the first."""
    if self.shape is None:
        return
    if any(self.shape[_SIZES.index(n)] != sizes[_SIZES.index(n)] for n in self.fixed):
        raise ValueError(f"{_mismatch(self, self.shape, sizes, k, v)}; start a new cache for a new batch")
    if q.device != self.device:
        raise ValueError(f"the cache is on {self.device} but q, k and v are on {q.device}; move them with .to()")
    if q.dtype != self.dtype:
        what = "keys and values" if self.holds == "keys" else "state"
        raise ValueError(
            f"the cache holds {what} of {self.dtype} inputs, got {q.dtype}; cast them or start a new cache"
        )


def _mismatch(decoder: Decoder, held: tuple[int, ...], sizes: tuple[int, ...], k: Tensor, v: Tensor) -> str:
    """What the decoder holds, of (B, H, D, Dv) = ``held``, against a step of other ``sizes``."""
    if decoder.holds != "keys":
        pick = [_SIZES.index(n) for n in decoder.fixed]
        was, now = tuple(held[i] for i in pick), tuple(sizes[i] for i in pick)
        return f"the decoder holds state for ({', '.join(decoder.fixed)}) = {was}, got {now}"
    if held[:3] != sizes[:3]:
        return f"the cache holds keys of (B, H, D) = {held[:3]}, got {tuple(k.shape)}"
    return f"the cache holds values of (B, H, Dv) = {(*held[:2], held[3])}, got {tuple(v.shape)}"


def _check_tensors(mechanism: Mechanism, tensors: dict[str, Tensor | None], device: torch.device) -> dict[str, Tensor]:
    """The extra tensors that were given (not None): named in ``tensor_args``, on ``device``."""
    given = {name: t for name, t in tensors.items() if t is not None}
    unknown = sorted(set(given) - set(mechanism.tensor_args))
    if unknown:
        raise ValueError(f"{mechanism.name} takes no tensor argument {unknown}; it takes {list(mechanism.tensor_args)}")
    for name, t in given.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor for a decoding step, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q, k and v are on {device}; move it with .to()")
    return given


class KVCache(Decoder):
    """Decoding cache that keeps every key and value seen so far.

    Exact for a mechanism whose causal output at a position depends only on that position's query
    and the keys and values up to it (full attention, for one): causal attention aligns the new
    queries to the last keys. It is wrong for a mechanism whose output also depends on past
    queries, or on extra tensors of past positions (those are passed for the new tokens only);
    such a mechanism needs its own decoder. Each new token costs attention over the whole prefix.
    """

    recurrent = False  # state grows with the prefix
    description = "KV cache (each new token attends to the whole prefix)"
    holds = "keys"

    def __init__(self, mechanism: Mechanism, config: Config, state: torch.nn.Module | None) -> None:
        if not (mechanism.causal and mechanism.cross):
            raise ValueError(f"{mechanism.name} needs a causal form that takes L != S to decode from a KV cache")
        super().__init__(mechanism, config, state)
        self.keys: Tensor | None = None  # (B, H, capacity, D)
        self.values: Tensor | None = None  # (B, H, capacity, Dv)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, **tensors: Tensor) -> Tensor:
        """Append ``k``, ``v`` ``(B, H, T, D)`` and attend the ``T`` new queries causally."""
        self.keys = _append(self.keys, self.length, k)
        self.values = _append(self.values, self.length, v)
        end = self.length + k.shape[2]
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]

        def run(q: Tensor, k: Tensor, v: Tensor, tensors: dict) -> Tensor:  # end-aligned: the new queries last
            return self.mechanism.fn(
                q,
                k,
                v,
                key_padding_mask=None,
                is_causal=True,
                scale=self.scale,
                config=self.config,
                state=self.state,
                **tensors,
            )

        mech = self.mechanism
        return contained(
            run, q, keys, values, dict(tensors), positions=mech.positions, key_padding_mask=None,
            query_padding_mask=None, is_causal=True, uses_qk=mech.uses_qk, groups_queries=mech.groups_queries,
            check_from=TUNING.contain_check,
        )  # fmt: skip


def _append(buffer: Tensor | None, length: int, x: Tensor) -> Tensor:
    """Write ``x`` after ``length`` entries on dim 2, doubling the capacity when it is full."""
    needed = length + x.shape[2]
    if buffer is None or needed > buffer.shape[2]:
        capacity = max(needed, 2 * (0 if buffer is None else buffer.shape[2]), 16)
        grown = x.new_empty(*x.shape[:2], capacity, x.shape[3])
        if buffer is not None:
            grown[:, :, :length] = buffer[:, :, :length]
        buffer = grown
    buffer[:, :, length:needed] = x
    return buffer


def room_for(needed: int) -> int:
    """The capacity a decoder's buffer grows to when it needs ``needed`` slots: an eighth more (at
    least 16), so that growing copies O(1) per token, amortised."""
    return needed + max(needed // 8, 16)
