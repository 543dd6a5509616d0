"""The user-error classes' common base, in the lowest layer so that every layer can subclass it."""


class UserError(Exception):
    """Bad input from the user (a config key, a file, a run directory), not a bug: the CLI prints
    its message as one line, `doremi <command>: error: ...`, and exits with status 2 (a traceback
    only under `--debug`). Every user-error class subclasses it, so the CLI names one class."""


class DataError(UserError, ValueError):
    """Bad data input: one line naming the file, domain or key, what was expected and what was found."""
