"""subquad inside pretrained Hugging Face models (transformers >= 5): every mechanism as an attention
implementation, conversion of what a mechanism adds, and the jobs that measure and train it.

- ``interface``: ``register``, ``use``, ``restore``; the attention call transformers makes;
- ``support``: the models it can drive (``attention_modules``), and the refusal of the others;
- ``mixes``: head mixes, a layer's heads split between mechanisms (``LayerMix``, ``HeadShare``);
- ``masks``: transformers' masks read as a key padding mask, or refused;
- ``cache``: ``SubquadCache``, generation at each mechanism's decoding cost (``model.generate`` uses it);
- ``conversion``: ``convert``, ``calibrate``, what conversion adds (``ConvertedInputs``);
- ``io``: ``save``, ``from_pretrained``, ``model_source`` (files from elsewhere are checked, never run);
- ``data``: passages, token windows, model loading for the jobs;
- ``recording``: ``record``, a model's own queries, keys and values, to time mechanisms on;
- ``heads``: ``retrieval_scores``, the heads whose answer attends to a needle, and a layer plan from them;
- ``approx``, ``distill`` and ``heads``: the ``subquad approx``, ``distill`` and ``heads`` jobs.
"""

import importlib
from typing import Any

_HOMES = {
    "cache": ("SubquadCache",),
    "conversion": ("ConvertedInputs", "calibratable", "calibrate", "convert", "converted_parameters"),
    "interface": (
        "NAME",
        "LayerAttention",
        "check_spec",
        "is_mix",
        "layer_spec",
        "model_attention",
        "register",
        "restore",
        "use",
    ),
    "mixes": ("HeadShare", "LayerMix"),
    "plans": ("LayerPlan", "read_plan"),
    "recording": ("Recorded", "record", "spread_layers"),
    "heads": ("HeadScores", "retrieval_scores"),
    "support": ("attention_modules", "check_model"),
    "io": ("SPEC_FILE", "TENSOR_FILE", "from_pretrained", "loading", "model_source", "save", "saved_layers"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "NAME",
    "SPEC_FILE",
    "TENSOR_FILE",
    "ConvertedInputs",
    "HeadScores",
    "HeadShare",
    "LayerAttention",
    "LayerMix",
    "LayerPlan",
    "Recorded",
    "SubquadCache",
    "attention_modules",
    "calibratable",
    "calibrate",
    "check_model",
    "check_spec",
    "convert",
    "converted_parameters",
    "from_pretrained",
    "is_mix",
    "layer_spec",
    "loading",
    "model_attention",
    "model_source",
    "read_plan",
    "record",
    "register",
    "restore",
    "retrieval_scores",
    "save",
    "saved_layers",
    "spread_layers",
    "use",
]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: the jobs' settings (``subquad.hf.distill``) are
    read by the command line without transformers installed."""
    if name not in _HOME:
        raise AttributeError(f"module 'subquad.hf' has no attribute {name!r}")
    try:
        module = importlib.import_module(f"subquad.hf.{_HOME[name]}")
    except ImportError as error:
        raise ImportError("subquad.hf needs transformers >= 5: pip install 'subquad[hf]'") from error
    return getattr(module, name)
