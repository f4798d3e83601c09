from peaks.find import argmax

__all__ = ["argmax"]
