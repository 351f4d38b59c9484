"""Continuous batching: sequences in flight, each in its own cache; one forward pass a step over all of them.

A sequence joins between steps: its prompt is prefilled in the same pass as the
others' next tokens (a one-token "prompt" is a decode row, so prefill_batch
serves both); with a budget of prompt rows per step, a long prompt runs in chunks
over several steps (chunked prefill, as vLLM and llama.cpp's server do), so the
sequences in flight keep their pace. It leaves when it finishes, or when its
owner removes it. Used by
generate_batch (a fixed list of prompts) and by the server (requests that come
and go); the caller checks prompts and settings first.

Sequences that start from one prompt (n samples of it) share a SharedPrompt: the
first of them to run prefills the prompt, the others read its cache's rows in place
(ModelCache.copy_prefix shares them) and sample their first token from the same logits.

A sequence's own work in a step (its sampling, its constraint's matcher, its draft, whether it ends) is its own:
what it raises fails it alone (a Fault in the step's result), and the others go on as without it, each with its
own random stream and cache. The forward pass is every sequence's: what it raises, the step raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..model.forward import prefill_batch
from ..model.kvcache import ModelCache, check_kv_dtype
from ..model.weights import GPT2Weights
from ..text.tokenizer import EOT_ID
from . import speculative
from .constraints import Constraint, Matcher
from .prefixes import PrefixCache


# Prompt rows a step may feed when no sequence is decoding (a budget smaller than this grows to it): there is
# no pace to keep, and small chunks would read the weights once a chunk (a lone 512-token prompt's first token
# took 3.6 s in 16-row chunks against 1.8 s in 32-row ones; docs/serving.md). 256 rows keep the products
# arithmetic-bound while the step's time, and the workspace it sizes, stay bounded.
IDLE_PROMPT_ROWS = 256


class SharedPrompt:
    """One prompt prefilled once for ``uses`` sequences (each Batch.add with it counts one).

    Until it has run, ``leader`` is the sequence that prefills it; sequences added meanwhile
    wait for that step and take the leader's rows (read in place). After it, while sequences are still to be
    added, ``cache`` keeps the prompt's rows and ``logits`` (vocab,) what follows them.
    """

    def __init__(self, uses: int):
        assert uses >= 1
        self.uses = uses
        self.leader: Sequence | None = None
        self.cache: ModelCache | None = None
        self.logits: np.ndarray | None = None


@dataclass(eq=False)
class Sequence:
    """One sequence in flight. ids: the prompt, then each token as it is chosen."""

    ids: list[int]
    max_new_tokens: int
    sampler: object  # sample.Sampler: (logits (vocab,), ids so far, rng, prompt_len) -> token id; its eos ids
    rng: np.random.Generator
    stop_ids: tuple[int, ...]  # the ids that end it (its sampler's eos ids), none when it does not stop at eos
    cache: ModelCache | None  # None once the sequence has left its batch
    prompt_len: int = field(init=False)
    feed: list[int] = field(init=False)  # what the next pass feeds: the prompt, then the last token
    shared: SharedPrompt | None = None  # its prompt's rows come from the leader of this, if not fed
    pending: np.ndarray | None = None  # (vocab,) logits after its prompt, when it copied them ready-made
    reserved: int = 0  # the positions its batch holds for it (Batch.need)
    matcher: Matcher | None = None  # its constraint's state (structured output), if it has one
    drafter: object = None  # its draft's state (speculative.ModelDraft or PromptLookup), when its batch speculates
    k: int = 0  # the tokens it drafts a step (its batch's num_speculative_tokens, or adapted)

    def __post_init__(self):
        self.prompt_len = len(self.ids)
        self.feed = list(self.ids)

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def complete(self) -> bool:
        """Whether its constraint's text is complete (it then ends), if it has one."""
        return self.matcher is not None and self.matcher.done

    def ends(self, token: int) -> bool:
        """Whether ``token``, just appended, ends it: a stop id, its last new token, its constraint's text done."""
        return token in self.stop_ids or self.new_tokens == self.max_new_tokens or self.complete


