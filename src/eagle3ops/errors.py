"""Errors that mean 'the input is wrong', reported as one clear line naming the file, line or key."""


class InputError(ValueError):
    """Bad user input: params, datasets, model or checkpoint directories."""


class UsageError(InputError):
    """The command line names what cannot be read or found, e.g. a search filter or a run id."""
