"""What a user is told when mlxwalk refuses: every refusal is a `Refusal`, of one kind below, and
the command line prints it as one line and exits 2 (`cli.fail`). Plain Python, importable
without any array library."""

from __future__ import annotations


class Refusal(ValueError):
    """Something mlxwalk will not do, named in one line."""


class ConfigError(Refusal):
    """An option, a YAML file of options, an environment switch, a walk's settings."""


class DataError(Refusal):
    """A data folder, a row of it, a window built from it, token ids."""


class OutOfMemory(Refusal):
    """A window that does not fit a memory budget; the message names which memory."""


class ModelError(Refusal):
    """A model folder or an adapter mlxwalk can't read or train."""


class FolderError(Refusal):
    """An adapter folder: in use, holding another run, not writable, a resume that does not
    match, a write that failed."""


class RanksError(Refusal):
    """Several processes: a launch that doesn't fit, a rank that failed."""


PlanError = Refusal  # the name every refusal went by before the kinds above; kept for the API


class NonFinite(Refusal):
    """A loss or gradient that is NaN or infinite, found before the step that would apply it."""
