"""Hugging Face transformers behind the benchmark's calls: prefill, decode, batched generate and the two
scoring workloads, on the same weights (torch and transformers: the optional extra [bench]). Runs in a peer's
worker, which never imports gpt2numba (peers/__init__.py)."""

from __future__ import annotations

import time

import numpy as np


BF16 = "transformers-bf16"  # the bfloat16 system's name
KINDS = {"transformers": "float32", BF16: "bfloat16"}  # a system's name -> torch's dtype for it


def system(kind, model_dir, threads):
    """(system, kind, version) for Remote: the model in float32 (kind "transformers") or in bfloat16
    ("transformers-bf16", where torch's oneDNN multiplies on AVX512_BF16 or Intel's matrix tiles); system and
    version are None when it is not installed."""
    system = _load(model_dir, threads, KINDS[kind])
    return system, kind, system.version if system else None


class Theirs:
    name = "transformers"

    def __init__(self, torch, model, version):
        self.torch, self.model, self.version = torch, model, version
        self.past = None

    def threads(self):
        return self.torch.get_num_threads()

    def prefill(self, ids):
        with self.torch.inference_mode():
            out = self.model(self.torch.as_tensor(np.asarray(ids)[None]), use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def decode(self, token):
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([[token]]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float().numpy()

    def generate(self, batch):
        """Batched greedy generate, as its users run it: {"tokens": (B, new) ids, "put_s": when each came}."""
        ids, mask, new_tokens = batch  # (B, T) int64 left-padded, (B, T) 1 where a prompt is, int
        clock = _Clock()
        out = self.model.generate(self.torch.as_tensor(ids), attention_mask=self.torch.as_tensor(mask),
                                  do_sample=False, use_cache=True, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0, streamer=clock)
        return {"tokens": out[:, ids.shape[1]:].tolist(), "put_s": clock.times}

    def score_long(self, job):
        """Hugging Face's guide "Perplexity of fixed-length models": model(input_ids, labels=...) per window,
        labels -100 on the tokens an earlier window scored. Returns (tokens scored, [nll])."""
        torch = self.torch
        ids, stride = job
        ids = torch.as_tensor(np.asarray(ids))[None]  # (1, L)
        L, n = ids.shape[1], self.model.config.n_positions
        nll, count, prev_end = 0.0, 0, 0
        with torch.inference_mode():
            for begin in range(0, L, stride):
                end = min(begin + n, L)
                input_ids = ids[:, begin:end]
                labels = input_ids.clone()
                labels[:, :-(end - prev_end)] = -100
                loss = self.model(input_ids, labels=labels).loss  # the mean over the shifted valid labels
                scored = int((labels[:, 1:] != -100).sum())
                nll, count, prev_end = nll + float(loss) * scored, count + scored, end
                if end == L:
                    break
        return count, [nll]

    def score_docs(self, job):
        """Short documents in padded batches with an attention mask, sorted by length (less padding), as
        evaluation code does. Per-document NLLs need per-token losses, so the logits are scored with
        cross_entropy(reduction="none"), the same work as labels=. Returns (tokens scored, nll per document)."""
        torch = self.torch
        docs, batch = job
        order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
        nlls = [0.0] * len(docs)
        with torch.inference_mode():
            for start in range(0, len(docs), batch):
                group = order[start:start + batch]
                T = max(len(docs[i]) for i in group)
                ids = torch.zeros((len(group), T), dtype=torch.long)  # (B, T), right-padded: positions stay 0..
                labels = torch.full((len(group), T), -100, dtype=torch.long)  # (B, T), -100 on padding
                for b, i in enumerate(group):
                    ids[b, :len(docs[i])] = labels[b, :len(docs[i])] = torch.as_tensor(docs[i])
                logits = self.model(ids, attention_mask=(labels != -100).long()).logits  # (B, T, vocab)
                losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                                           reduction="none")  # (B, T - 1), 0 on padding
                for b, i in enumerate(group):
                    nlls[i] = float(losses[b].sum())
        return sum(len(d) - 1 for d in docs), nlls


class _Clock:
    """A streamer for generate (put/end, as transformers' BaseStreamer) that notes when each put comes:
    the first with the prompt, then one per new token, so the gaps after the second are decode steps."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _load(model_dir, threads, dtype):
    try:
        import torch
        import transformers
    except ImportError:
        return None
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.GPT2LMHeadModel.from_pretrained(str(model_dir), torch_dtype=getattr(torch, dtype)).eval()
    return Theirs(torch, model, f"transformers {transformers.__version__}, torch {torch.__version__}")

