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
exit code. Nothing is printed: what the CLI would print goes to the ``castor`` logger
(warnings at WARNING, which Python shows by default; step lines and facts at INFO), and
``verbose=True`` prints it as the CLI does. Defaults are the CLI's: fp32 unless a precision is
given, as transformers' Trainer trains in fp32 unless told ``bf16=True``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Union)

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
    "generate",
    "merge",
    "load",
    "Generated",
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

# What the CLI would print goes to the `castor` logger unless a call asks for the console.
_castor._set_output("logging")


@contextlib.contextmanager
def _output(verbose: bool) -> Iterator[None]:
    """With ``verbose``, the call prints what the CLI prints; else it logs it."""
    if not verbose:
        yield
        return
    _castor._set_output("console")
    try:
        yield
    finally:
        _castor._set_output("logging")


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
            adapter: Optional[PathLike] = None, verbose: bool = False) -> ModelInfo:
    """Validate a checkpoint folder (or a bare config.json) and describe it, as
    ``castor inspect`` does: headers against files and config, absurd configs refused.

    ``strict=True`` also reads every weight and refuses NaN or Inf. Raises a
    :class:`CastorError` subclass on a checkpoint ``castor inspect`` refuses.
    """
    argv = [os.fspath(path)] + _flags(batch=batch, seq=seq, strict=strict, adapter=adapter)
    with _output(verbose):
        summary, facts = _castor._inspect(argv)
    return ModelInfo(summary=summary, **facts)


def compile(path: PathLike, precision: Optional[str] = None, *, train: bool = False,
            batch: int = 1, seq: Optional[int] = None, remat: str = "none",
            keep_f32: Sequence[str] = (), force_low: Sequence[str] = (),
            policy: Optional[PathLike] = None, optimizer: Optional[str] = None,
            verbose: bool = False, **flags: Any) -> Plan:
    """Run castor's precision passes (and, for a training step, the training passes and the
    memory plan) on a model, as ``castor compile`` does; nothing is printed.

    ``path`` is a checkpoint folder, a bare config.json or an IR text file (``.ir``). Any
    other flag of ``castor compile`` is a keyword argument (``gpu="a100"``,
    ``lora_rank=16``, ``classifier="fused"``, ``report="plan.html"``...). A ``remat`` other
    than ``"none"``, LoRA and a fused classifier imply a training step, as on the CLI.
    ``precision`` is the CLI's default (fp32) unless given.
    """
    argv = [os.fspath(path)] + _flags(
        precision=precision, train=train, batch=batch, seq=seq, remat=remat,
        keep_f32=_globs(keep_f32), force_low=_globs(force_low), policy=policy,
        optimizer=optimizer, **flags)
    with _output(verbose):
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
         token_type_ids: Any = None, labels: Any = None, precision: Optional[str] = None,
         grad: bool = False, objective: str = "auto", device: str = "cpu",
         verbose: bool = False, **flags: Any) -> Dict[str, Any]:
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
    with _output(verbose):
        outputs = _castor._eval(argv, arrays)
    return _float_arrays(outputs)


def _float_arrays(outputs: List[Tuple[str, List[int], bytes]]) -> Dict[str, Any]:
    """(name, shape, F32 bytes) triples as a dict of float32 numpy arrays."""
    import numpy as np

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


DataLike = Union[PathLike, Iterable[Any]]


