"""Whether a sampled request keeps reading the head through its int8 screen.

A sampled step through the screen (kernels/lm_head_screen.py `screened_logits`) reads the int8 copy of the head,
then again in bf16 every row within reach of the draw. On a trained model's peaked logits those are a few rows and
the step reads about half the head's bytes. On flat logits (random weights, or a stretch of text where the model
has no idea) they are most of the vocabulary, read in small gathered rounds, and the step costs more than the
whole bf16 head.

The screen pays while the rows it reads again stay under about a quarter of the vocabulary: past that, the rows
read again in small rounds cost as much as the bytes the int8 pass saved (docs/fast-path.md).

The runner reads each step's count from the host ring (the rescore kernel's tally) as it hands out the step's
token, and leaves the screen for the rest of the request once the mean over the last WINDOW steps passes that
share. The decision is one-way: the whole head reports no counts to come back by, and a request whose logits were
flat for a window of steps stays so more often than not. The steps before the switch, MIN_STEPS and the LOOKAHEAD
queued behind them, still read the screen, which costs a random-weights request a little against the whole head.
"""

from collections import deque

WINDOW = 16  # steps the mean is over
MIN_STEPS = 4  # steps seen before the first decision: one flat step of a peaked request does not decide
BREAK_EVEN_SHARE = 0.25  # of the vocabulary: above it a screened step costs about the whole head's


class ScreenWatch:
    """Fed the candidate count of each screened sampled step in order; says whether the next steps should still
    go through the screen."""

    def __init__(self, vocab_size: int, share: float = BREAK_EVEN_SHARE, window: int = WINDOW,
                 min_steps: int = MIN_STEPS):  # fmt: skip
        if not 0 <= share <= 1:
            raise ValueError(f"share: expected a fraction of the vocabulary in [0, 1], got {share}")
        if not 1 <= min_steps <= window:
            raise ValueError(f"min_steps: expected 1 <= min_steps <= window ({window}), got {min_steps}")
        self.limit = share * vocab_size
        self.min_steps = min_steps
        self.counts: deque[int] = deque(maxlen=window)
        self.left = False

    def keeps_screen(self, candidates: int) -> bool:
        """Takes one step's count; False from the step whose window's mean passes the limit on (and after)."""
        if self.left:
            return False
        self.counts.append(candidates)
        if len(self.counts) >= self.min_steps and sum(self.counts) > self.limit * len(self.counts):
            self.left = True
        return not self.left
