"""The profiling scripts run, with tiny settings, so that they cannot rot."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2numba as g
from gpt2numba.model import oracle
from checkpoints import write_dir
from conftest import TINY, TINY_GPT2

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_script(tmp_path):
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "bench.py"), "--model", str(tmp_path / "ckpt"),
                        "--lengths", "4", "16", "--contexts", "4", "--repeat", "2", "--steps", "10",
                        "--bandwidth-mib", "8", "--no-transformers", "--accuracy-prompts", "2",
                        "--no-throughput", "--no-processes", "--idle-patience", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)  # (throughput and the cold start: below)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert set(report["prefill"]) == {"4", "16"} and report["prefill"]["16"]["gpt2numba"]["n"] == 2
    assert report["decode"]["4"]["gpt2numba"]["median_ms"] > 0
    assert report["decode"]["4"]["gpt2numba int8"]["n"] == 10  # turns of core.RUN steps, the last one short
    assert report["floors"]["read_gb_s"] > 0 and "cold_start" not in report
    assert set(report["decode"]["4"]) >= {"gpt2numba", "gpt2numba bfloat16", "gpt2numba int8"}
    assert report["accuracy"]["int8"]["max_abs_diff_vs_oracle"] < oracle.ATOL_INTEGER
    assert "prefill" in r.stdout and "decode floor" in r.stdout
    assert "row thresholds: rows_max" in r.stdout and "`gpt2numba tune` measures them" in r.stdout


def test_cold_start_script(tmp_path):
    """The cold start's new process, on Numba's cache as it is (the benchmark also runs it on an empty one: a
    minute of compiling, too long for a smoke test)."""
    from gpt2numba.bench import standard

    write_dir(g.random_weights(TINY, seed=0), tmp_path)
    assert 0 < standard.run_script(standard._OURS_FIRST, tmp_path) < 600


@pytest.mark.parametrize("options", [[], ["--gguf", "Q8_0", "--dtype", "int8"]])
def test_start_script(tmp_path, options):
    """profiling/start.py on a tiny checkpoint (and a GGUF of it), one round: every figure printed (none asserted
    but positive)."""
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")  # (GPT-2's vocabulary: a text prompt)
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "start.py"), "--model", str(tmp_path / "ckpt"),
                        "--rounds", "1", "--idle-patience", "0", *options], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    for name in ("import gpt2numba", "generate, 1 token", "load_weights, mapped", "load_weights, in memory"):
        assert re.search(rf"this tree +{name} +[0-9.]+ s", r.stdout), (name, r.stdout)
    assert "1 new token; first token after" in r.stdout and "weights" in r.stdout
    assert re.search(r"PSS: one process \d+ MiB, two at once \d+ MiB", r.stdout), r.stdout


def test_bench_floor(tmp_path):
    """gpt2numba bench --floor: the read rate, then per format its bytes a step, floor, measured step and their
    ratio, in the table and the JSON (no timing is asserted: the ratios are only positive)."""
    w = g.random_weights(TINY, seed=0)
    write_dir(w, tmp_path / "ckpt")
    out = tmp_path / "floor.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--floor", "--model", str(tmp_path / "ckpt"),
                        "--floor-context", "16", "--floor-steps", "3", "--floor-repeat", "2", "--bandwidth-mib", "8",
                        "--idle-patience", "0", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    f = json.loads(out.read_text())["floor"]
    assert f["read_gb_s"] > 0 and (f["context"], f["steps"]) == (16, 3)
    assert [row["dtype"] for row in f["formats"]] == ["float32", "bfloat16", "int8", "int4"]
    kv_row = 2 * TINY.n_layer * TINY.n_embd * 4  # float32 keys and values of one position, every layer
    for row in f["formats"]:
        assert row["kv_bytes"] == (16 + 2) * kv_row  # positions 16, 17, 18 read 17, 18, 19 rows
        assert row["bytes"] == row["weight_bytes"] + row["kv_bytes"]
        assert row["floor_ms"] > 0 and row["measured_ms"] > 0 and len(row["runs_ms"]) == 2
        assert row["ratio"] == pytest.approx(row["measured_ms"] / row["floor_ms"]) and row["ratio"] > 0
    weight = {row["dtype"]: row["weight_bytes"] for row in f["formats"]}
    assert weight["float32"] == w.nbytes - w.wpe.nbytes + w.wpe[0].nbytes  # every weight but wpe's other rows
    assert weight["float32"] > weight["bfloat16"] > weight["int8"] > weight["int4"]
    # per kernel: every byte of a step but the layer norms' and wpe's row is some kernel's
    norms = sum(getattr(w, name).nbytes for name in ("ln_1_g", "ln_1_b", "ln_2_g", "ln_2_b", "ln_f_g", "ln_f_b"))
    for row in f["formats"]:
        kernels = row["kernels"]
        assert set(kernels) == {"qkv (c_attn)", "attn c_proj", "mlp c_fc", "mlp c_proj", "head (wte)", "attention"}
        assert kernels["attention"]["bytes"] == row["kv_bytes"]
        assert sum(k["bytes"] for k in kernels.values()) == row["bytes"] - norms - w.wpe[0].nbytes
        assert all(k["measured_ms"] > 0 and k["ratio"] == pytest.approx(k["measured_ms"] / k["floor_ms"])
                   for k in kernels.values())
        assert {"layernorm", "gelu", "cache write"} <= set(row["other_kernels_ms"])
    steps, per_kernel = r.stdout.split("per kernel:")
    lines = [line.split() for line in steps.splitlines()]
    table = [line for line in lines if line[:1] and line[0] in ("float32", "bfloat16", "int8", "int4")]
    assert [line[0] for line in table] == ["float32", "bfloat16", "int8", "int4"]
    assert all(float(line[4].rstrip("x")) > 0 for line in table) and "GB/s" in r.stdout
    assert per_kernel.count("mlp c_fc") == 4 and per_kernel.count("no floor of their own") == 4


@pytest.mark.timeout(1200)  # (its subprocess may take up to 900 s)
def test_bench_neighbour(tmp_path):
    """gpt2numba bench --neighbour: a workload alone and beside a busy loop at nice 0 and 10, with slowdowns."""
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--neighbour", "--model", str(tmp_path / "ckpt"),
                        "--dtypes", "float32", "int8", "--neighbour-workloads", "decode", "gen8",
                        "--neighbour-systems", "gpt2numba", "--idle-patience", "0",
                        "--neighbour-repeat", "1", "--neighbour-steps", "2", "--neighbour-tokens", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["neighbour"]
    assert [(row["workload"], row["dtype"]) for row in rows] == [
        ("decode", "float32"), ("gen8", "float32"), ("decode", "int8"), ("gen8", "int8")]
    assert all(set(row["seconds"]) == {"alone", "nice 0", "nice 10"} and min(row["seconds"].values()) > 0
               for row in rows)
    assert "slowdown" in r.stdout and "gen8" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold Numba cache, Ray's cluster and transformers beside the suite's other worker
def test_bench_score(tmp_path):
    """The scoring section through the CLI, on a tiny model with GPT-2's vocabulary (the Ray part decodes and
    re-encodes text); transformers where installed."""
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    out = tmp_path / "score.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--score", "--model", str(tmp_path / "ckpt"),
                        "--threads", "1", "--score-long", "150", "--score-stride", "32", "--score-docs", "6",
                        "--score-doc-tokens", "10", "40", "--score-repeat", "2", "--ray", "--idle-patience", "0",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["threads"] == 1
    ours = report["long"]["gpt2numba"]
    assert ours["scored"] == 149 and ours["n"] == 2 and ours["tok_s"] > 0
    assert 6 * 9 <= report["docs"]["gpt2numba"]["scored"] <= 6 * 39  # 6 documents of 10-40 tokens
    assert report["head"]["head_gflop"] > 0 and report["peak_rss_mb"]["gpt2numba"] > 0
    assert report["ray"]["max_rel_nll_diff"] < 1e-6 and report["ray"]["documents"] == 6
    if report["transformers"]:
        for workload in ("long", "docs"):
            assert report[workload]["same_tokens_scored"] and report[workload]["max_rel_nll_diff"] < 1e-4
    else:
        print("transformers is not installed: the comparison was skipped (pip install -e \".[bench]\")")
    assert "tok/s" in r.stdout and "Ray Data" in r.stdout


def test_profile_step_script(tmp_path):
    write_dir(g.random_weights(TINY, seed=0), tmp_path)
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "profile_step.py"), "--model", str(tmp_path),
                        "--prompt", "12", "--context", "5", "--repeat", "2", "--dtype", "int8", "--batch", "3",
                        "--neighbour", "10"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for kind in ("attention", "qkv (c_attn)", "mlp c_fc", "gelu", "layernorm", "cache write", "head (wte)"):
        assert kind in r.stdout
    assert "decode step of 3 sequences at context 5 each" in r.stdout and "(ragged)" in r.stdout
    assert "beside a busy loop at nice 10" in r.stdout and "nice 10, workers" in r.stdout


def test_matrix_rate_script(tmp_path):
    """profiling/matrix_rate.py on a tiny model: a time, a rate and a ratio to float32 per format and number of
    rows, through the rows kernels (3 rows) and the tiles and BLAS (12)."""
    write_dir(g.random_weights(TINY, seed=0), tmp_path)
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "matrix_rate.py"), "--model", str(tmp_path),
                        "--rows", "3", "12", "--repeat", "2", "--dtypes", "float32", "bfloat16", "int8", "int4",
                        "--idle-patience", "0"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[2:]]
    dtypes = ("float32", "bfloat16", "int8", "int4")
    assert [(n, d) for n, d, *_ in rows] == [(n, d) for n in ("3", "12") for d in dtypes]
    for _, dtype, ms, rate, ratio, _ in rows:
        assert float(ms) > 0 and float(rate) > 0 and float(ratio.rstrip("x")) > 0
        assert dtype != "float32" or ratio == "1.00x"
    assert "n_embd 128" in r.stdout and "integer tiles multiply with" in r.stdout


def _bench_throughput(tmp_path, *extra):
    """The benchmark with only its throughput section worth the name, on the tiny checkpoint (64 positions)."""
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "bench.py"), "--model", str(tmp_path / "ckpt"),
                        "--lengths", "4", "--contexts", "4", "--repeat", "2", "--steps", "2", "--bandwidth-mib", "8",
                        "--batch-sizes", "1", "3", "--batch-context", "4", "--batch-steps", "2", "--no-processes",
                        "--idle-patience", "0", "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["throughput"], r.stdout


def test_bench_throughput(tmp_path):
    t, stdout = _bench_throughput(tmp_path, "--dtypes", "float32", "int8", "--accuracy-prompts", "2",
                                  "--no-transformers", "--plot", str(tmp_path / "throughput.png"))
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "drew" in stdout
    assert set(t["batches"]) == {"1", "3"}
    for B in ("1", "3"):
        decode = t["batches"][B]["decode"]
        assert decode["gpt2numba int8"]["n"] == 2 and "transformers" not in decode
        assert decode["gpt2numba"]["tok_s"] == pytest.approx(1e3 * int(B) / decode["gpt2numba"]["median_ms"])
        assert t["batches"][B]["floor_ms"]["gpt2numba"]["gemm"] > 0
    # 16..900 clamped to what fits in 64 positions beside 2 steps, the prompt's token and a spare row
    contexts = t["ragged"]["contexts"]
    assert len(contexts) == 16 and 16 <= min(contexts) and max(contexts) <= 60 and len(set(contexts)) > 1
    assert t["ragged"]["attention_ratio"] == pytest.approx(sum(contexts) / (16 * 4))
    assert t["ragged"]["decode"]["gpt2numba"]["tok_s"] > 0
    p = t["prefill"]
    assert (p["prompts"], p["length"]) == (8, 4) and p["gpt2numba"]["batch"]["n"] == 2
    assert p["gpt2numba"]["max_abs_logit_diff"] < 1e-4 and p["gpt2numba int8"]["sequential"]["median_ms"] > 0
    assert "throughput" in stdout and "ragged" in stdout and "prefill 8 x 4 tokens" in stdout


def test_bench_plot_needs_the_throughput_section(capsys):
    from gpt2numba import bench

    for other in ("--no-throughput", "--score"):
        with pytest.raises(SystemExit):
            bench.main(["--plot", "t.png", other])
        assert "--plot draws the throughput section" in capsys.readouterr().err


def test_bench_throughput_skips_what_does_not_fit(tmp_path):
    t, stdout = _bench_throughput(tmp_path, "--dtypes", "float32", "--no-transformers", "--batch-context", "80")
    assert t["batches"] == {} and t["prefill"] is None and t["ragged"]["decode"]["gpt2numba"]["n"] == 2
    assert "batch sizes skipped" in stdout and "prefill_batch skipped" in stdout


def test_bench_throughput_against_transformers(tmp_path):
    pytest.importorskip("torch", reason="the transformers comparison needs torch (pip install -e \".[bench]\")")
    pytest.importorskip("transformers", reason="the comparison needs transformers (pip install -e \".[bench]\")")
    t, stdout = _bench_throughput(tmp_path, "--dtypes", "float32")
    for entry in (t["batches"]["1"], t["batches"]["3"], t["ragged"]):
        decode = entry["decode"]
        assert decode["transformers"]["n"] == 2 and decode["transformers"]["tok_s"] > 0
        # greedy over the same weights: left padding and ragged positions must not change a token
        assert decode["same_greedy_sequences"] == decode["sequences"]
    assert "same greedy tokens as transformers: 3 of 3 sequences" in stdout


def test_bench_against_transformers_checks_itself(tmp_path):
    """transformers runs in a process of its own that never imports gpt2numba, reports its threads, and is
    measured once more in a plain process beside the bench's figure (tox's hf env runs this: torch is there)."""
    pytest.importorskip("torch", reason="the transformers comparison needs torch (pip install -e \".[bench]\")")
    pytest.importorskip("transformers", reason="the comparison needs transformers (pip install -e \".[bench]\")")
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "bench.py"), "--model", str(tmp_path / "ckpt"),
                        "--lengths", "4", "--contexts", "4", "--repeat", "3", "--steps", "2", "--bandwidth-mib", "8",
                        "--dtypes", "float32", "--no-throughput", "--no-processes", "--idle-patience", "0",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    seen = report["peers"]["transformers"]
    assert seen["imported"] == [] and seen["threads"] == 2
    plain = report["plain_process"]
    assert plain["tokens"] == 4 and plain["plain_ms"] > 0
    assert plain["bench_ms"] == report["prefill"]["4"]["transformers"]["median_ms"]
    assert "self-check: transformers' prefill 4 in plain processes" in r.stdout
    assert "transformers ran in a process of its own: 2 threads" in r.stdout
    # transformers in bfloat16 beside it (--transformers-dtypes' default), the same way
    assert report["transformers_kinds"] == ["transformers", "transformers-bf16"]
    assert report["peers"]["transformers-bf16"]["imported"] == []
    assert report["prefill"]["4"]["transformers-bf16"]["median_ms"] > 0 and "vs tf-bf16" in r.stdout


def test_bench_llama(tmp_path):
    """llama.cpp beside us on GGUF files of the same tiny model (GPT-2's vocabulary): where llama-cpp-python is
    installed (the [peers] extra, kept out of the test extra: it compiles llama.cpp for minutes)."""
    pytest.importorskip("llama_cpp", reason="llama.cpp's benchmark needs llama-cpp-python (pip install -e \".[peers]\")")
    write_dir(g.random_weights(dataclasses.replace(TINY_GPT2, n_positions=1024), seed=0), tmp_path / "ckpt")
    out = tmp_path / "llama.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--llama", "--model", str(tmp_path / "ckpt"),
                        "--lengths", "16", "--contexts", "8", "--repeat", "2", "--steps", "3",
                        "--accuracy-prompts", "2", "--idle-patience", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["same_model"] < 2e-3
    assert set(report["decode"]["8"]) >= {"gpt2numba", "llama.cpp F32", "llama.cpp Q4_0"}
    assert report["accuracy"]["llama.cpp Q8_0"]["argmax_agreement_with_float32"] > 0
    assert "llama.cpp Q4_0" in r.stdout


def _needs_ct2():
    for name in ("ctranslate2", "torch", "transformers"):
        pytest.importorskip(name, reason=f"CTranslate2's benchmark needs {name} (its converter reads a transformers "
                                         "checkpoint): pip install -e \".[peers,bench]\"")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # (its subprocess may take up to 900 s)
def test_bench_ct2(tmp_path):
    """CTranslate2 beside us on a conversion of the same tiny model (512 ids: the vocabulary is the ids), both
    formats, every workload at tiny sizes."""
    _needs_ct2()
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "ct2.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--ct2", "--model", str(tmp_path / "ckpt"),
                        "--threads", "1", "--idle-patience", "0", "--ct2-batch-sizes", "1", "3", "--ct2-prompt", "8",
                        "--ct2-tokens", "4", "--ct2-beam-prompts", "3", "--ct2-docs", "5", "--ct2-doc-tokens", "10", "40", "--ct2-repeat", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["same_model"] < 1e-4 and report["ctranslate2"].startswith("ctranslate2 ")
    compact = report["accuracy"]["max_abs_logprob_diff_vs_own_float32"]
    assert set(compact) == {"gpt2numba int8", "CTranslate2 int8_float32"} and 0 < min(compact.values())
    systems = {"gpt2numba", "gpt2numba int8", "CTranslate2 float32", "CTranslate2 int8_float32"}
    assert set(report["generate"]) == {"1", "3"}
    for B, row in report["generate"].items():
        assert {name for name, o in row.items() if isinstance(o, dict)} == systems
        assert all(row[name]["n"] == 2 and row[name]["tokens"] == int(B) * 4 for name in systems)
        assert row["same_greedy_sequences"] == int(B)  # float32 both: the same greedy tokens
    beam = report["beam"]
    assert beam["beams"] == 4 and beam["sequences"] == 3 and all(beam[name]["tokens"] == 3 * 4 for name in systems)
    assert beam["same_best_hypotheses"] >= 2  # (beam scores tie more often than greedy tokens)
    score = report["score"]
    assert len({score[name]["tokens"] for name in systems}) == 1  # every system scored the same tokens
    assert 5 * 9 <= score["gpt2numba"]["tokens"] <= 5 * 39 and score["max_rel_nll_diff"] < 1e-5
    assert "CT2 / ours" in r.stdout and "int8 / int8_float32" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)  # (its subprocess may take up to 900 s)
def test_bench_neighbour_ct2(tmp_path):
    """CTranslate2 under the same neighbour: both compute types, every workload, at tiny sizes (its prefill is a
    generate of one token); llama.cpp's absence, or a vocabulary a GGUF cannot carry, is said, not an error."""
    _needs_ct2()
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--neighbour", "--model", str(tmp_path / "ckpt"),
                        "--threads", "1", "--idle-patience", "0", "--neighbour-systems", "ct2", "llama",
                        "--neighbour-repeat", "1", "--neighbour-steps", "2", "--neighbour-tokens", "2",
                        "--neighbour-docs", "3", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    ct2_rows = [(row["workload"], row["dtype"]) for row in report["neighbour"] if row["system"] == "CTranslate2"]
    assert ct2_rows == [(w, ct) for ct in ("float32", "int8_float32")
                        for w in ("decode", "gen8", "gen32", "prefill", "score")]
    assert all(set(row["seconds"]) == {"alone", "nice 0", "nice 10"} and min(row["seconds"].values()) > 0
               for row in report["neighbour"])
    assert "CTranslate2" in r.stdout and "slowdown" in r.stdout
    why = ("llama-cpp-python is not installed" if importlib.util.find_spec("llama_cpp") is None
           else "a GGUF carries GPT-2's vocabulary of 50257 tokens; this model has 512")
    assert any(note.startswith(f"llama.cpp skipped: {why}") for note in report["notes"])
    assert f"llama.cpp skipped: {why}" in r.stdout
    assert all(row["system"] != "llama.cpp" for row in report["neighbour"])


def test_bench_neighbour_llama(tmp_path):
    """llama.cpp under the same neighbour, on GGUF files of a tiny model with GPT-2's vocabulary: decode and
    prefill in F32 and Q8_0, and the note that it runs no more; where llama-cpp-python is installed."""
    pytest.importorskip("llama_cpp", reason="llama.cpp's benchmark needs llama-cpp-python (pip install -e \".[peers]\")")
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "bench", "--neighbour", "--model", str(tmp_path / "ckpt"),
                        "--threads", "1", "--idle-patience", "0", "--neighbour-systems", "llama",
                        "--neighbour-repeat", "1", "--neighbour-steps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert [(row["system"], row["workload"], row["dtype"]) for row in report["neighbour"]] == [
        ("llama.cpp", w, f) for f in ("F32", "Q8_0") for w in ("decode", "prefill")]
    assert all(min(row["seconds"].values()) > 0 for row in report["neighbour"])
    assert any(note.startswith("llama.cpp runs decode and prefill only") for note in report["notes"])


