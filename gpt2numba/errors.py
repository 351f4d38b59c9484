"""The project's exceptions: one root, so callers can catch everything we raise."""


class GPT2NumbaError(Exception):
    """Root of every error gpt2numba raises on purpose."""


class TokenError(GPT2NumbaError, ValueError):
    """A prompt or token id has a bad value: empty, or outside [0, vocab)."""


class TokenTypeError(GPT2NumbaError, TypeError):
    """A prompt or token id is not an integer (a float, bool, string, ...)."""


class CacheFullError(GPT2NumbaError, ValueError):
    """The tokens do not fit in the room left in the ModelCache."""


class CacheError(GPT2NumbaError, ValueError):
    """A cache cannot be forked or copied as asked: not a ModelCache, another config, a bad length."""


class ConfigError(GPT2NumbaError, ValueError):
    """A configuration is invalid, or a cache and weights disagree on it."""


class CheckpointError(GPT2NumbaError, ValueError):
    """A checkpoint cannot be used: unreadable, wrong tensors, bad values."""


class CheckpointNotFoundError(GPT2NumbaError, FileNotFoundError):
    """A checkpoint path does not exist."""


class BatchError(GPT2NumbaError, ValueError):
    """A batch is malformed: empty, sequences and caches that differ in number, a cache given twice."""


class SamplingError(GPT2NumbaError, ValueError):
    """A generation setting is out of its range."""


class GrammarError(GPT2NumbaError, ValueError):
    """A structured-output constraint cannot be used: a JSON schema, regex, choice or grammar that does not
    compile, two of them at once, or llguidance missing. ``argument`` names the one at fault (None for none
    in particular) and ``detail`` says what is wrong with it, so that the server and the command line can name
    their own field or flag; the message is "argument: detail"."""

    def __init__(self, detail: str, argument: str | None = None):
        super().__init__(detail if argument is None else f"{argument}: {detail}")
        self.detail, self.argument = detail, argument


class PartialBatchError(GPT2NumbaError):
    """Some of a batch's ``total`` sequences failed during the work, each alone (its sampling, its constraint, its
    draft, a bug), and every other one finished: raised by generate_batch, generate_text_batch and
    beam_search_batch once the others are done. ``errors`` maps each failed one's index (as the function numbers
    its results) to its exception; ``results`` is what the function returns, None in each failed one's place
    (None for generate_batch, whose tokens came as they were made). The message names the failed indices and the
    first one's error."""

    def __init__(self, errors: dict[int, Exception], total: int, results: list | None = None):
        failed = sorted(errors)
        named = ", ".join(map(str, failed[:10])) + (", ..." if len(failed) > 10 else "")
        first = errors[failed[0]]
        super().__init__(f"{len(failed)} of {total} failed ({named}), the others finished; "
                         f"{failed[0]}: {type(first).__name__}: {first}")
        self.errors, self.total, self.results = errors, total, results

    def __reduce__(self):  # (pickled as it was made: a Ray task or a process pool can hand it on)
        return type(self), (self.errors, self.total, self.results)
