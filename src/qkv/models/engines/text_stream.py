"""New tokens as text, piece by piece, never showing what a stop string or a split character may take back.

Streaming a model's output (``qkv generate``, ``qkv serve``) meets two traps:
a character written in several byte tokens decodes to U+FFFD until its last
byte comes, and a stop string is only recognised once its last token is
there, when its beginning was already shown. :class:`TextStream` holds back
both: an incomplete character, and as many characters as the longest stop
string could have begun with.

>>> class Chars:                                   # a toy tokenizer: a token is a character code
...     def decode(self, ids): return "".join(map(chr, ids))
>>> s = TextStream(Chars(), stop=["END"])
>>> [s.push(ord(c)) for c in "hi E"]               # three characters held: they could start END
['', '', '', 'h']
>>> s.finish("hi ")                                # the text, cut before the stop string
'i '
"""

from __future__ import annotations

__all__ = ["TextStream"]


class TextStream:
    """The text of tokens as they come (``tokenizer.decode`` of them all, shown once it is safe).

    Parameters
    ----------
    tokenizer
        Anything with ``decode(ids) -> str``.
    stop : sequence of str
        Stop strings: the text is cut before them, so none of one is ever shown.
    """

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.hold = max((len(x) for x in stop), default=0)  # the token completing a stop string is shown before the check

    def push(self, tok: int) -> str:
        """Add one token; return the text that can be shown now (maybe '')."""
        self.ids.append(int(tok))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character split over byte tokens: wait for the rest
            return ""
        ready = text[: max(0, len(text) - self.hold)]  # (a negative end would count from the end)
        if len(ready) > len(self.shown) and ready.startswith(self.shown):
            delta, self.shown = ready[len(self.shown) :], ready
            return delta
        return ""

    def finish(self, text: str) -> str:
        """The rest of the final ``text`` (which a stop string may have cut) after what was shown."""
        rest = text[len(self.shown) :] if text.startswith(self.shown) else ""
        self.shown = text
        return rest
