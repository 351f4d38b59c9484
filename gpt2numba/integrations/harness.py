"""gpt2numba as a model of EleutherAI's lm-evaluation-harness (the optional extra [eval]).

    import gpt2numba.harness                      # registers the model "gpt2numba"
    lm_eval.simple_evaluate(model="gpt2numba", model_args="model=PATH,dtype=float32", tasks=[...])

    python -m gpt2numba.harness --model gpt2numba --model_args model=PATH --tasks ...

The `lm_eval` command finds models only among its own, so `python -m gpt2numba.harness`
registers this one and then runs the harness's own command line, with its arguments.
Requests go through the harness's own rules (TemplateLM: how context and continuation
are tokenised, the empty context, rolling windows); the arithmetic is gpt2numba's
scoring and generation, batched.
"""

from __future__ import annotations

import sys

import numpy as np
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from ..decoding.sample import generate_batch
from ..errors import ConfigError
from ..model.forward import set_threads
from ..text.scoring import _score_ends
from ..text.tokenizer import load_tokenizer


@register_model("gpt2numba")
class GPT2NumbaLM(TemplateLM):
    """The harness's LM interface over gpt2numba.

    model: a checkpoint directory, .safetensors file or hub name (default: $GPT2NUMBA_WEIGHTS, else
    random GPT-2 small); dtype: float32, bfloat16, int8 or int4; activations: float32, or bfloat16 with bfloat16
    weights (docs/formats.md); threads; batch_size: sequences generated
    together; max_gen_toks: the default cap of generate_until (256, or half a shorter context); max_length:
    the context the harness may use (default n_positions; as the HF backend's argument); share_prefix: requests
    that begin alike (a context and its continuations) run their shared rows once, forked for each (default
    True; the numbers are the same to float32 rounding). The harness's device and max_batch_size arguments
    mean nothing on this CPU engine and are ignored.
    """

    def __init__(self, model: str | None = None, dtype: str = "float32", activations: str = "float32",
                 threads: int | None = None,
                 batch_size: int | str = 16, max_gen_toks: int | None = None, max_length: int | None = None,
                 share_prefix: bool | str = True, device=None, max_batch_size=None):
        super().__init__()
        from ..model.models import resolve_model

        if threads is not None:
            set_threads(int(threads))
        self.w, path, self.source = resolve_model(model, dtype, activations)
        self.tokenizer = load_tokenizer(path)
        n_positions = self.w.config.n_positions
        self._max_length = n_positions if max_length is None else int(max_length)
        if not 2 <= self._max_length <= n_positions:
            raise ConfigError(f"max_length must be in [2, {n_positions}] (n_positions), got {max_length!r}")
        self.share_prefix = share_prefix if isinstance(share_prefix, bool) else str(share_prefix).lower() == "true"
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        # the HF backend's default, 256, as far as the context leaves room for a prompt
        self.max_gen_toks = min(256, self.max_length // 2) if max_gen_toks is None else int(max_gen_toks)
        if not 1 <= self.max_gen_toks < self.max_length:
            raise ConfigError(f"max_gen_toks must be in [1, {self.max_length}), got {max_gen_toks!r}")

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), whether it is the greedy one) per (key, context ids, continuation ids).

        As the harness's HF backend: the last n_positions + 1 tokens of context + continuation, the
        model fed all but the last, the continuation's tokens scored from the positions before them.
        """
        seqs = [np.asarray((list(ctx) + list(cont))[-(self.max_length + 1):], np.int64) for _, ctx, cont in requests]
        counts = [min(len(cont), len(ids) - 1) for (_, _, cont), ids in zip(requests, seqs)]
        return [(float(logprobs.sum()), bool(greedy.all()))
                for logprobs, greedy in _score_ends(seqs, counts, self.w, share=self.share_prefix)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) over the harness's rolling windows: every token predicted once, the first from <|endoftext|>."""
        out = []
        for (text,) in [req.args for req in requests]:
            windows = [(None, ctx, cont) for ctx, cont in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))]
            out.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generation up to a stop sequence or max_gen_toks, as the HF backend: greedy unless do_sample,
        the context cut from the left to leave room, the text cut at the first stop sequence."""
        eos = self.tok_decode([self.eot_token_id])
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[int], list[str]]]] = {}
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if not 1 <= max_gen < self.max_length:
                raise ConfigError(f"max_gen_toks must be in [1, {self.max_length}), got {max_gen}")
            do_sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0))
            sampling = (temperature if do_sample else 0.0,
                        kwargs.pop("top_k", None), kwargs.pop("top_p", None), kwargs.pop("seed", None))
            kwargs.pop("max_length", None)
            if kwargs:
                raise ConfigError(f"generation arguments gpt2numba does not take: {sorted(kwargs)}")
            ids = (self.tok_encode(context) or [self.eot_token_id])[-(self.max_length - max_gen):]
            groups.setdefault((max_gen, *sampling), []).append((i, ids, until))
        for (max_gen, temperature, top_k, top_p, seed), items in groups.items():
            tokens = {n: [] for n in range(len(items))}
            for n, token in generate_batch([ids for _, ids, _ in items], self.w, max_new_tokens=max_gen,
                                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                           batch_size=self.batch_size):
                tokens[n].append(token)
            for n, (i, _, until) in enumerate(items):
                text = self.tok_decode([t for t in tokens[n] if t != self.eot_token_id])
                for stop in until:
                    if stop:
                        text = text.split(stop)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def main(argv: list[str] | None = None) -> None:
    """The harness's own command line, with the model "gpt2numba" registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()



if __name__ == "__main__":
    main()
