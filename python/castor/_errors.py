"""The exceptions castor raises. Each carries the CLI's message and exit code."""


class CastorError(Exception):
    """Base class of every error castor raises; a bare CastorError is a bug in castor.

    ``str(e)`` is the message the CLI prints after ``error:``; ``e.exit_code`` is the CLI's
    exit status for the same failure (README.md).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class CheckpointError(CastorError):
    """A checkpoint that cannot be read or does not match its config."""


class ConfigError(CastorError):
    """A config.json castor refuses, or a model it cannot build."""


class IRError(CastorError):
    """IR text, a saved plan or a graph that does not verify."""


class PolicyError(CastorError):
    """A precision policy or a training setting the compiler passes refuse."""


class InputError(CastorError):
    """Other invalid input: data, batches, arguments that contradict each other."""


class DeviceError(CastorError):
    """The requested device is not available."""


class ExecutionError(CastorError):
    """Execution failed: bad bindings, out-of-range data found while running, out of memory."""


class OutputError(CastorError):
    """An output path that cannot be written."""


class UsageError(CastorError, TypeError):
    """A keyword argument castor's command does not take, or a value it cannot parse."""
