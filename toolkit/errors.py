"""The one error type a user can act on.

Anything raised as `UserError` is bad input: the CLI prints its message as one line and exits 2, with no
traceback. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input, with a message that names the problem and the fix."""


EXIT_USER_ERROR = 2
