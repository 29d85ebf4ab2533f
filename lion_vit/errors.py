"""Errors that are the user's to fix: train.py prints them as one line, without a traceback."""


class UserError(Exception):
    """A bad setting or input (missing data, corrupt checkpoint, unknown model, ...)."""


def first_line(error: BaseException) -> str:
    """An error's first line (its type for an empty message), for a one-line UserError."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_WORKER = "Caught UserError in DataLoader worker process"


def user_message(error: UserError) -> str:
    """A UserError's line. One raised in a DataLoader worker comes back from torch with the worker's traceback as
    its message; its line is that traceback's last."""
    text = str(error)
    if text.startswith(_WORKER):
        return text.strip().rsplit(f"{UserError.__name__}: ", 1)[-1]
    return text
