"""gpt2numba as an lm-evaluation-harness model: three tiny local tasks, one of each kind, offline.

Each task's numbers are recomputed here without the harness (the oracle, or gpt2numba's own
calls), so agreement means the adapter follows the harness's rules.
"""

import json
import math
import os

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY_GPT2

# the tasks read local JSON lines: nothing may be looked up on the Hugging Face hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e \".[eval]\")")

# GPT-2's vocabulary (the tokenizer's), two small layers, a 64-token context: windows are exercised
CONFIG = TINY_GPT2
MC = [{"question": "Is the sky blue?", "choices": ["yes", "no", "maybe"], "answer": 0},
      {"question": "Two and two make", "choices": ["four", "five"], "answer": 1},
      {"question": "The capital of France is", "choices": ["Paris", "Rome", "a city"], "answer": 2}]
DELIMITER = " "  # the harness puts its target_delimiter between a question and each choice
PPL = [{"text": "The quick brown fox jumps over the lazy dog."},
       {"text": " ".join(["A longer document, scored in rolling windows of the model's context."] * 12)}]
GEN = [{"prompt": "Once upon a time", "target": " there"}, {"prompt": "", "target": "x"}]


def write_tasks(tmp_path):
    data = {"mc": MC, "ppl": PPL, "gen": GEN}
    for name, rows in data.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (tmp_path / "gn_mc.yaml").write_text(
        "task: gn_mc\n" + common.format(path=tmp_path / "mc.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gn_ppl.yaml").write_text(
        "task: gn_ppl\n" + common.format(path=tmp_path / "ppl.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    (tmp_path / "gn_gen.yaml").write_text(
        "task: gn_gen\n" + common.format(path=tmp_path / "gen.jsonl") + "output_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    import gpt2numba.harness  # noqa: F401  (registers "gpt2numba")
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("harness")
    w = g.random_weights(CONFIG, seed=4)
    write_dir(w, root / "model")
    write_tasks(root)
    tasks = TaskManager(include_path=str(root), include_defaults=False)  # (indexing lm-eval's own: seconds)
    out = lm_eval.simple_evaluate(model="gpt2numba", model_args=f"model={root / 'model'},dtype=float32",
                                  tasks=["gn_mc", "gn_ppl", "gn_gen"], task_manager=tasks, log_samples=True)
    return out, w


def continuation_logprob(w, tok, context, continuation):
    """The harness's causal rule, recomputed: trailing spaces of the context move to the continuation,
    the whole is encoded once, and the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    logits = g.recompute_all_logits(whole[:-1], w)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole)))


def test_multiple_choice(evaluated):
    out, w = evaluated
    tok = g.load_tokenizer()
    picks = [int(np.argmax([continuation_logprob(w, tok, d["question"], DELIMITER + c) for c in d["choices"]]))
             for d in MC]
    acc = np.mean([p == d["answer"] for p, d in zip(picks, MC)])
    assert out["results"]["gn_mc"]["acc,none"] == pytest.approx(acc)
    for sample in out["samples"]["gn_mc"]:  # each choice's log-likelihood, to float32's precision
        d = sample["doc"]
        for resp, choice in zip(sample["resps"], d["choices"]):  # resp: [(logprob, is_greedy)]
            expected = continuation_logprob(w, tok, d["question"], DELIMITER + choice)
            assert float(resp[0][0]) == pytest.approx(expected, abs=1e-3)


def test_rolling_log_likelihood(evaluated):
    """Every token predicted once: the first from <|endoftext|>, each window on the harness's context."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    out, w = evaluated
    tok = g.load_tokenizer()
    total, words = 0.0, 0
    for d in PPL:
        ids = tok.encode(d["text"])
        for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, tok.eot_id, 64, 1)):
            seq = (ctx + cont)[-65:]
            logits = g.recompute_all_logits(seq[:-1], w)
            z = logits - logits.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            total += sum(logp[len(seq) - 1 - len(cont) + k, cont[k]] for k in range(len(cont)))
        words += len(d["text"].split())
    assert len(tok.encode(PPL[1]["text"])) > 2 * CONFIG.n_positions  # several windows
    assert out["results"]["gn_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)


def test_generate_until(evaluated):
    out, w = evaluated
    tok = g.load_tokenizer()
    got = {s["doc"]["prompt"]: s["resps"][0][0] for s in out["samples"]["gn_gen"]}
    for d in GEN:
        ids = tok.encode(d["prompt"]) or [tok.eot_id]
        tokens = [t for t in g.generate(ids, w, max_new_tokens=6, temperature=0) if t != tok.eot_id]
        assert got[d["prompt"]] == tok.decode(tokens).split("\n")[0].split(".")[0]


def test_is_greedy_is_the_argmax_of_every_continuation_token(tmp_path):
    """In-process, on the model's own requests (context ids, continuation ids): is_greedy is True exactly
    when each continuation token is the oracle's argmax after the tokens before it. Catches: any() for
    all(), only the last token looked at, the window shifted by one into the context."""
    from gpt2numba.harness import GPT2NumbaLM

    w = g.random_weights(CONFIG, seed=4)
    write_dir(w, tmp_path)
    lm = GPT2NumbaLM(model=str(tmp_path))
    context = [464, 3290, 286, 1204]

    def argmax(prefix, rank=0):
        return int(np.argsort(-g.recompute_logits(prefix, w), kind="stable")[rank])

    def greedy_after(prefix, n):
        out = []
        for _ in range(n):
            out.append(argmax(prefix + out))
        return out

    greedy = greedy_after(context, 3)
    first_off = [argmax(context, 1)]
    first_off += greedy_after(context + first_off, 2)  # the first is second best, the rest follow it greedily
    cases = [(greedy, True), (greedy[:1], True), (greedy[:2] + [argmax(context + greedy[:2], 1)], False),
             (first_off, False), (greedy[:1] + [argmax(context + greedy[:1], 1)] + greedy[2:], False)]
    results = lm._loglikelihood_tokens([(("", ""), context, cont) for cont, _ in cases])
    assert [is_greedy for _, is_greedy in results] == [expected for _, expected in cases]
    for (cont, _), (logprob, _) in zip(cases, results):
        assert logprob == pytest.approx(continuation_logprob_of_ids(w, context, cont), abs=1e-3)


def continuation_logprob_of_ids(w, context, continuation):
    whole = context + continuation
    logits = g.recompute_all_logits(whole[:-1], w)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return sum(logp[i - 1, whole[i]] for i in range(len(context), len(whole)))


def test_max_length_is_checked(tmp_path):
    from gpt2numba.harness import GPT2NumbaLM

    write_dir(g.random_weights(CONFIG, seed=4), tmp_path)
    assert GPT2NumbaLM(model=str(tmp_path), max_length=40).max_length == 40
    for bad in (1, CONFIG.n_positions + 1):
        with pytest.raises(g.ConfigError, match="max_length must be in"):
            GPT2NumbaLM(model=str(tmp_path), max_length=bad)


def test_model_args_take_activations(tmp_path):
    """model_args' dtype and activations reach the weights (lm_eval passes them as strings); a bad pair is the
    loader's error, naming them."""
    from gpt2numba.harness import GPT2NumbaLM

    write_dir(g.random_weights(CONFIG, seed=4), tmp_path)
    lm = GPT2NumbaLM(model=str(tmp_path), dtype="bfloat16", activations="bfloat16")
    assert (lm.w.dtype, lm.w.activations) == ("bfloat16", "bfloat16")
    with pytest.raises(g.ConfigError, match="activations='bfloat16' needs bfloat16 weights"):
        GPT2NumbaLM(model=str(tmp_path), activations="bfloat16")


@pytest.mark.slow
def test_the_harness_command_line(tmp_path):
    """python -m gpt2numba.harness takes lm_eval's own arguments."""
    import subprocess
    import sys

    w = g.random_weights(CONFIG, seed=4)
    write_dir(w, tmp_path / "model")
    write_tasks(tmp_path)
    r = subprocess.run([sys.executable, "-m", "gpt2numba.harness", "--model", "gpt2numba",
                        "--model_args", f"model={tmp_path / 'model'}", "--tasks", "gn_mc",
                        "--include_path", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gn_mc" in r.stdout and "acc" in r.stdout
