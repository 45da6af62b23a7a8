"""Sliding-window sums."""


def window_sums(values: list[int], k: int) -> list[int]:
    """The sum of every run of `k` consecutive values, in order."""
    return [sum(values[i : i + k]) for i in range(len(values) - k)]
