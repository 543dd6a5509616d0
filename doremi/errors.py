from data.errors import UserError


class DoReMiError(UserError, ValueError):
    """Bad DoReMi input: one line naming the file or key, what was expected and what was found."""