def test_serve_load_script(tmp_path):
    """The load generator against a server it starts on a tiny model with GPT-2's vocabulary."""
    pytest.importorskip("httpx", reason="the load generator needs httpx (the [serve] extra)")
    write_dir(g.random_weights(dataclasses.replace(TINY_GPT2, n_positions=128), seed=0), tmp_path / "ckpt")
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "serve_load.py"), "--model", str(tmp_path / "ckpt"),
                        "--concurrency", "1", "3", "--prompt-tokens", "8", "--max-tokens", "5", "--rounds", "1",
                        "--neighbour", "--schema", "--draft=--prompt-lookup", "--draft=4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    for levels in (report["concurrency"], report["neighbour"], report["schema"]):
        three = levels["3"]
        assert three["requests"] == 3 and three["tokens"] == 15 and three["tpot_ms"]["p50"] > 0
    assert report["in_process_ms"]["decode_step_ms"] > 0 and "not streamed" in r.stdout
    assert "beside it over quiet: N=1" in r.stdout and "tok/s with schemas over without: N=1" in r.stdout
    assert report["draft"]["3"]["tokens"] == 15 and report["draft"]["metrics"]["draft"] > 0
    assert "on a server with --prompt-lookup 4 (drafted" in r.stdout and "tok/s with the draft over without: N=1" \
        in r.stdout