@dataclass(frozen=True, eq=False)
class Fault:
    """A sequence that failed in a step, alone: its sampling, its constraint, its draft or its end raised
    ``error``. It has left its batch as a finished sequence does (its caches gone); the step's other sequences
    went on as they would have without it."""

    sequence: Sequence
    error: Exception


class Batch:
    """At most ``size`` sequences in flight over the weights ``w``, each in a cache of ``kv_dtype``
    (kvcache.KV_DTYPES, checked); with ``prefixes`` (of the same kv_dtype), a prompt starts from the
    longest prefix cached there, and every prompt that runs is stored there. With ``speculation``
    (speculative.plan's), every sequence without a constraint drafts tokens that the step checks, in the same
    pass as the others' rows (``stats`` counts them)."""

    def __init__(self, w: GPT2Weights, size: int, prefixes: PrefixCache | None = None, kv_dtype: str = "float32",
                 max_positions: int | None = None, speculation: speculative.Speculation | None = None):
        self.w, self.size, self.prefixes, self.kv_dtype = w, size, prefixes, check_kv_dtype(kv_dtype)
        self.speculation, self.stats = speculation, speculative.Stats()
        # the cache positions its sequences may own at once (None: as many as they ask), each sequence
        # reserving what it may write when it is added (need), released when it leaves
        self.max_positions = max_positions
        self.in_flight = (0, 0)  # positions() after the last step: plain ints another thread may read
        self.sequences: list[Sequence] = []
        self.paused: list[Sequence] = []  # out of the steps for now, their caches kept (pause, resume)
        self._logits = np.empty((size, w.config.vocab_size), np.float32)  # (size, vocab), reused by every step

    @property
    def full(self) -> bool:
        return len(self.sequences) >= self.size

    def need(self, ids: list[int], max_new_tokens: int, shared: SharedPrompt | None = None) -> int:
        """The positions a sequence added now may write into its own cache: its prompt but what it will read
        in place (a prefix cache's blocks, or a shared prompt that another sequence runs), and its tokens."""
        if self.speculation is not None and self.speculation.draft is not None and not self.speculation.shares:
            return len(ids) + max_new_tokens  # (a draft model with its own cache reads the whole prompt there)
        if shared is not None and (shared.cache is not None or shared.leader is not None):
            return max_new_tokens
        return len(ids) - (self.prefixes.cached(ids) if self.prefixes is not None else 0) + max_new_tokens

    @property
    def reserved(self) -> int:
        """The positions reserved by the sequences in flight (in the steps or paused)."""
        return sum(s.reserved for s in self.sequences + self.paused)

    def admits(self, need: int) -> bool:
        """Whether a sequence that needs ``need`` positions fits beside those reserved."""
        return self.max_positions is None or self.reserved + need <= self.max_positions

    def positions(self) -> tuple[int, int]:
        """(Positions the caches in flight hold in arrays of their own, positions they read in place: a
        prefix cache's blocks, a shared prompt's rows.) Each position costs ModelCache.position_bytes."""
        caches = [s.cache for s in self.sequences + self.paused if s.cache is not None]
        return sum(mc.length - mc.shared for mc in caches), sum(mc.shared for mc in caches)

    def add(self, ids: list[int], *, max_new_tokens: int, sampler, rng: np.random.Generator,
            stop_at_eos: bool = True, shared: SharedPrompt | None = None,
            constraint: Constraint | None = None) -> Sequence:
        """A new sequence, prefilled in the next step; ids (checked) plus max_new_tokens >= 1 fit n_positions.

        With ``shared`` (made for these very ids), the prompt is prefilled once for all its uses. With
        ``constraint``, each token keeps its text inside it, and it ends when the text is complete.
        """
        assert not self.full and max_new_tokens >= 1
        need = self.need(ids, max_new_tokens, shared)
        assert self.admits(need)
        cache = ModelCache(self.w.config, max_len=len(ids) + max_new_tokens, dtype=self.kv_dtype)
        seq = Sequence(list(ids), max_new_tokens, sampler, rng, _stop_ids(sampler) if stop_at_eos else (), cache)
        seq.reserved = need
        seq.matcher = Matcher(constraint) if constraint is not None else None
        if self.speculation is not None and constraint is None:
            seq.drafter, seq.k = self.speculation.drafter(cache), self.speculation.first_k
        if shared is not None:
            assert shared.uses >= 1
            shared.uses -= 1
            seq.shared = shared
            if shared.cache is not None:  # prefilled in an earlier step: take its rows now (shared, not copied)
                cache.copy_prefix(shared.cache)
                seq.feed, seq.pending = [], shared.logits
                if shared.uses == 0:
                    shared.cache = shared.logits = None
            elif shared.leader in self.sequences:  # to be prefilled in the next step
                seq.feed = []
            else:
                shared.leader = seq
        if seq.feed and self.prefixes is not None:
            del seq.feed[: self.prefixes.load(seq.ids, cache)]
        self.sequences.append(seq)
        return seq

    def pause(self, seq: Sequence) -> None:
        """Take a decoding sequence out of the steps, its cache kept, so that its place can go to another;
        resume(seq) puts it back, to go on as if it had not paused."""
        assert seq.new_tokens > 0 and seq.feed  # its prompt has run (no sequence waits on it), a token to feed
        self.sequences.remove(seq)
        self.paused.append(seq)

    def resume(self, seq: Sequence) -> None:
        assert not self.full
        self.paused.remove(seq)
        self.sequences.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Stop a sequence now (its cache goes with it). A leader whose prompt has not run hands it on."""
        if seq in self.paused:
            self.paused.remove(seq)
            seq.cache = seq.drafter = None
            return
        self.sequences.remove(seq)
        seq.drafter = None  # (its draft's cache, and the model's it reads)
        shared = seq.shared
        if shared is not None and shared.leader is seq and seq.cache.length < seq.prompt_len:
            waiting = [s for s in self.sequences if s.shared is shared and not s.feed and s.pending is None]
            shared.leader = waiting[0] if waiting else None
            if waiting:  # it runs the prompt now: the leader's reservation goes with it
                waiting[0].reserved += seq.reserved - seq.max_new_tokens
                waiting[0].feed = list(waiting[0].ids)
                if self.prefixes is not None:
                    del waiting[0].feed[: self.prefixes.load(waiting[0].ids, waiting[0].cache)]
        seq.cache = None  # whoever still holds the sequence, its memory is free

    def step(self, max_prompt_rows: int | None = None) -> list[tuple[Sequence, int, bool, np.ndarray] | Fault]:
        """One forward pass over every sequence: (sequence, its new token, whether it is done, its logits), in
        order; a sequence that speculates may have several tokens in a step, the last of them ending it if one does.
        A sequence whose own work raised is a Fault instead, after any token it had in the step, and has left.

        With ``max_prompt_rows``, a step feeds at most that many prompt rows in all (the earliest added
        first; IDLE_PROMPT_ROWS if larger and no sequence is decoding), and a prompt cut short goes on in
        the next step; every decode row runs. So a long prompt is prefilled in chunks beside the other
        sequences' tokens instead of holding them up for its whole length (chunked prefill). Only sequences
        whose prompt has run sample a token; the rest are not in the result. A row of logits (vocab,) is
        valid until the next step. A done sequence has left the batch, and its cache is gone (cache None).
        """
        seqs = list(self.sequences)
        if not seqs:
            return []
        rows = self._rows(seqs, max_prompt_rows)  # sequence -> rows it feeds now
        out: list = []  # the step's tokens and faults
        drafts = self._draft(rows, out)  # sequence -> (its drafted tokens, fed after its last token; their q or None)
        fed = list(rows)
        started = time.perf_counter()
        logits = self._pass(fed, rows, drafts) if fed else []
        if drafts:
            self.stats.verify_seconds += time.perf_counter() - started
            self.stats.passes += 1
        for seq in fed:
            del seq.feed[: rows[seq]]
        plain = [s for s in fed if s not in drafts]
        row_of = {s: row for s, row in zip(plain, logits) if not s.feed}  # those whose prompt (or token) is in
        blocks, end = {}, len(plain)  # a drafting sequence's rows: after its last token and after each draft
        for seq in drafts:
            blocks[seq], end = logits[end: end + rows[seq]], end + rows[seq]
        if self.prefixes is not None:
            for seq in row_of:
                if seq.new_tokens == 0:  # its prompt has just run
                    self.prefixes.store(seq.ids, seq.cache)
        for seq in seqs:
            if seq not in rows and self._ready(seq, row_of):
                row_of[seq] = self._share(seq, row_of)
        for seq in fed:
            shared = seq.shared
            if shared is not None and shared.leader is seq and seq in row_of:  # its prompt has run: keep it
                if shared.uses > 0:
                    shared.cache = seq.cache.fork(max_len=len(seq.ids))
                    shared.logits = row_of[seq].copy()
                shared.leader = None
        for seq in seqs:
            try:
                if seq in blocks:
                    self._settle(seq, blocks[seq], *drafts[seq], out)
                elif seq in row_of:
                    self._choose(seq, row_of[seq], out)
            except Exception as e:  # (its own: a SamplingError "every token is banned", its matcher's, a bug)
                out.append(self._fault(seq, e))
        self.in_flight = self.positions()
        return out

    def _choose(self, seq: Sequence, row: np.ndarray, out: list) -> None:
        """A sequence's token from its logits ``row``, into ``out`` as step() gives it."""
        token = next_token(seq.sampler, row, seq.ids, seq.rng, seq.prompt_len, seq.matcher)
        seq.ids.append(token)
        done = seq.ends(token)
        if done:
            self.remove(seq)
        else:
            seq.feed = [token]
        out.append((seq, token, done, row))

    def _fault(self, seq: Sequence, error: Exception) -> Fault:
        """A sequence's own work raised ``error``: it leaves, as a finished one does."""
        if seq in self.sequences:
            self.remove(seq)
        return Fault(seq, error)

    def _draft(self, rows: dict[Sequence, int], faults: list) -> dict:
        """The drafts of the decoding sequences that speculate (batched: speculative.propose_all), each fed after
        its last token now; those that drafted none are left out, and one whose draft raised leaves unfed (its
        Fault into ``faults``). While more sequences are in flight than the speculation's max_batch (prompts being
        prefilled count: a longer step holds them up), only those that sample draft: a greedy sequence's tokens
        are the same either way, a sampled one's would then depend on what runs beside it. The greedy ones share
        MAX_DRAFT drafted rows a step (a sampled one drafts its own k, which only its own history sets)."""
        if self.speculation is None:
            return {}
        decoding = [s for s in rows if s.new_tokens > 0 and s.drafter is not None]
        greedy = {s for s in decoding if getattr(s.sampler, "temperature", 0) == 0}
        seqs = decoding if len(self.sequences) <= self.speculation.max_batch else [
            s for s in decoding if s not in greedy]
        if not seqs:
            return {}
        share = max(1, speculative.MAX_DRAFT // len(seqs))
        cap = {s: share if s in greedy else s.k for s in seqs}
        started = time.perf_counter()
        drafts = speculative.propose_all([(s.drafter, s.ids, min(s.k, cap[s], s.max_new_tokens - s.new_tokens - 1),
                                           s.sampler, s.rng, s.prompt_len) for s in seqs])
        self.stats.draft_seconds += time.perf_counter() - started
        for seq, drafted in zip(seqs, drafts):
            if isinstance(drafted, Exception):
                del rows[seq]
                faults.append(self._fault(seq, drafted))
        drafts = {s: d for s, d in zip(seqs, drafts) if not isinstance(d, Exception) and d[0]}
        for seq, (tokens, _) in drafts.items():
            seq.feed += tokens
            rows[seq] = len(seq.feed)
        return drafts

    def _pass(self, fed: list[Sequence], rows: dict[Sequence, int], drafts: dict) -> np.ndarray:
        """One forward pass over the rows fed: logits after each sequence's last row, then each drafting
        sequence's rows (after its last token and after each draft), in that order, valid until the next step."""
        order = [s for s in fed if s not in drafts] + list(drafts)
        R = len(order) - len(drafts) + sum(rows[s] for s in drafts)
        if self._logits.shape[0] < R <= self.size * (speculative.ADAPTIVE[2] + 1):  # kept (past it: this step's)
            self._logits = np.empty((R, self._logits.shape[1]), np.float32)
        out = self._logits[:R] if R <= self._logits.shape[0] else None
        return prefill_batch([s.feed[: rows[s]] for s in order], self.w, [s.cache for s in order],
                             out=out, every_row=[s in drafts for s in order] if drafts else None)

    def _settle(self, seq: Sequence, block: np.ndarray, drafted: list[int], qs, out: list) -> None:
        """A drafting sequence's step: the drafts its model keeps and its own token (speculative.settle), each
        into ``out`` as step() gives tokens, up to the one that ends it."""
        new, seq.k = speculative.settle(block, drafted, qs, seq.ids, seq.cache, seq.sampler, seq.rng, seq.prompt_len,
                                        self.speculation, seq.k, self.stats)
        for token, row in zip(new, block):
            seq.ids.append(token)
            done = seq.ends(token)
            out.append((seq, token, done, row))
            if done:
                self.remove(seq)
                return
        seq.feed = [new[-1]]

    @staticmethod
    def _rows(seqs: list[Sequence], max_prompt_rows: int | None) -> dict[Sequence, int]:
        """The rows each sequence feeds in this step: its token, or as much of its prompt as the budget
        leaves, in the order the sequences were added (the first prompt finishes first). With no token to
        decode there is no pace to keep, and the budget grows to IDLE_PROMPT_ROWS."""
        decoding = any(seq.feed and seq.new_tokens > 0 for seq in seqs)
        rows, budget = {}, max_prompt_rows
        if budget is not None and not decoding:
            budget = max(budget, IDLE_PROMPT_ROWS)
        for seq in seqs:
            if not seq.feed:
                continue
            if seq.new_tokens > 0 or budget is None:  # a decode row, or no budget
                rows[seq] = len(seq.feed)
            elif budget > 0:
                rows[seq] = min(len(seq.feed), budget)
                budget -= rows[seq]
        return rows

    @staticmethod
    def _ready(seq: Sequence, row_of: dict) -> bool:
        """A sequence that was not fed has logits now: ready-made, or its leader's prompt has just run (not:
        its own prompt waits for the budget, or its leader's is still running)."""
        return not seq.feed and (seq.pending is not None or seq.shared.leader in row_of)

    @staticmethod
    def _share(seq: Sequence, row_of: dict) -> np.ndarray:
        """The logits after the prompt of a sequence that was not fed: ready-made, or from its leader, which
        has just run (its cache then holds the prompt; the token it samples now is not in it yet)."""
        if seq.pending is not None:
            row, seq.pending = seq.pending, None
            return row
        leader = seq.shared.leader
        seq.cache.copy_prefix(leader.cache)
        return row_of[leader]


def next_token(sampler, logits, ids, rng, prompt_len, matcher: Matcher | None) -> int:
    """sampler's token after ``ids`` from ``logits``, under ``matcher``'s mask where there is one (which then
    takes the token): how generate and a batch's step choose."""
    if matcher is None:
        return sampler(logits, ids, rng, prompt_len)
    token = sampler(logits, ids, rng, prompt_len, matcher.allowed())
    matcher.advance(token)
    return token


def _stop_ids(sampler) -> tuple[int, ...]:
    """The ids that end a sequence: its Sampler's eos_token_id; a plain callable's, <|endoftext|>."""
    processors = getattr(sampler, "processors", None)
    return (EOT_ID,) if processors is None else processors.eos_token_id
