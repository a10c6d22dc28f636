"""castor: a mixed-precision training compiler for transformer checkpoints, from Python.

The functions here are castor's commands. Keyword arguments are the CLI's flags with
underscores (``keep_f32=["lm_head"]`` is ``--keep-f32 lm_head``; ``train=True`` is
``--train``), parsed and checked by the same code as the CLI's, and every function runs the
library function its command runs. Nothing here needs a GPU or the CUDA libraries.

    >>> import castor
    >>> info = castor.inspect("tests/fixtures/gpt2_lm")
    >>> plan = castor.compile("tests/fixtures/gpt2_lm", "bf16", seq=8)
    >>> plan.converted, plan.total
    >>> plan.explain("*attn*")[0].why

Errors are raised as subclasses of :class:`CastorError` that carry the CLI's message and
exit code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _castor
from ._castor import Decision, Plan, __version__
from ._errors import (
    CastorError,
    CheckpointError,
    ConfigError,
    DeviceError,
    ExecutionError,
    InputError,
    IRError,
    OutputError,
    PolicyError,
    UsageError,
)

__all__ = [
    "inspect",
    "compile",
    "eval",
    "train",
    "ModelInfo",
    "Plan",
    "Decision",
    "TrainResult",
    "CastorError",
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "ExecutionError",
    "InputError",
    "IRError",
    "OutputError",
    "PolicyError",
    "UsageError",
    "__version__",
]

PathLike = Union[str, "os.PathLike[str]"]


def _flags(**kwargs: Any) -> List[str]:
    """Keyword arguments as CLI flags: ``None`` and ``False`` leave a flag out, ``True`` gives
    it alone, a list or tuple repeats it, anything else is its value."""
    argv: List[str] = []
    for key, value in kwargs.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, os.fspath(item) if isinstance(item, os.PathLike) else str(item)]
        else:
            argv += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return argv


def _globs(globs: Union[str, Sequence[str]]) -> List[str]:
    """One glob or several."""
    return [globs] if isinstance(globs, str) else list(globs)


@dataclass(frozen=True)
class ModelInfo:
    """What ``castor inspect`` reads of a checkpoint or a bare config.json."""

    family: str
    """The config's ``model_type`` (``gpt2``, ``bert``, ``llama``, ...)."""
    architecture: str
    """The model class castor builds (``GPT2LMHeadModel``, ...)."""
    num_parameters: int
    config: Dict[str, Any]
    """config.json as a dict."""
    files: List[str]
    """The safetensors files (none for a bare config.json)."""
    dtype: Optional[str]
    """The checkpoint's storage dtype (``f32``, ``bf16``, ...), None without weights."""
    summary: str = field(repr=False)
    """The report ``castor inspect`` prints."""


def inspect(path: PathLike, *, batch: int = 1, seq: Optional[int] = None, strict: bool = False,
            adapter: Optional[PathLike] = None) -> ModelInfo:
    """Validate a checkpoint folder (or a bare config.json) and describe it, as
    ``castor inspect`` does: headers against files and config, absurd configs refused.

    ``strict=True`` also reads every weight and refuses NaN or Inf. Raises a
    :class:`CastorError` subclass on a checkpoint ``castor inspect`` refuses.
    """
    argv = [os.fspath(path)] + _flags(batch=batch, seq=seq, strict=strict, adapter=adapter)
    summary, facts = _castor._inspect(argv)
    return ModelInfo(summary=summary, **facts)


def compile(path: PathLike, precision: str = "bf16", *, train: bool = False, batch: int = 1,
            seq: Optional[int] = None, remat: str = "none", keep_f32: Sequence[str] = (),
            force_low: Sequence[str] = (), policy: Optional[PathLike] = None,
            optimizer: Optional[str] = None, **flags: Any) -> Plan:
    """Run castor's precision passes (and, for a training step, the training passes and the
    memory plan) on a model, as ``castor compile`` does; nothing is printed.

    ``path`` is a checkpoint folder, a bare config.json or an IR text file (``.ir``). Any
    other flag of ``castor compile`` is a keyword argument (``gpu="a100"``,
    ``lora_rank=16``, ``classifier="fused"``, ``report="plan.html"``...). A ``remat`` other
    than ``"none"``, LoRA and a fused classifier imply a training step, as on the CLI.
    """
    argv = [os.fspath(path)] + _flags(
        precision=precision, train=train, batch=batch, seq=seq, remat=remat,
        keep_f32=_globs(keep_f32), force_low=_globs(force_low), policy=policy,
        optimizer=optimizer, **flags)
    return _castor._compile(argv)


