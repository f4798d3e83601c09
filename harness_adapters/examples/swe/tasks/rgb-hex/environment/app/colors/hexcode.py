def to_hex(red, green, blue):
    """'#rrggbb' for three channels from 0 to 255."""
    return "#" + "".join(f"{channel:x}" for channel in (red, green, blue))
