"""The optional native kernel: batched short-sequence softmax attention in C (``csrc/``).

Opt-in (``kernel="native"`` on ``sparse``, ``pattern`` and ``local``), never required: nothing is
compiled when subquad is installed. On first use the C source is compiled with the system's C
compiler (``$CC``, else ``cc``) into a shared library cached under ``$SUBQUAD_CACHE`` (default
``$XDG_CACHE_HOME/subquad``, else ``~/.cache/subquad``), named by a hash of the source, the compiler
and the flags, and loaded with ``ctypes``. Loading a library runs its code, so only a file this user
built is loaded: the cache folder must be this user's and writable by no one else (an own folder
that others may write to is tightened), and a cached file of another user's, or one others may
write, is replaced by a fresh build. It runs where the CPU has AVX2 and FMA (x86-64); fp32
only. Where it cannot run (no compiler, another CPU, another dtype) the caller falls back to the
pure-PyTorch kernels and says why once.

``block_attention`` has the semantics of torch's CPU flash-attention kernel on
``(n0, n1, L, D)`` batches, with its optional additive mask and causal flag (key ``j <= i``), and
returns the normalised output and the log-sum-exp; a query that sees no key gets zeros and −inf.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["block_attention", "native_available", "native_unavailable_reason"]

_SOURCE = Path(__file__).parent / "csrc" / "block_attention.c"
_FLAGS = ["-O3", "-std=gnu11", "-mavx2", "-mfma", "-fPIC", "-shared", "-pthread", "-fno-math-errno"]
_lock = threading.Lock()
_state: dict = {}  # "function" once loaded, or "reason" why it cannot be


def _cache_dir() -> Path:
    root = os.environ.get("SUBQUAD_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "subquad"


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _unsupported() -> str | None:
    """Why this machine cannot run the kernel, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it needs an x86-64 CPU, this is {platform.machine()}"
    if sys.platform == "win32":
        return "it is built with a POSIX C compiler and pthreads, not on Windows"
    flags = _cpu_flags()
    if flags is not None:
        missing = sorted({"avx2", "fma"} - flags)
        if missing:
            return f"it needs AVX2 and FMA, this CPU lacks {', '.join(missing)}"
    else:  # no /proc/cpuinfo: torch's own dispatch says what the CPU runs
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            return f"it needs AVX2 and FMA, torch reports CPU capability {capability}"
    return None


