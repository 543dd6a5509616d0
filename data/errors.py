class DataError(ValueError):
    """Bad data input: one line naming the file, domain or key, what was expected and what was found."""
