"""Errors that are the user's to fix: train.py prints them as one line, without a traceback."""


class UserError(Exception):
    """A bad setting or input (missing data, corrupt checkpoint, unknown model, ...)."""