def test_serve_chunked_script(tmp_path):
    """The chunked-prefill measurement against servers it starts on a tiny model with GPT-2's vocabulary (512
    positions: the streams must outlast the measurement, on a busy machine too)."""
    pytest.importorskip("httpx", reason="the load generator needs httpx (the [serve] extra)")
    write_dir(g.random_weights(dataclasses.replace(TINY_GPT2, n_positions=512), seed=0), tmp_path / "ckpt")
    out = tmp_path / "chunked.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "serve_chunked.py"), "--model", str(tmp_path / "ckpt"),
                        "--step-tokens", "8", "0", "--streams", "2", "--prompt-tokens", "8", "--long-tokens", "60",
                        "--settle", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["step_tokens"]
    assert set(rows) == {"8", "0"}
    for row in rows.values():
        assert row["gaps_during_ms"]["n"] >= 2 and row["tpot_before_ms"] > 0 and row["long_ttft_s"] > 0
    assert "whole" in r.stdout and "p99/before" in r.stdout


def test_serve_prefix_script(tmp_path):
    """The prefix-cache measurement against servers it starts on a tiny model with GPT-2's vocabulary."""
    pytest.importorskip("httpx", reason="the load generator needs httpx (the [serve] extra)")
    write_dir(g.random_weights(dataclasses.replace(TINY_GPT2, n_positions=128), seed=0), tmp_path / "ckpt")
    out = tmp_path / "prefix.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "serve_prefix.py"), "--model", str(tmp_path / "ckpt"),
                        "--requests", "6", "--clients", "2", "--prefix-tokens", "40", "--ending-tokens", "4",
                        "--max-tokens", "2", "--cache-mb", "1", "--n", "3", "--n-prompt-tokens", "20",
                        "--n-max-tokens", "2", "--n-repeat", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["on"]["requests_s"] > 0 and report["off"]["rss_peak_mb"] >= report["off"]["rss_started_mb"] > 0
    assert len(report["n_ttft_s"]["3"]) == 1 and report["n_ttft_ratio"] > 0
    assert "with the cache" in r.stdout and "time to first token" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)  # (its subprocess may take up to 900 s)
