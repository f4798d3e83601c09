DEFAULTS = {"timeout": 30, "retries": 2}
