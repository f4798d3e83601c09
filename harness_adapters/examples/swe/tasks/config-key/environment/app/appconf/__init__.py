from appconf.settings import load, timeout

__all__ = ["load", "timeout"]
