"""Errors that are the user's to fix: train.py prints them as one line, without a traceback."""


class UserError(Exception):
    """A bad setting or input (missing data, corrupt checkpoint, unknown model, ...)."""


def first_line(error: BaseException) -> str:
    """An error's first line (its type for an empty message), for a one-line UserError."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
