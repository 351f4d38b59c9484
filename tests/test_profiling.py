"""The profiling scripts run, with tiny settings, so that they cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_bench_script(tmp_path):
    write_dir(g.random_weights(TINY, seed=0), tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "bench.py"), "--model", str(tmp_path / "ckpt"),
                        "--lengths", "4", "16", "--contexts", "4", "--repeat", "2", "--steps", "3",
                        "--bandwidth-mib", "8", "--no-transformers", "--accuracy-prompts", "2",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert set(report["prefill"]) == {"4", "16"} and report["prefill"]["16"]["gpt2numba"]["n"] == 2
    assert report["decode"]["4"]["gpt2numba"]["median_ms"] > 0
    assert report["floors"]["read_gb_s"] > 0 and report["cold_start"]["gpt2numba_warm_cache_s"] > 0
    assert set(report["decode"]["4"]) >= {"gpt2numba", "gpt2numba bfloat16", "gpt2numba int8"}
    assert report["accuracy"]["int8"]["max_abs_diff_vs_oracle"] < 1e-3
    assert "prefill" in r.stdout and "decode floor" in r.stdout


def test_profile_step_script(tmp_path):
    write_dir(g.random_weights(TINY, seed=0), tmp_path)
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "profile_step.py"), "--model", str(tmp_path),
                        "--prompt", "12", "--context", "5", "--repeat", "2", "--dtype", "int8"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for kind in ("attention", "qkv (c_attn)", "mlp c_fc", "gelu", "layernorm", "cache write", "head (wte)"):
        assert kind in r.stdout
