"""Exception types for bad user input.

Both subclass ``ValueError`` so generic callers can catch them, while the CLIs and tests can tell a broken
data file from a broken checkpoint. Messages always name the offending file (or key) and the problem.
"""


class DataError(ValueError):
    """A data file (NIfTI image or mask) is missing, unreadable, or has the wrong shape, values or labels."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or lacks keys or shapes the model needs."""
