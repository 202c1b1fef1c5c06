"""Saving and loading converted models.

``save(model, folder)`` writes the model (loadable
by transformers as the original architecture), ``subquad.json`` (each layer's mechanism and
options, or its head mix's spec; the SHA-256 of the model's config and weights and of ``subquad.safetensors``, and a
checksum of its own) and ``subquad.safetensors`` (what conversion added); ``from_pretrained(folder)``
checks every recorded file and loads it back with subquad attention. A changed or damaged file is
refused by name (``subquad.files.FileError``), and only data is read: safetensors and JSON, never
a pickle or the folder's own code (``model_source``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from subquad.files import FileError, check_fields, check_gguf, json_checksum, load_safetensors, read_json, sha256
from subquad.hf.conversion import _add, _converted
from subquad.hf.interface import LayerAttention, check_spec, is_mix, model_attention
from subquad.hf.mixes import LayerMix
from subquad.hf.support import attention_modules, layer_index

SPEC_FILE, TENSOR_FILE = "subquad.json", "subquad.safetensors"


def save(model: nn.Module, folder: str | Path, tokenizer: Any = None) -> Path:
    """Write a converted (or ``use``d) model to ``folder``: the model's own files (which
    transformers loads as the original architecture), ``subquad.json`` and ``subquad.safetensors``;
    and the tokenizer's, if given. ``from_pretrained(folder)`` loads it with subquad attention."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file; save needs a folder (it is created if missing)")
    layers, tensors = {}, {}
    for module in attention_modules(model):
        spec = getattr(module, "subquad_attention", None)
        if spec is None:
            continue
        index = layer_index(module)
        if isinstance(spec, LayerMix):  # a head mix: its spec, whose options are in it
            layers[str(index)] = {"mechanism": spec.text, "options": {}}
        else:
            layers[str(index)] = {"mechanism": spec.mechanism.name, "options": _jsonable(spec.options)}
        for name, part in _converted(module):
            for key, value in part.state_dict().items():
                tensors[f"{index}.{name}.{key}"] = value.detach().cpu().contiguous().clone()
    if not layers:
        raise ValueError("this model has no subquad attention to save; subquad.hf.convert (or use) it first")
    own = {k: v for k, v in model.state_dict().items() if ".subquad_" not in k}
    with _dequantized(model):
        model.save_pretrained(folder, state_dict=own)
    save_file(tensors, str(folder / TENSOR_FILE))
    record = {"format": 1, "layers": layers, "sha256": {p.name: sha256(p) for p in _recorded(folder)}}
    record["checksum"] = json_checksum(record)
    (folder / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def _dequantized(model: nn.Module):
    """A model loaded from a GGUF file with its weights de-quantised (every weight a float tensor)
    saves as the plain model it is: transformers refuses any model that still carries the GGUF
    quantizer, which is dropped for the save and put back after."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = str(getattr(getattr(quantizer, "quantization_config", None), "quant_method", ""))
    if quantizer is None or "gguf" not in method.lower():
        yield
        return
    if not all(p.is_floating_point() for p in model.parameters()):
        raise ValueError("this model keeps GGUF-quantised weights; load it de-quantised (float weights) to save it")
    config = model.config
    quantization = config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
        if quantization is not None:
            config.quantization_config = quantization


def _recorded(folder: Path) -> list[Path]:
    """The files of a saved folder that its ``subquad.json`` records the SHA-256 of: the model's
    config and weights (one file or shards and their index) and what conversion added."""
    names = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json", TENSOR_FILE)
    return sorted({p for name in names for p in folder.glob(name) if p.is_file()})


def _jsonable(options: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def from_pretrained(folder: str | Path, *, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Load what ``save`` wrote: the model (``model_class``, by default the architecture its config
    names), then each layer's mechanism and what conversion added; in eval mode. Only data is read
    (safetensors and JSON; never a pickle, never the folder's own code), and a broken file raises
    FileError naming it."""
    import transformers

    folder = Path(folder)
    fixed = sorted({"local_files_only", "trust_remote_code", "use_safetensors", "gguf_file"} & set(kwargs))
    if fixed:
        raise ValueError(f"from_pretrained sets {fixed} itself: it loads local safetensors and no model code only")
    source = {**model_source(folder), **kwargs}  # first: a pickle-only folder is refused as such
    layers = _read_spec(folder)
    with loading(folder):
        if model_class is None:
            config = transformers.AutoConfig.from_pretrained(**source)
            names = config.architectures or []
            model_class = getattr(transformers, names[0], None) if names else None
            if model_class is None:
                raise FileError(folder / "config.json", f"names no architecture transformers has ({names})",
                                "pass model_class")  # fmt: skip
        model = model_class.from_pretrained(**source)
    spec_file = folder / SPEC_FILE
    for index, (mechanism, options) in layers.items():
        try:
            _add(model, model_attention(model, mechanism, converted=True, **options), [index])
        except ValueError as error:
            raise FileError(spec_file, f"layer {index}: {error}", _RESAVE) from error
    tensors = load_safetensors(folder / TENSOR_FILE, fix=_RESAVE)
    by_index = {layer_index(m): m for m in attention_modules(model)}
    expected = set()
    for index, module in by_index.items():
        for name, part in _converted(module):
            prefix = f"{index}.{name}."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            expected.update(f"{index}.{name}.{k}" for k in part.state_dict())
            try:
                part.load_state_dict(state)
            except RuntimeError as error:
                raise FileError(folder / TENSOR_FILE, f"does not fit layer {index}'s {name}: {error}") from error
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise FileError(folder / TENSOR_FILE, f"holds tensors no converted layer takes: {unexpected[:5]}", _RESAVE)
    return model.eval()


_RESAVE = "save the model again with subquad.hf.save, or copy the folder again from where it was written"


def saved_layers(folder: str | Path) -> dict[int, tuple[str, dict[str, Any]]]:
    """Each converted layer's (mechanism, options), from the ``subquad.json`` of a folder ``save``
    wrote; FileError naming the file for one that is broken, changed, or from another version."""
    return _read_spec(folder)


def _read_spec(folder: str | Path) -> dict[int, tuple[str, dict[str, Any]]]:
    """``saved_layers``, with every file ``subquad.json`` records checked against its SHA-256 and
    ``subquad.json`` against its checksum (folders saved before they were recorded are read unchecked)."""
    folder = Path(folder)
    spec_file = folder / SPEC_FILE
    if not spec_file.is_file():
        raise FileNotFoundError(
            f"{folder} has no {SPEC_FILE}: it is not a model subquad.hf.save (or subquad distill) wrote; load a plain "
            "model with transformers, then subquad.hf.convert or use it"
        )
    saved = read_json(spec_file, SPEC_FILE, _RESAVE)
    check_fields(saved, spec_file, {"format": int, "layers": dict, "sha256": dict, "checksum": str},
                 required=("format", "layers"), fix=_RESAVE)  # fmt: skip
    if saved["format"] != 1:
        raise FileError(spec_file, f"is format {saved['format']}; this version of subquad reads format 1",
                        "load it with the subquad version that wrote it")  # fmt: skip
    if "sha256" in saved or "checksum" in saved:  # written with its checks: they are all there
        if saved.get("checksum") != json_checksum({k: v for k, v in saved.items() if k != "checksum"}):
            raise FileError(spec_file, "was changed after it was written (its checksum does not match it)", _RESAVE)
        for name, digest in saved.get("sha256", {}).items():
            path = folder / name
            if Path(name).name != name:
                raise FileError(spec_file, f"records a file {name!r} outside its folder", _RESAVE)
            if not path.is_file():
                raise FileError(folder, f"lacks {name}, which {SPEC_FILE} records", _RESAVE)
            if sha256(path) != digest:
                raise FileError(path, f"was changed or damaged after it was written (its SHA-256 is not "
                                f"{SPEC_FILE}'s)", _RESAVE)  # fmt: skip
    if not saved["layers"]:
        raise FileError(spec_file, "names no converted layer", _RESAVE)
    layers = {}
    for index, layer in saved["layers"].items():
        if not index.isdigit():
            raise FileError(spec_file, f"names layer {index!r}; layers are numbers", _RESAVE)
        where = f"layer {index}"
        if not isinstance(layer, dict):
            raise FileError(spec_file, f"{where} is not an object", _RESAVE)
        check_fields(layer, spec_file, {"mechanism": str, "options": dict}, ("mechanism", "options"), where, _RESAVE)
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in layer["options"].items()}
        try:
            if is_mix(layer["mechanism"]) and options:
                raise ValueError(f"a head mix ({layer['mechanism']!r}) holds its options in its spec; options is {{}}")
            if is_mix(layer["mechanism"]):
                check_spec(layer["mechanism"], converted=True)
            else:
                LayerAttention.build(layer["mechanism"], converted=True, **options)
        except (ValueError, TypeError) as error:
            raise FileError(spec_file, f"{where}: {error}", _RESAVE) from error
        layers[int(index)] = layer["mechanism"], options
    return layers


