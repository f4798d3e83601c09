def call_with_retries(action, retries=0):
    """Call `action` until it returns without raising, at most 1 + `retries` times (`retries` is 3
    unless given); the last error is raised again."""
    for attempt in range(retries + 1):
        try:
            return action()
        except Exception:
            if attempt == retries:
                raise
