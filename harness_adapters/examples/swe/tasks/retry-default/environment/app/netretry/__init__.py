from netretry.policy import call_with_retries

__all__ = ["call_with_retries"]
