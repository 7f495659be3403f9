"""User-facing errors: the CLI prints them as one line and exits with status 2."""


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, command line).

    The message must name the problem and the fix in one line.
    """


class ConfigError(UserError):
    """Invalid configuration (unknown key, wrong type, inconsistent combination)."""


class DataError(UserError):
    """Unusable data (missing path, empty or undecodable file)."""


class CheckpointError(UserError):
    """Unreadable, corrupted or foreign checkpoint directory."""


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss or gradient); the message says what to change."""
