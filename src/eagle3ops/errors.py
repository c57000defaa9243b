"""Errors that mean 'the input is wrong', reported as one clear line naming the file, line or key."""


class InputError(ValueError):
    """Bad user input: params, datasets, model or checkpoint directories."""
