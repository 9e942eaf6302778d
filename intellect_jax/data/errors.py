"""The data pipeline's one exception type."""


class DataError(ValueError):
    """Bad data input (missing path, empty corpus, wrong field, ...).

    The message is one line and names the culprit (file, field, source, value).
    """
