"""A stand-in for a runner that emits the token ids a test chooses: the model's choice is not what those tests
look at, the engine's and the worker's handling of the ids is (stop strings, end tokens, the stream's text)."""


class ChosenIds:
    """Emits its ids, up to the request's max_new_tokens, whatever the prompt."""

    last_prefill_ms = 0.0

    def __init__(self, ids):
        self.ids = list(ids)

    def generate_tokens(self, prompt_ids, params, eos_ids, start=0, prediction=()):
        yield from self.ids[: params.max_new_tokens]
