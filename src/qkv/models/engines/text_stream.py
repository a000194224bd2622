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

    Each push decodes a few tokens, not all of them: the text is the text before a window
    of the last tokens, then the window decoded alone. The window moves up to
    :data:`WINDOW` tokens before the newest only where that is seen to give the same text:
    the window's tokens decoded alone are the end of the whole text, and not empty (a
    SentencePiece decoder drops a first space, and a lone space token decodes to nothing).
    Decoding them all at every token had cost a stream of ``N`` tokens ``N**2 / 2`` token
    decodes: Gemma 3's tokenizer took 0.6 ms a token by the 1,000th and 2.3 ms by the
    4,000th, on the thread that steps every request of a server. Where a window's text
    stops beginning with what it began with (a decoder that rewrites across more tokens),
    all the tokens are decoded, as they always were.

    Parameters
    ----------
    tokenizer
        Anything with ``decode(ids) -> str``.
    stop : sequence of str
        Stop strings: the text is cut before them, so none of one is ever shown.
    """

    #: Tokens kept in the window behind the newest (a character split over byte tokens takes up to 4).
    WINDOW = 6

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.hold = max((len(x) for x in stop), default=0)  # the token completing a stop string is shown before the check
        self.start, self.before, self.base = 0, "", ""  # the window's first token, the text before it, and the window's text when last decoded

    @property
    def text(self) -> str:
        """The text of all the tokens, as of the last push that ended on a whole character."""
        return self.before + self.base

    def push(self, tok: int) -> str:
        """Add one token; return the text that can be shown now (maybe '')."""
        self.ids.append(int(tok))
        text = self._decoded()
        if text is None:  # a character split over byte tokens: wait for the rest
            return ""
        ready = text[: max(0, len(text) - self.hold)]  # (a negative end would count from the end)
        if len(ready) > len(self.shown) and ready.startswith(self.shown):
            delta, self.shown = ready[len(self.shown) :], ready
            return delta
        return ""

    def _decoded(self) -> str | None:
        """``tokenizer.decode(self.ids)``, by the window; None while it ends in a split character."""
        piece = self.tokenizer.decode(self.ids[self.start :])
        if piece.endswith("\ufffd"):
            return None
        if piece.startswith(self.base):
            text = self.before + piece
        else:  # the window's text changed where it overlaps the old: the whole decode, the window from the start
            text = piece = self.tokenizer.decode(self.ids)
            self.start, self.before = 0, ""
        self.base = piece
        start = len(self.ids) - self.WINDOW
        if start > self.start:
            window = self.tokenizer.decode(self.ids[start:])
            if window and text.endswith(window):  # the window decodes alone as it does in the whole
                self.start, self.before, self.base = start, text[: len(text) - len(window)], window
        return text

    def finish(self, text: str) -> str:
        """The rest of the final ``text`` (which a stop string may have cut) after what was shown."""
        rest = text[len(self.shown) :] if text.startswith(self.shown) else ""
        self.shown = text
        return rest
