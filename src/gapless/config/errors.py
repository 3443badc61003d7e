"""The one error a user's config raises."""


class ConfigError(ValueError):
    """A config problem the user must fix; the message is one line naming the key."""
