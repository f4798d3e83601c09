from appconf.defaults import DEFAULTS


def load(overrides=None):
    """The defaults, updated with the overrides."""
    settings = dict(DEFAULTS)
    settings.update(overrides or {})
    return settings


def timeout(settings):
    """The timeout in seconds, from loaded settings."""
    return settings.get("time_out", 10)