def test_shared_prefix_script(tmp_path):
    """The prefix-sharing measurement on a tiny model: lm-eval with and without sharing gives the same numbers."""
    pytest.importorskip("lm_eval", reason="the script runs lm-eval (the [eval] extra)")
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    out = tmp_path / "shared.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "shared_prefix.py"), "--model", str(tmp_path / "ckpt"),
                        "--docs", "3", "--context", "20", "30", "--endings", "3", "6", "--threads", "1",
                        "--score-batch", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["samples"] == 12 and report["greedy_differ"] == 0
    assert report["max_abs_logprob_diff"] < 1e-5 and report["score_batch"]["max_abs_logprob_diff"] < 1e-5
    assert "speed-up" in r.stdout


def test_thresholds_study(tmp_path):
    """profiling/studies/thresholds.py on a tiny model: tokens/s per batch size with this process's thresholds and
    others, each against one sequence's."""
    write_dir(g.random_weights(TINY, seed=0), tmp_path)
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "thresholds.py"), "--model", str(tmp_path),
                        "--against", "rows_max=1", "int_rows_max=2", "--dtypes", "float32", "int8", "--batch", "1", "4",
                        "--context", "8", "--steps", "2", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if " B= " in line]
    assert [line.split(" B=")[0] for line in lines] == ["float32", "float32", "int8", "int8"]
    assert all("these/against" in line and "(1.00x)" in line for line in lines[::2])
    assert "against: {'rows_max': 1, 'int_rows_max': 2}" in r.stdout


