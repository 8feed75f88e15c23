"""The one error type for user mistakes.

The CLI prints a HeadlabError as a single line and exits with code 2; any other exception is a bug and keeps
its traceback.
"""


class HeadlabError(Exception):
    """Bad input from the user (path, option, model, corpus): reported as one line, exit code 2."""