_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def model_source(path: str | Path) -> dict[str, Any]:
    """The keyword arguments with which transformers' ``from_pretrained`` loads the local model
    ``path`` (a folder, or a ``.gguf`` file) as data only: safetensors weights (never pickled
    ones), no code of the model's own (``trust_remote_code=False``, which also keeps transformers
    from asking on a terminal), nothing from a hub. A folder that is not a model, a pickle-only
    one, one that asks for its own code, or a file that is not GGUF raises FileError naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: pass a local Hugging Face model folder or a .gguf file")
    where = {"local_files_only": True, "trust_remote_code": False}
    if path.is_file():
        check_gguf(path)
        return {**where, "pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    config = path / "config.json"
    if not config.is_file():
        raise FileError(path, "holds no config.json: it is not a Hugging Face model folder",
                        "pass the folder save_pretrained wrote, or a .gguf file")  # fmt: skip
    values = read_json(config, "model config", "copy the model folder again from where it came")
    if "auto_map" in values:
        raise FileError(config, "asks to run the model's own code (auto_map), which subquad never does",
                        "use a model whose architecture transformers itself has")  # fmt: skip
    if not any((path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        pickled = sorted(p.name for pattern in _PICKLES for p in path.glob(pattern))
        if pickled:
            raise FileError(
                path / pickled[0], "holds the weights in a pickle format, which subquad never loads: a pickle from "
                "elsewhere can run code",
                "where you trust the model, save it as safetensors (model.save_pretrained(folder)) and pass that "
                "folder",
            )  # fmt: skip
        raise FileError(path, "holds no model.safetensors", "pass a model folder with safetensors weights")
    return {**where, "pretrained_model_name_or_path": str(path), "use_safetensors": True}


@contextlib.contextmanager
def loading(path: str | Path):
    """Errors of transformers while it loads the local model ``path`` (a truncated weights file, a
    config it cannot read, a tokenizer that does not fit) as FileError naming it."""
    try:
        yield
    except FileError:
        raise
    except ImportError:  # a package the model needs (gguf): its own message says which
        raise
    except Exception as error:  # whatever the files made transformers raise: named, never a traceback
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise FileError(
            path, f"could not be loaded as a Hugging Face model ({type(error).__name__}: {reason[:300]})",
            "check that the folder (or .gguf file) is whole: copy it again from where it came",
        ) from error  # fmt: skip


def spec_text(mechanism: str, options: dict[str, Any]) -> str:
    """A saved layer's mechanism and options as a spec string (tuple values as a|b)."""
    text = ",".join(f"{k}={'|'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in options.items())
    return f"{mechanism}:{text}" if text else mechanism
