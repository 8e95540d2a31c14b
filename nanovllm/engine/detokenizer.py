class IncrementalDetokenizer:
    """Turns one token at a time into text deltas. It decodes a short window of ids and holds text back
    while the window ends inside a multi-byte character, so spaces and UTF-8 come out as a full decode."""

    CONTEXT = 5  # prompt tokens kept before the output, so the first token's leading space is right

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.kwargs = dict(skip_special_tokens=skip_special_tokens)
        if not spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]