def test_kv_dtype_script(tmp_path):
    """profiling/studies/kv_dtype.py on a tiny int4 model: a decode time per cache dtype, float16 and bfloat16 caches
    in half float32's bytes, their logits near float32's."""
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "kv_dtype.py"), "--model", str(tmp_path / "ckpt"),
                        "--context", "40", "--steps", "2", "--repeat", "2", "--caches", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["weights"] == "int4" and report["context"] == 40 and report["steps"] == 4
    assert set(report["decode_ms"]) == set(g.KV_DTYPES) and min(report["decode_ms"].values()) > 0
    assert report["bytes"]["float32"] == 4 * g.ModelCache(TINY, dtype="float32").nbytes
    assert report["bytes"]["float16"] == report["bytes"]["bfloat16"] == report["bytes"]["float32"] // 2
    assert max(report["max_abs_logit_diff_vs_float32"].values()) < 0.05
    assert "ms/token" in r.stdout and "caches of 64 positions" in r.stdout


def test_beam_search_script(tmp_path):
    """profiling/studies/beam_search.py on a tiny model: both workloads timed, copy_prefix's calls counted (4 beams
    diverge, so some beams take another's rows), the caches' bytes those of prompts x beams caches."""
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "beam.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "beam_search.py"), "--model", str(tmp_path / "ckpt"),
                        "--prompts", "2", "--prompt", "5", "--tokens", "6", "--beams", "4", "--repeat", "2",
                        "--idle-patience", "0", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["beam"]["n"] == report["greedy"]["n"] == 2 and report["beam"]["median_ms"] > 0
    assert report["copy"]["calls"] > 0 and 0 < report["copy"]["rows"] and 0 <= report["copy"]["share"] < 1
    assert report["cache_bytes"] == 2 * 4 * g.ModelCache(TINY, 11).nbytes
    assert "beam / greedy" in r.stdout


