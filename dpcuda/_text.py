"""The one-line form of an error, for the one-line messages of the command line and the
library's checks."""


def first_line(err, limit=200):
    """err's message, its first line (at most `limit` characters), or its type's name."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__
