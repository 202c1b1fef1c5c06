"""subquad: sub-quadratic attention for PyTorch, behind one SDPA-style API.

    import subquad
    out = subquad.attention(q, k, v, mechanism="full", is_causal=True)

``subquad list`` (or ``subquad.mechanism_names()``) shows every mechanism and its options.
"""

from subquad.call import attention, causal_lower_right
from subquad.registry import (
    Config,
    Mechanism,
    get_mechanism,
    make_config,
    mechanism_names,
    option,
    register,
)
from subquad.version import __version__

__all__ = [
    "Config",
    "Mechanism",
    "__version__",
    "attention",
    "causal_lower_right",
    "get_mechanism",
    "make_config",
    "mechanism_names",
    "option",
    "register",
]