def test_inspect_vs_score_script(tmp_path):
    """/v1/inspect against score() on a tiny model with GPT-2's vocabulary: every workload timed, ratios printed."""
    pytest.importorskip("httpx", reason="the script's client needs httpx (the [serve] extra)")
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    out = tmp_path / "inspect.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "inspect_vs_score.py"), "--model", str(tmp_path / "ckpt"),
                        "--tokens", "40", "--repeat", "2", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["tokens"] == 40 and "score" in report["seconds"] and len(report["seconds"]) >= 3
    assert all(len(times) == 2 and min(times) > 0 for times in report["seconds"].values())
    assert "x score" in r.stdout


@pytest.mark.skipif(not (Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()),
                    reason="the page's drawing is timed in Debian's headless Chromium: apt-get install chromium "
                           "chromium-driver")
def test_page_paint_script(tmp_path):
    """The playground's drawing timed on a tiny model: one span.tok per token, a time per drawing."""
    pytest.importorskip("selenium", reason="the script drives Chromium with selenium (the test extra)")
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    out = tmp_path / "paint.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "page_paint.py"), "--model", str(tmp_path / "ckpt"),
                        "--tokens", "50", "--repeat", "2", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["tokens"] == report["spans"] == 50 and len(report["ms"]) == 2 and min(report["ms"]) > 0


