"""Type stubs of castor's native module (python/src/lib.rs). Use the functions of ``castor``;
these take the CLI's argument vector."""

from os import PathLike
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

__version__: str

def _inspect(argv: List[str]) -> Tuple[str, Dict[str, Any]]: ...
def _compile(argv: List[str]) -> Plan: ...
def _eval(
    argv: List[str], arrays: List[Tuple[str, str, List[int], bytes]]
) -> List[Tuple[str, List[int], bytes]]: ...
def _train(
    argv: List[str], callback: Optional[Callable[[Dict[str, Any]], None]] = None
) -> Dict[str, Any]: ...
def _generate(argv: List[str]) -> Tuple[str, List[int], str]: ...
def _merge(argv: List[str]) -> None: ...
def _load(path: str) -> List[Tuple[str, List[int], bytes]]: ...
def _set_output(mode: str) -> None: ...

class Decision:
    """One node's precision decision, as ``castor compile --explain`` prints it
    (``str(decision)``)."""

    node: str
    """The node's result name."""
    op: str
    """The op's mnemonic (``matmul``, ``softmax``, ...)."""
    op_class: str
    """``contraction``, ``normalization``, ``elementwise`` or ``layout``."""
    reads: List[Tuple[str, str]]
    """Each input's name and dtype."""
    accumulates: Optional[str]
    """The accumulator dtype (``f32``, ``tf32``) of ops that accumulate."""
    writes: List[str]
    """Each result's dtype."""
    why: str
    """The reason the deciding pass recorded."""

class Plan:
    """What ``castor compile`` decided for one model and one set of flags."""

    @property
    def summary(self) -> str:
        """The report ``castor compile`` prints for the same flags."""
    @property
    def converted(self) -> int:
        """Nodes computing in the low-precision dtype (N of "converted N/M nodes")."""
    @property
    def total(self) -> int:
        """Nodes with a float result, other than sources, casts and parameter copies (M)."""
    @property
    def casts(self) -> int:
        """Cast nodes the passes inserted."""
    @property
    def is_training(self) -> bool:
        """Whether the plan is a training step (``train=True`` or a flag implying it)."""
    def explain(self, glob: str) -> List[Decision]:
        """The decisions of the nodes whose names match ``glob`` (``*``, ``?``), in graph
        order."""
    @property
    def ir(self) -> Optional[str]:
        """The IR text (``--emit ir``): the compiled graph, or the training step's graphs."""
    @property
    def dot(self) -> Optional[str]:
        """A Graphviz picture coloured by dtype (``--emit dot``)."""
    @property
    def json(self) -> Optional[str]:
        """The training plan as JSON (``--emit plan``, which ``castor train --plan`` runs);
        None for a forward pass."""
    @property
    def anatomy(self) -> Optional[Dict[str, int]]:
        """The training step's memory in bytes by role (``low_precision_weights``,
        ``master_weights``, ``frozen_weights``, ``gradients``, ``optimizer_state``,
        ``control``, ``arena``, ``workspace``, ``other``) and ``total``, the planned peak;
        ``saved_activations`` is the part of ``arena`` the backward reads. None for a
        forward pass."""
    @property
    def cost(self) -> Optional[Dict[str, Any]]:
        """The cost model's roofline estimate of the training step on the target GPU:
        ``gpu``, ``flops_per_token``, ``flops_per_token_rule`` (6N + 6LCT), ``step_seconds``,
        ``tokens_per_step``, ``mfu``, and for a data-parallel plan (one rank's) ``world_size``
        and ``communication_seconds`` (the collectives, counted in ``step_seconds``), and
        ``overlapped_step_seconds`` (the step with the collectives on their own stream,
        overlapping compute). None for a forward pass."""
    def save(self, path: Union[str, PathLike[str]]) -> None:
        """Writes the plan (JSON) for ``Plan.load``."""
    @staticmethod
    def load(path: Union[str, PathLike[str]]) -> Plan:
        """Reads a plan ``Plan.save`` wrote; raises ``InputError`` for a file that is not
        one, ``IRError`` for one whose graph does not parse."""