@contextlib.contextmanager
def _data_file(data: DataLike) -> Iterator[str]:
    """A data argument as a path: a path as it is; an iterable of texts as a ``.jsonl`` file
    of documents; an iterable of token id arrays as one token stream (an llm.c token file of
    u32 ids, the arrays one after another), each written to a temporary folder for the run."""
    if isinstance(data, (str, os.PathLike)):
        yield os.fspath(data)
        return
    import json

    import numpy as np

    items = list(data)
    if not items:
        raise InputError("the training data is empty", 3)
    with tempfile.TemporaryDirectory(prefix="castor-data-") as folder:
        if all(isinstance(x, str) for x in items):
            path = os.path.join(folder, "data.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for text in items:
                    f.write(json.dumps({"text": text}) + "\n")
        else:
            arrays = [np.asarray(x) for x in items]
            bad = next((a for a in arrays if a.dtype.kind not in "iu" or a.ndim > 2), None)
            if bad is not None:
                raise InputError("training data: expected texts or arrays of integer token ids, "
                                 f"found an array of {bad.dtype} with {bad.ndim} dimension(s)", 3)
            ids = np.concatenate([a.reshape(-1) for a in arrays]).astype("<i8")
            if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
                raise InputError("training data: token ids must be in [0, 2^32)", 3)
            header = np.zeros(256, "<i4")
            header[:3] = (20240520, 2, ids.size)
            path = os.path.join(folder, "tokens.bin")
            with open(path, "wb") as f:
                f.write(header.tobytes())
                f.write(ids.astype("<u4").tobytes())
        yield path


def train(path: PathLike, data: DataLike, *, steps: Optional[int] = None,
          precision: Optional[str] = None, save: Optional[PathLike] = None,
          callback: Optional[Callable[[Dict[str, Any]], None]] = None,
          verbose: bool = False, **flags: Any) -> TrainResult:
    """Train a model, as ``castor train`` does (same flags, same checks, same log,
    checkpoints and report).

    ``data`` is a data file or folder (as ``--data``), or in memory: a list (any iterable) of
    texts, tokenized as documents with the model's tokenizer, or of integer token id arrays,
    trained on as one token stream. ``steps`` is the step to train until (as transformers'
    ``max_steps``; optional when resuming). ``precision`` is the CLI's default (fp32) unless
    given; a resumed run (``resume=``) or a saved plan (``plan=``) keeps its own.
    ``callback(record)`` is called with every logged step: the fields of the JSON log
    (``step``, ``loss``, ``lr``, ``loss_scale``, ``grad_norm``, ``skipped``,
    ``tokens_per_s``, ``val_loss``, ...). The step lines go to the ``castor`` logger at INFO
    (printed with ``verbose=True``).

    An exception in the callback stops the run at the step whose callback raised: that step
    is saved (``save`` is written, as Ctrl-C saves) and the exception is raised. Ctrl-C
    (KeyboardInterrupt) does the same at the step it arrives in. The GIL is released while
    castor trains.
    """
    with _data_file(data) as data_path, _output(verbose):
        argv = [os.fspath(path)] + _flags(
            data=data_path, steps=steps, precision=precision, save=save, **flags)
        result = _castor._train(argv, callback)
    return TrainResult(**result)


@dataclass(frozen=True)
class Generated:
    """What ``generate`` made."""

    text: str
    """The prompt and its continuation (with ``chat=True``, the reply alone)."""
    tokens: List[int]
    """The new token ids."""
    stopped: str
    """Why generation stopped (``end of text``, ``--max-new-tokens reached``, ...)."""


def generate(path: PathLike, prompt: Optional[str], *, max_new_tokens: int = 50,
             temperature: Optional[float] = None, top_k: Optional[int] = None,
             top_p: Optional[float] = None, seed: int = 0, verbose: bool = False,
             **flags: Any) -> Generated:
    """Continue ``prompt`` with a causal model, as ``castor generate`` does: greedy unless
    the checkpoint's generation_config.json samples or a sampling argument is given, as
    transformers' ``generate``; ``adapter=`` adds a PEFT LoRA adapter. ``chat=True`` renders
    the conversation (``system=`` and ``prompt``, or ``messages=`` a JSON file of messages,
    with ``prompt`` None) through the model's chat template and continues it with the
    assistant's reply."""
    argv = [os.fspath(path)] + _flags(
        prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, **flags)
    with _output(verbose):
        text, tokens, stopped = _castor._generate(argv)
    return Generated(text=text, tokens=list(tokens), stopped=stopped)


def merge(path: PathLike, adapter: PathLike, out: PathLike, *, verbose: bool = False) -> str:
    """Fold a PEFT LoRA adapter into its base checkpoint, as ``castor merge`` (and PEFT's
    ``merge_and_unload``) does; returns the folder written."""
    argv = [os.fspath(path)] + _flags(adapter=adapter, out=out)
    with _output(verbose):
        _castor._merge(argv)
    return os.fspath(out)


def load(path: PathLike) -> Dict[str, Any]:
    """Every tensor of a checkpoint folder (sharded or not: the weights, not
    ``optimizer.safetensors``) or of one ``.safetensors`` file (a saved run's
    ``optimizer.safetensors``, an adapter's weights) as float32 numpy arrays by name."""
    return _float_arrays(_castor._load(os.fspath(path)))