def test_a_peer_runs_in_a_process_without_gpt2numba_in_its_users_environment():
    """The benchmark starts a peer in a process that never imports gpt2numba, in the environment gpt2numba found
    at its import (the user's: bench does not add to it), and reports its thread settings; gpt2numba's own
    workers get the same environment with claims on CPUs off."""
    import bench_peer
    from gpt2numba import _ENVIRON_AT_IMPORT
    from gpt2numba.bench.core import Remote, gpt2numba_system, peer_settings

    peer = Remote(bench_peer.system, "probe", ROOT, 1)
    try:
        environ, imported = peer.call("environ", None)[1]
        assert imported == []
        environ.pop("LC_CTYPE", None)  # (Python's own coercion of the C locale, in any child)
        assert environ == {k: v for k, v in _ENVIRON_AT_IMPORT.items() if k != "LC_CTYPE"}
        settings = peer_settings([peer])["probe"]
        assert settings["imported"] == [] and settings["threads"] == 1
        assert peer.call("prefill", [1, 2])[1] == 7  # (the greedy token of its logits)
    finally:
        peer.close()


def test_our_workers_run_with_claims_off(tmp_path):
    from gpt2numba.bench.core import Remote, gpt2numba_system

    write_dir(g.random_weights(TINY, seed=0), tmp_path)
    ours = Remote(gpt2numba_system, "float32", tmp_path, 1)
    try:
        seen = ours.call("environment", None)[1]
        assert seen["variables"]["GPT2NUMBA_CLAIM_DIR"] == "off" and "gpt2numba" in seen["imported"]
        assert seen["threads"] == 1
    finally:
        ours.close()


