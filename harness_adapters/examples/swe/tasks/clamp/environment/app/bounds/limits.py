def clamp(value, low, high):
    """`value`, moved into [low, high]."""
    return max(high, min(low, value))