def _compile() -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    compiler = shlex.split(os.environ.get("CC") or "cc")  # CC may carry a wrapper: "ccache gcc"
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler {' '.join(compiler)!r} on PATH (set CC)")
    digest = hashlib.sha256(source + " ".join([*compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"block_attention-{digest}.so"
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _private_folder(target.parent)
    if not _own_file(target):  # missing, or a file someone else could have written: build our own
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            try:
                result = subprocess.run(
                    [*compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            except subprocess.TimeoutExpired as error:
                raise RuntimeError(f"{' '.join(compiler)} took over {error.timeout} s") from error
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(compiler)} failed: {result.stderr.strip()[-500:]}")
            os.chmod(built, 0o700)
            os.replace(built, target)  # atomic: a concurrent process sees the whole library or none
    return ctypes.CDLL(str(target))


_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _private_folder(folder: Path) -> None:
    """Make sure only this user can put a library into ``folder``, the cache: loading a library runs
    its code. A folder of this user's that others may write to (an older cache made under umask 002)
    loses their write permission; one of another user is refused, naming the fix."""
    if not hasattr(os, "getuid"):
        return
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise RuntimeError(
            f"the cache folder {folder} belongs to another user (uid {info.st_uid}); a library loaded from it runs "
            "their code: set SUBQUAD_CACHE to a folder of your own"
        )
    if info.st_mode & _OTHERS_WRITE:
        os.chmod(folder, stat.S_IMODE(info.st_mode) & ~_OTHERS_WRITE)


def _own_file(path: Path) -> bool:
    """Whether ``path`` is a library this user built: a regular file of this user's that no one else
    may write. Anything else there is not loaded (it is replaced by a fresh build)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_mode & _OTHERS_WRITE:
        return False
    return not hasattr(os, "getuid") or info.st_uid == os.getuid()


def _function():
    """The loaded C function, or None (the reason is kept in ``_state``)."""
    if "function" in _state or "reason" in _state:
        return _state.get("function")
    with _lock:
        if "function" in _state or "reason" in _state:
            return _state.get("function")
        reason = _unsupported()
        if reason is None:
            try:
                function = _compile().subquad_block_attention
            except (OSError, RuntimeError, ValueError) as error:  # ValueError: CC that shlex cannot split
                reason = f"it could not be built or loaded: {error}"
        if reason is not None:
            _state["reason"] = reason
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = (
            [i64] * 6 + [ptr, i64, i64, i64] * 3 + [ptr, i64, i64, i64] + [ptr, i64, i64, i64] * 2
            + [ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        )  # fmt: skip
        function.restype = ctypes.c_int
        _state["function"] = function
        return function


def native_available() -> bool:
    """Whether the native kernel runs here (compiles and loads it on the first call)."""
    return _function() is not None


def native_unavailable_reason() -> str | None:
    """Why the native kernel cannot run here, or None when it can."""
    _function()
    return _state.get("reason")


def warn_unavailable(why: str) -> None:
    """Say once per reason that ``kernel="native"`` fell back to the pure-PyTorch kernels."""
    said = _state.setdefault("warned", set())
    if why not in said:
        said.add(why)
        warnings.warn(f"kernel='native' falls back to the PyTorch kernels: {why}", RuntimeWarning, stacklevel=3)


def supports(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why these inputs cannot use the kernel, or None."""
    if not (q.device.type == k.device.type == v.device.type == "cpu"):
        return f"it runs on the CPU, the inputs are on {q.device}"
    if not (q.dtype == k.dtype == v.dtype == torch.float32):
        return f"it computes in float32, the inputs are {q.dtype}"
    return native_unavailable_reason()


def _strides(x: Tensor) -> list[int]:
    return [x.data_ptr(), *x.stride()[:3]]


def _check(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    """What the C code relies on: fp32 CPU tensors of matching sizes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4 or x.device.type != "cpu" or x.dtype != torch.float32:
            raise ValueError(
                f"the native kernel takes 4-D float32 CPU tensors, got {name} of shape {tuple(x.shape)}, "
                f"{x.dtype} on {x.device}"
            )
    if k.shape[:3] != v.shape[:3] or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"the native kernel needs q (n0, n1, Lq, D), k (n0, n1, Lk, D) and v (n0, n1, Lk, Dv), got "
            f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}; expand broadcast dimensions first"
        )
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, (*q.shape[:3], k.shape[2]))
        except RuntimeError:
            ok = False
        else:
            ok = mask.dim() <= 4
        if not ok or not mask.is_floating_point() or mask.device.type != "cpu":
            raise ValueError(
                f"the native kernel's mask is additive (float, -inf hides a key) and broadcasts to "
                f"{(*q.shape[:3], k.shape[2])}, got {mask.dtype} of shape {tuple(mask.shape)} on {mask.device}"
            )


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    into: tuple[Tensor, Tensor] | None = None,
    merge: bool = False,
) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``q`` ``(n0, n1, Lq, D)`` over ``k``, ``v`` ``(n0, n1, Lk, D|Dv)``.

    ``mask``: additive, broadcastable to ``(n0, n1, Lq, Lk)`` (−inf hides a key). ``causal``: key
    ``j <= i``. Returns ``out`` ``(n0, n1, Lq, Dv)`` and ``lse`` ``(n0, n1, Lq, 1)``, fp32: new
    tensors, or ``into`` (views of a larger output are written in place). ``merge``: ``into``
    already holds the softmax over other keys (its output and log-sum-exp); the result is the
    softmax over both, as ``subquad.kernels.blocksparse_forward`` merges its parts.
    """
    function = _function()
    if function is None:
        raise RuntimeError(f"the native kernel cannot run: {_state['reason']}")
    _check(q, k, v, mask)
    n0, n1, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if into is None:
        if merge:
            raise ValueError("merge=True merges into the softmax that `into` holds: pass into=(out, lse)")
        out = torch.empty((n0, n1, Lq, Dv), dtype=torch.float32)
        lse = torch.empty((n0, n1, Lq, 1), dtype=torch.float32)
    else:
        out, lse = into
        if out.shape != (n0, n1, Lq, Dv) or lse.shape != (n0, n1, Lq, 1):
            raise ValueError(
                f"into must be (out, lse) of shapes {(n0, n1, Lq, Dv)} and {(n0, n1, Lq, 1)}, got "
                f"{tuple(out.shape)} and {tuple(lse.shape)}"
            )
        if out.dtype != torch.float32 or lse.dtype != torch.float32 or out.stride(-1) != 1:
            raise ValueError("into must be float32 tensors, the output's last dimension contiguous")
    if mask is None:
        masks = [None, 0, 0, 0]
    else:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        # transposed, so that a key's row of it is contiguous over the queries
        mask = mask.to(torch.float32).expand(*mask.shape[:2], Lq, Lk).transpose(-1, -2).contiguous()
        masks = [mask.data_ptr(), *(0 if mask.shape[i] == 1 else mask.stride(i) for i in (0, 1)), mask.stride(2)]
    if n0 * n1 * Lq:
        failed = function(
            n0, n1, Lq, Lk, D, Dv, *_strides(q), *_strides(k), *_strides(v), *masks,
            *_strides(out), *_strides(lse), int(causal), float(scale), int(merge), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("the native attention kernel could not allocate its working buffers")
    return out, lse