def _arrays(**arrays: Any) -> List[Tuple[str, str, List[int], bytes]]:
    """Arrays (numpy, or anything with ``__array__``: torch CPU tensors) as (name, dtype,
    shape, bytes), little-endian and contiguous."""
    import numpy as np

    out = []
    for name, value in arrays.items():
        if value is None:
            continue
        a = np.asarray(value)
        if a.dtype == np.bool_:
            a = a.astype(np.int64)
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        kinds = {"i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8", "u1": "U8", "f8": "F64",
                 "f4": "F32", "f2": "F16"}
        dtype = kinds.get(f"{a.dtype.kind}{a.dtype.itemsize}")
        if dtype is None:
            raise InputError(f"`{name}`: arrays of {a.dtype} cannot be a model input", 3)
        out.append((name, dtype, list(a.shape), a.tobytes()))
    return out


def eval(path: PathLike, input_ids: Any, *, attention_mask: Any = None,
         token_type_ids: Any = None, labels: Any = None, precision: str = "fp32",
         grad: bool = False, objective: str = "auto", device: str = "cpu",
         **flags: Any) -> Dict[str, Any]:
    """One forward pass (and with ``grad=True`` the loss and every parameter's gradient), as
    ``castor eval --input ... --out ...`` does: a dict of float32 numpy arrays named as in
    the CLI's output file (``logits`` or ``last_hidden_state``, ``loss``,
    ``grad.<checkpoint tensor name>``).

    The inputs are integer arrays ``[batch, seq]`` (numpy arrays, or anything with
    ``__array__``, so torch CPU tensors work), checked as a batch file is; ``labels`` are
    the objective's labels (``[batch, seq]``, -100 ignored; one per sequence for a
    classifier). ``device`` is ``cpu``, ``cuda``, ``emulate`` or ``auto``.
    """
    import numpy as np

    arrays = _arrays(input_ids=input_ids, attention_mask=attention_mask,
                     token_type_ids=token_type_ids, labels=labels)
    # The batch is handed over in memory; `--input` only satisfies the flag parser.
    argv = [os.fspath(path), "--input", "<arrays>"] + _flags(
        precision=precision, grad=grad, objective=objective, device=device, **flags)
    outputs = _castor._eval(argv, arrays)
    return {name: np.frombuffer(data, dtype="<f4").reshape(shape)
            for name, shape, data in outputs}


@dataclass(frozen=True)
class TrainResult:
    """What a training run did."""

    step: int
    """The step the run ended at (1-based; a resumed run counts its earlier steps)."""
    steps_done: int
    """Steps this run took."""
    final_loss: Optional[float]
    validation: Optional[Tuple[int, float]]
    """The last validation loss and the step it was computed at."""
    skipped: int
    """Steps skipped for non-finite gradients (dynamic loss scaling)."""
    seconds: float
    tokens_per_second: float
    interrupted: bool
    saved: Optional[str]
    """The folder of the final checkpoint (``save``)."""
    losses: List[Tuple[int, float]]
    """(step, training loss) of every step."""


class _Default(str):
    """A default that is not passed on when the run takes the setting from elsewhere."""


def train(path: PathLike, data: PathLike, *, steps: Optional[int] = None,
          precision: str = _Default("bf16"), save: Optional[PathLike] = None,
          callback: Optional[Callable[[Dict[str, Any]], None]] = None,
          **flags: Any) -> TrainResult:
    """Train a model on a data file, as ``castor train`` does (same flags, same checks, same
    step lines, log, checkpoints and report).

    ``steps`` is the step to train until (as transformers' ``max_steps``; optional when
    resuming). ``precision`` defaults to bf16, except that a resumed run (``resume=``) or a
    saved plan (``plan=``) keeps its own unless given. ``callback(record)`` is called with
    every logged step: the fields of the JSON log (``step``, ``loss``, ``lr``,
    ``loss_scale``, ``grad_norm``, ``skipped``, ``tokens_per_s``, ``val_loss``, ...).

    Ctrl-C (KeyboardInterrupt) finishes the step, saves as the CLI does (``save`` is
    written) and is then raised; an exception in the callback does the same. The GIL is
    released while castor trains.
    """
    if isinstance(precision, _Default) and (flags.get("resume") or flags.get("plan")):
        precision = None  # type: ignore[assignment]
    argv = [os.fspath(path)] + _flags(
        data=data, steps=steps, precision=None if precision is None else str(precision), save=save,
        **flags)
    result = _castor._train(argv, callback)
    return TrainResult(**result)
