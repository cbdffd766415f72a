"""Integer arithmetic every layer shares (one copy of each rule)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the blocks that hold a tokens at b per block."""
    return -(-a // b)
