"""Choosing the next token, for one sequence or many: sampling, processors, beams, batches, shared prefixes,
grammars, speculative drafts.

Start at sample.py (Sampler, generate, generate_batch). processors.py (what settings do to a row of scores,
in transformers' order), beams.py (beam search), batching.py (continuous batching: sequences in flight, one
pass a step), prefixes.py (PrefixCache), constraints.py (structured output), speculative.py (drafts checked
in one pass). Uses text/, model/ and cpu/.
"""
