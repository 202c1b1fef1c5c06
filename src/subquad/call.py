"""The call path: from ``attention()`` (shaped like torch's SDPA) to a mechanism's maths.

One call runs, in order:

0. **Tuning**: on the CPU, this machine's profile (``subquad tune``, ``kernels.profile``) for the
   thread count set now, where there is one; only block sizes, never what is computed.
1. **The causal form**, as SDPA reads it. ``is_causal=True`` aligns the queries to the *first* keys
   (top-left: query ``i`` sees keys ``j <= i``), SDPA's documented default. The end-aligned form
   that decoding and chunked prefill need (query ``i`` sits at key position ``i + S - L``) is asked
   for as torch asks for it: ``attn_mask=torch.nn.attention.bias.causal_lower_right(L, S)``
   (``causal_upper_left`` means ``is_causal=True``). The two agree when L == S.
2. **Checks** against the contract and the mechanism's record (``Mechanism``): shapes, dtypes,
   capabilities, options, extra tensors, dropout.
3. **Top-left alignment** when L != S. A mechanism's ``fn`` is end-aligned; top-left causal
   attention over S keys is end-aligned attention over the keys cut or padded to L: with L < S no
   query sees a key past L − 1, so those keys are dropped; with L > S padded (masked) keys are
   appended, so query ``i`` sits at position ``i``.
4. **The exact-full shortcut** (``Mechanism.exact_full``): a call that *is* full attention (a
   window over every key, clusters >= L) runs full attention's kernel.
5. **Containment** (``subquad._contain``): padded and future content never reaches a real output.
6. **Threads**: with ``TUNING.adaptive_threads`` (opt-in), fewer threads while other processes
   keep cores busy; by default the caller's thread count is left alone.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from subquad._contain import KEY, contained
from subquad._validate import AttentionShape, check_attention_inputs, check_dtype, check_gqa, check_query_padding_mask
from subquad.config import Config, one_mechanism
from subquad.kernels.profile import apply_for_threads
from subquad.kernels.threads import adapted, backward_adapted
from subquad.kernels.tuning import TUNING
from subquad.ranks import as_4d
from subquad.registry import Mechanism, default_config, get_mechanism, make_config, mechanism_names, no_causal_form

__all__ = ["attention", "call", "causal_lower_right"]


def _bias_module() -> Any:
    """torch's ``torch.nn.attention.bias`` if imported, else None (importing it takes about 2 s, and
    a ``CausalBias`` exists only once it is imported, so calls without one never import it)."""
    return sys.modules.get("torch.nn.attention.bias")


def causal_lower_right(num_queries: int, num_keys: int) -> Any:
    """torch's ``causal_lower_right(L, S)`` bias: the end-aligned causal form (query ``i`` at key
    position ``i + S - L``). Built without torch's warning for L > S, which concerns SDPA's NaN
    rows: here a query that sees no key returns zeros."""
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError as error:  # pragma: no cover - torch < 2.2
        raise RuntimeError("causal_lower_right needs torch >= 2.2 (torch.nn.attention.bias)") from error
    return CausalBias(CausalVariant.LOWER_RIGHT, num_queries, num_keys)


def _is_causal_bias(x: Any) -> bool:
    bias = _bias_module()
    return bias is not None and isinstance(x, bias.CausalBias)


def _causal_form(is_causal: Any, attn_mask: Any, q: Tensor, k: Tensor) -> tuple[bool, bool, Any]:
    """``(causal, end_aligned, attn_mask)`` from SDPA's arguments: a ``CausalBias`` mask becomes
    the causal form it names (and is taken out of ``attn_mask``)."""
    if not _is_causal_bias(attn_mask):
        return is_causal, False, attn_mask
    if is_causal is True:
        raise ValueError("pass either is_causal=True or a causal attn_mask (CausalBias), not both, as for SDPA")
    L, S = q.shape[-2], k.shape[-2]
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
        raise ValueError(
            f"attn_mask is a causal bias for L={attn_mask.seq_len_q}, S={attn_mask.seq_len_kv}, but q and k have "
            f"L={L}, S={S}; build it as causal_lower_right({L}, {S})"
        )
    return True, attn_mask.variant == _bias_module().CausalVariant.LOWER_RIGHT, None


def call(
    mech: Mechanism,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Any = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    config: Config | None = None,
    state: torch.nn.Module | None = None,
    enable_gqa: bool = False,
    dropout_p: float = 0.0,
    **tensors: Any,
) -> Tensor:
    """Run ``mech`` on one call as the module docstring says. ``attn_mask``: a ``CausalBias``
    (any mechanism) or a dense mask (mechanisms that take one). With ``enable_gqa``, ``k`` and
    ``v`` may have fewer heads (a divisor of q's): native mechanisms (``gqa``) read them as they
    are; for the others each key/value head is repeated for its query heads first."""
    if q.device.type == "cpu":
        apply_for_threads()  # this machine's tuning profile for the thread count set now, if there is one
    is_causal, end_aligned, attn_mask = _causal_form(is_causal, attn_mask, q, k)
    if attn_mask is not None:
        tensors["attn_mask"] = attn_mask
    if enable_gqa and check_gqa(q, k, v) > 1:
        if not mech.gqa:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        else:
            tensors["enable_gqa"] = True
    top_left = is_causal is True and not end_aligned
    query_padding_mask, shape = _check_call(mech, q, k, v, key_padding_mask, is_causal, config, tensors, dropout_p,
                                            top_left)  # fmt: skip
    if top_left and shape.queries != shape.keys:
        k, v, key_padding_mask, query_padding_mask = _top_left(mech, k, v, key_padding_mask, query_padding_mask,
                                                               tensors, shape)  # fmt: skip
        shape = dataclasses.replace(shape, keys=shape.queries)
    exact = mech.exact_full is not None and mech.exact_full(
        config or default_config(mech.config), shape, is_causal, state, tensors
    )
    if dropout_p:
        tensors["dropout_p"] = dropout_p
    run = _runner(mech, exact, key_padding_mask, query_padding_mask, is_causal, scale, config, state, dropout_p)
    if query_padding_mask is not None and "query_padding_mask" in mech.tensor_args:
        tensors["query_padding_mask"] = query_padding_mask
    with adapted(q.device):  # fewer threads while other processes keep cores busy (opt-in)
        return contained(
            run, q, k, v, tensors, positions=mech.positions, key_padding_mask=key_padding_mask,
            query_padding_mask=query_padding_mask, is_causal=is_causal, uses_qk=mech.uses_qk,
            groups_queries=mech.groups_queries, check_from=TUNING.contain_check,
        )  # fmt: skip


def _runner(
    mech: Mechanism, exact: bool, key_padding_mask: Tensor | None, query_padding_mask: Tensor | None,
    is_causal: bool, scale: float | None, config: Config | None, state: torch.nn.Module | None, dropout_p: float,
) -> Any:  # fmt: skip
    """The call ``contained`` makes: the mechanism, or full attention's kernel where the call is
    exactly full attention (padded queries then return zeros, as from the mechanisms that take a
    query mask)."""

    def run(q: Tensor, k: Tensor, v: Tensor, tensors: dict[str, Any]) -> Tensor:
        if exact:  # the same maths as full attention at this shape: full's kernel, without fixed costs
            out = get_mechanism("full").fn(
                q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale,
                enable_gqa=bool(tensors.get("enable_gqa")), dropout_p=dropout_p,
            )  # fmt: skip
            # padded queries return zeros, as from the mechanisms that take a query mask
            return out if query_padding_mask is None else out.masked_fill(~query_padding_mask[:, None, :, None], 0)
        low = None if mech.name == "full" else _autocast_dtype(q.device.type)  # full: SDPA's own autocast policy
        if low is not None:  # under autocast the mechanism runs in fp32, its output in autocast's dtype
            wide = {n: t.float() if isinstance(t, Tensor) and t.is_floating_point() else t for n, t in tensors.items()}
            with torch.autocast(q.device.type, enabled=False):
                return mechanism(q.float(), k.float(), v.float(), wide).to(low)
        return mechanism(q, k, v, tensors)

    def mechanism(q: Tensor, k: Tensor, v: Tensor, tensors: dict[str, Any]) -> Tensor:
        if mech.plain_backward:
            return _backward_adapted(mech, q, k, v, key_padding_mask, is_causal, scale, config, state, tensors)
        return mech.fn(
            q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, config=config,
            state=state, **tensors,
        )  # fmt: skip

    return run


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` where it is on, else None. A mechanism's
    scans, scatters and softmax statistics mix dtypes where autocast casts some of their products
    and not others; under it each runs in fp32 (autocast's policy for softmax and norms) and its
    output is given in autocast's dtype."""
    try:
        on = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        on = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not on:
        return None
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def _top_left(
    mech: Mechanism, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, query_padding_mask: Tensor | None,
    tensors: dict[str, Any], shape: AttentionShape,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """Keys, values, masks and key-aligned extra tensors cut or padded to L keys (module docstring,
    step 3); ``tensors`` is updated in place."""
    L, S = shape.queries, shape.keys
    mask = tensors.get("attn_mask")
    if L < S:  # keys past L - 1 are seen by no query
        for name, side in mech.positions.items():
            if side == KEY and isinstance(tensors.get(name), Tensor):
                tensors[name] = tensors[name][..., :L]
        if isinstance(mask, Tensor) and mask.shape[-1] == S:
            tensors["attn_mask"] = mask[..., :L]
        return (
            k[:, :, :L],
            v[:, :, :L],
            None if key_padding_mask is None else key_padding_mask[:, :L],
            query_padding_mask,
        )
    pad = L - S  # queries past S - 1 see every key: append masked keys
    for name, side in mech.positions.items():
        if side == KEY and isinstance(tensors.get(name), Tensor):
            tensors[name] = F.pad(tensors[name], (0, pad))
    if isinstance(mask, Tensor) and mask.shape[-1] == S:  # the appended keys are masked there too
        tensors["attn_mask"] = F.pad(mask, (0, pad), value=False if mask.dtype == torch.bool else float("-inf"))
    for name in mech.tensor_args:  # a mask_mod never sees an appended key's index
        if callable(tensors.get(name)) and not isinstance(tensors[name], Tensor):
            tensors[name] = _within(tensors[name], S)
    real = k.new_ones(k.shape[0], S, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
    key_padding_mask = torch.cat([real, real.new_zeros(k.shape[0], pad)], dim=1)
    if query_padding_mask is None and mech.groups_queries:
        query_padding_mask = k.new_ones(k.shape[0], L, dtype=torch.bool)
    return F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), key_padding_mask, query_padding_mask


def _within(mask_mod: Any, num_keys: int) -> Any:
    """``mask_mod`` for keys ``0 .. num_keys - 1`` only: later keys are masked, and it is never
    asked about them (it may index tensors of ``num_keys`` entries)."""

    def within(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask_mod(b, h, q_idx, kv_idx.clamp(max=num_keys - 1)) & (kv_idx < num_keys)

    return within


def _backward_adapted(
    mech: Mechanism, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool,
    scale: float | None, config: Config | None, state: torch.nn.Module | None, tensors: dict[str, Any],
) -> Tensor:  # fmt: skip
    """``fn`` through ``backward_adapted``, with the extra tensors that take a gradient among its
    inputs (and q and k only where it reads them)."""
    names = [name for name, x in tensors.items() if isinstance(x, Tensor) and x.requires_grad]
    qk = [q, k] if mech.uses_qk else []

    def run(*inputs: Tensor) -> Tensor:
        q_, k_ = inputs[:2] if mech.uses_qk else (q, k)
        v_, *extra = inputs[len(qk) :]
        return mech.fn(
            q_, k_, v_, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, config=config,
            state=state, **{**tensors, **dict(zip(names, extra))},
        )  # fmt: skip

    return backward_adapted(run, [*qk, v, *(tensors[name] for name in names)])


def _check_call(
    mech: Mechanism, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool,
    config: Config | None, tensors: dict[str, Any], dropout_p: float, top_left: bool,
) -> tuple[Tensor | None, AttentionShape]:  # fmt: skip
    """Validate a call against the contract and ``mech``'s record; returns its query padding mask
    and its shape."""
    if config is not None and type(config) is not mech.config:
        raise ValueError(f"{mech.name} needs a {mech.config.__name__}, got {type(config).__name__}")
    unknown = sorted(set(tensors) - set(mech.tensor_args) - {"enable_gqa"})
    if unknown:
        hint = "; a dense attn_mask is taken by full only (causal masks: is_causal or causal_lower_right)"
        raise ValueError(f"{mech.name} takes no tensor argument {unknown}; it takes {list(mech.tensor_args)}"
                         f"{hint if 'attn_mask' in unknown else ''}")  # fmt: skip
    if is_causal is True and not mech.causal:
        raise ValueError(no_causal_form(mech.name))
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p and not mech.dropout:
        with_dropout = ", ".join(n for n in mechanism_names() if get_mechanism(n).dropout)
        raise ValueError(
            f"{mech.name} has no attention dropout (dropout_p={dropout_p}); pass dropout_p=0.0, or use one "
            f"of: {with_dropout}"
        )
    if tensors.get("enable_gqa"):  # native grouped-query: check the shapes against q's heads
        k, v = (x[:, :1].expand(-1, q.shape[1], -1, -1) for x in (k, v))
    shape = check_attention_inputs(q, k, v, key_padding_mask, is_causal, None)
    if not mech.cross and shape.queries != shape.keys and not top_left:
        raise ValueError(f"{mech.name} needs as many queries as keys, got L={shape.queries} and S={shape.keys}")
    check_dtype(q.dtype, mech.dtypes)
    query_padding_mask = tensors.get("query_padding_mask")
    check_query_padding_mask(query_padding_mask, shape, q.device)
    if key_padding_mask is not None and query_padding_mask is None and mech.groups_queries:
        raise ValueError(
            f"{mech.name} groups its queries, so padded queries would change real outputs: with "
            "key_padding_mask, pass query_padding_mask too, bool (B, L), True = real query (in "
            "self-attention the same mask; torch.ones(B, L, dtype=torch.bool) if no query is padded)"
        )
    return query_padding_mask, shape


def _old_keywords(query: Any, key: Any, value: Any, options: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``attention``'s inputs, where given by their earlier keywords ``q``, ``k``, ``v`` (read with a
    warning for one release: they are SDPA's ``query``, ``key``, ``value`` now)."""
    given = [query, key, value]
    for i, (old, new) in enumerate((("q", "query"), ("k", "key"), ("v", "value"))):
        if old in options:
            if given[i] is not None:
                raise TypeError(f"attention() got both {old}= and {new}=; pass {new}=")
            warnings.warn(f"attention({old}=...) is now {new}=, as in torch's SDPA", DeprecationWarning, stacklevel=3)
            given[i] = options.pop(old)
    missing = [n for n, x in zip(("query", "key", "value"), given) if x is None]
    if missing:
        raise TypeError(f"attention() missing required argument(s): {', '.join(missing)}")
    return given[0], given[1], given[2]


def _tensor_arguments(mech: Mechanism, attn_mask: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The call's extra tensor arguments, taken out of ``options``; a dense ``attn_mask`` is
    checked to be taken by the mechanism (else a ValueError naming what it takes)."""
    tensors = {name: options.pop(name) for name in mech.tensor_args if name in options}
    if attn_mask is not None and not _is_causal_bias(attn_mask) and "attn_mask" not in mech.tensor_args:
        raise ValueError(
            f"{mech.name} takes no dense attn_mask; pass key_padding_mask, bool (B, S) with True = real "
            "token, is_causal=True or attn_mask=causal_lower_right(L, S) for causality, or use "
            "mechanism='full' (any dense mask) or 'pattern' (a mask_mod)"
        )
    return tensors


def _named(mechanism: Any, attn_mask: Any, options: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The call's mechanism, ``attn_mask`` and options: a spec (``local:window=64``) as its name and
    options; a name where SDPA's ``attn_mask`` goes (0.1's spelling) taken with a warning."""
    if isinstance(attn_mask, str):
        old = f"subquad.attention(q, k, v, {attn_mask!r}): the fourth positional argument is attn_mask, as in torch's"
        warnings.warn(f"{old} scaled_dot_product_attention; pass mechanism={attn_mask!r} by keyword (the positional "
                      "spelling goes in the next release)", DeprecationWarning, stacklevel=3)  # fmt: skip
        mechanism, attn_mask = attn_mask, None
    if isinstance(mechanism, str) and mechanism not in mechanism_names():  # a spec: the commands' grammar
        mix = "; attention() runs one mechanism on all heads: a mix is a layer's (subquad.nn.Attention(E, H, SPEC))"
        mechanism, options = one_mechanism(mechanism, options, mix)
    return mechanism, attn_mask, options


def attention(
    query: Tensor = None,  # type: ignore[assignment]  # required: None only to read the old q=, k=, v= keywords
    key: Tensor = None,  # type: ignore[assignment]
    value: Tensor = None,  # type: ignore[assignment]
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    mechanism: str = "full",
    key_padding_mask: Tensor | None = None,
    config: Config | None = None,
    state: torch.nn.Module | None = None,
    **options: Any,
) -> Tensor:
    """Attention by mechanism name, as a drop-in for ``torch.nn.functional.scaled_dot_product_attention``:
    the same positional arguments, meaning the same, then the mechanism and its options by keyword.

    Args:
        query: queries ``(B, H, L, D)`` (SDPA's names, by position or keyword).
        key: keys ``(B, H, S, D)`` (``(B, H / G, S, D)`` with ``enable_gqa``).
        value: values ``(B, H, S, Dv)`` (likewise).
        attn_mask: ``torch.nn.attention.bias.causal_lower_right(L, S)`` (or ``causal_upper_left``),
            taken by every mechanism with a causal form; or a dense mask broadcastable to
            ``(B, H, L, S)``, bool (True = may attend) or additive, taken by ``full`` only (other
            mechanisms take ``key_padding_mask``).
        dropout_p: attention dropout (mechanisms with ``dropout``: ``full``); 0 elsewhere.
        is_causal: strict causality, aligned as SDPA aligns it: for L != S query ``i`` sees keys
            ``j <= i`` (top-left). For queries that continue the keys (decoding), pass
            ``attn_mask=causal_lower_right(L, S)`` instead.
        scale: softmax scale, default ``D ** -0.5``.
        enable_gqa: grouped-query attention: k and v have a divisor of q's heads, each serving
            consecutive query heads.
        mechanism: a registered name (``subquad list``), or its spec with options (``"local:window=128"``).
        key_padding_mask: bool ``(B, S)``, True marks a real token.
        config: a ready config; otherwise ``options`` build one.
        state: the mechanism's persistent state module, if it has one.
        **options: the mechanism's config options, and its extra tensor arguments by name.

    Returns:
        ``(B, H, L, Dv)`` in ``query``'s dtype; other ranks as SDPA's, in the query's (``subquad.ranks``).
    """
    query, key, value = _old_keywords(query, key, value, options)
    mechanism, attn_mask, options = _named(mechanism, attn_mask, options)  # the spelling of 0.1, or a spec
    mech = get_mechanism(mechanism)
    tensors = _tensor_arguments(mech, attn_mask, options)
    if config is not None and options:
        raise ValueError(f"pass either config or options (keywords, a spec's), not both (got {sorted(options)})")
    if config is None:
        config = make_config(mech, **options)
    dense = isinstance(attn_mask, Tensor) and not _is_causal_bias(attn_mask)
    query, key, value, attn_mask, key_padding_mask, shape = as_4d(query, key, value, attn_mask, dense,
                                                                  key_padding_mask, tensors)  # fmt: skip
    out = call(
        mech, query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
        scale=scale, config=config, state=state, enable_gqa=enable_gqa, dropout_p=dropout_p, **tensors,
    )  # fmt: skip
    return out if shape is None else out.reshape(shape)