def test_amx_compile_study():
    """profiling/studies/amx_compile.py: Numba emits the tile instructions for a Sapphire Rapids CPU on any x86
    machine; --run multiplies a tile where the CPU has them, else says why not."""
    from gpt2numba.cpu import amx, dispatch

    if dispatch.FEATURES is None:
        pytest.skip("not an x86 CPU: no tiles to compile for")
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "studies" / "amx_compile.py"), "--run"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[1:6]] == [
        "ldtilecfg", "tileloadd", "tileloadd", "tileloadd", "tdpbf16ps"]
    if amx.available() is None:  # (Linux may still refuse the tiles, which the script says)
        assert "one tile on this CPU: max |tdpbf16ps - float64|" in r.stdout or "not run: the tiles" in r.stdout
    else:
        assert f"not run: the tiles are off: {amx.available()}" in r.stdout


def test_structured_script(tmp_path):
    """profiling/structured.py on a tiny model with GPT-2's vocabulary: every section runs and prints, the
    validity counts add up, and a grammar library that is not installed is said to be missing."""
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    out = tmp_path / "structured.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "structured.py"), "--model", str(tmp_path / "ckpt"),
                        "--seeds", "1", "--steps", "8", "--max-new-tokens", "24", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    for kind, cases in (("json_schema", 20), ("regex", 10)):
        v = report["validity"][kind]
        assert v["cases"] == cases and v["valid"] == v["stop"] and v["stop"] + v["length_prefixes"] == cases
    assert report["cost"]["one"]["ratio"] > 0 and report["cost"]["parts_us"]["mask"] > 0
    assert report["compile"]["fresh_ms"] > 0 and report["compare"]["llguidance"]["compile_ms"] > 0
    for name in ("outlines-core", "xgrammar"):
        assert ("missing" in report["compare"][name]) == (importlib.util.find_spec(name.replace("-", "_")) is None)
    assert "decode step, one sequence" in r.stdout and "llguidance" in r.stdout


def test_speculative_script(tmp_path):
    """profiling/speculative.py on a tiny checkpoint: every section runs, prints its table, and finds the drafts'
    tokens plain decoding's."""
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "speculative.py"), "--model", str(tmp_path / "ckpt"),
                        "--prompt", "8", "--new", "12", "--rounds", "1", "--batch", "1", "2", "--batch-new", "6"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for section in ("draft: prompt 8 tokens", "lookup: prompt 8 tokens", "batch: prompts of 8 tokens"):
        assert section in r.stdout, r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "condition" not in line
            and "sequences" not in line]
    assert len(rows) == 4 + 2 + 2 and all(line.split("|")[-3].strip() == "yes" for line in rows), r.stdout
    assert "decoding alone (after the first token" in r.stdout
