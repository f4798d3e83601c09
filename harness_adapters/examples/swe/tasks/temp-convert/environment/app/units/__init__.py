from units.temperature import c_to_f, f_to_c

__all__ = ["c_to_f", "f_to_c"]
