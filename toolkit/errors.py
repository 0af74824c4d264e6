"""The one error type a user can act on.

Anything raised as `UserError` is bad input: the CLI prints its message as one line and exits 2, with no
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input, with a message that names the problem and the fix."""


EXIT_USER_ERROR = 2


def options_text(options, *, limit: int = 8, none: str = "degree 1") -> str:
    """The values a message offers after "try": `2, 4, 8`, cut to `limit` with `, ...`, or `none` when there are none
    (by default "degree 1"). Every "try ..." list of degrees in a UserError is written by this one function."""
    words = [str(o) for o in options]
    if not words:
        return none
    return ", ".join(words[:limit]) + (", ..." if len(words) > limit else "")
