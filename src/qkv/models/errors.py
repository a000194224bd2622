"""The one error type of model loading, and the warning of a text cut to the model's length."""

from __future__ import annotations

__all__ = ["ModelError", "TruncationWarning", "describe_lines"]


class ModelError(ValueError):
    """A model file or directory that qkv cannot load; the message names the file and the entry."""


class TruncationWarning(UserWarning):
    """Texts longer than the model's ``max_seq_length`` were cut to it.

    ``numbers`` are the texts concerned: positions in the list given to
    ``encode`` (from 0), or line numbers of a file (from 1, as editors count);
    ``count`` is how many in all (``numbers`` may hold only the first ones).
    """

    def __init__(self, message: str, numbers=(), count: int | None = None):
        super().__init__(message)
        self.numbers = list(numbers)
        self.count = len(self.numbers) if count is None else count


def describe_lines(numbers, count: int, shown: int = 5) -> str:
    """``"lines 3, 8 and 12"`` or ``"lines 3, 8, 12, 14, 20 and 7 more"``: a message's list of line numbers.

    >>> describe_lines([4], 1), describe_lines([1, 2, 3], 3), describe_lines(range(1, 9), 8, shown=3)
    ('line 4', 'lines 1, 2 and 3', 'lines 1, 2, 3 and 5 more')
    """
    numbers = [int(n) for n in numbers][:shown]
    if count == 1:
        return f"line {numbers[0]}"
    rest = count - len(numbers)
    if rest > 0:
        return f"lines {', '.join(map(str, numbers))} and {rest} more"
    return f"lines {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"
