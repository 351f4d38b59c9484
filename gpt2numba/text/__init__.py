"""Text in and out: the tokenizer, scoring and perplexity, the token view and its HTML report.

Start at scoring.py (every token's log-probability in one batched pass). tokenizer.py (GPT-2's BPE through
tiktoken), documents.py (files as the score command reads them), tokenview.py (log-probability, rank and
alternatives of every token), report.py (score --html). Uses model/ and cpu/.
"""
