"""bench/soak.py: a short soak on the CPU backend (the tiny model, the server started through the
script's own --serve-args) passes, and its checks fire on series that must fail."""
import copy
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import soak  # noqa: E402
import soak_plot  # noqa: E402


def test_a_short_soak_on_the_cpu_backend_passes(cli_env, tiny_dir, tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--serve-args",
         f"--model-path {tiny_dir} --device cpu --max-model-len 512 --num-kv-blocks 96",
         "--minutes", "0.35", "--rate", "3", "--prompt-len", "64", "--output-len", "16", "--sample-s", "1",
         "--stuck-s", "20", "--drain-s", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=cli_env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["server_exit"] == 0 and doc["errors_total"] == 0
    assert set(doc["counts"]) == set(soak.MIX)
    s = doc["samples"]
    assert len(s) >= 15 and all(x["rss_mib"] for x in s)
    assert sum(x["refused"] for x in s) == doc["counts"]["refuse"] and sum(x["aborted"] for x in s) >= 1
    assert max(x["kv_blocks_used"] for x in s) > 0 and doc["ttft_ms"]["p99"] is not None
    assert {k: doc["final"][k] for k in soak.IDLE} == dict.fromkeys(soak.IDLE, 0)
    soak_plot.main([str(out), str(tmp_path / "soak.svg")])
    assert (tmp_path / "soak.svg").read_text().count("<polyline") == 4


def passing() -> dict:
    """A minute's series that passes: RSS rises in the warm-up (12 s), then stays flat."""
    samples = [dict(t=float(t), rss_mib=500.0 + min(t, 10) * 5, kv_blocks_used=10.0, oldest_s=1.0, errors=0,
                    ttft_p99_ms=50.0, tpot_p99_ms=5.0) for t in range(1, 61)]
    return {"config": {"warmup_s": 12.0, "stuck_s": 30.0, "drain_s": 5.0}, "samples": samples,
            "errors_total": 0, "errors": [], "server_exit": 0,
            "final": {**dict.fromkeys(soak.IDLE, 0.0), "kv_blocks_free": 95.0, "stuck": 0}}


@pytest.mark.parametrize("spoil, reason", [
    (lambda d: d["samples"][-1].update(rss_mib=550 * 1.06), "RSS grew 6.0%"),
    (lambda d: [x.update(rss_mib=x["rss_mib"] + x["t"]) for x in d["samples"]], "RSS grew"),  # a slow leak
    (lambda d: d["samples"][30].update(oldest_s=31.0), "stuck requests"),
    (lambda d: d["final"].update(stuck=2), "2 still in flight"),
    (lambda d: d["final"].update(kv_blocks_used=3.0), "not idle"),
    (lambda d: d["final"].update(num_requests_running=1.0), "not idle"),
    (lambda d: d["final"].update(kv_blocks_promised=None), "not idle"),  # /metrics did not answer
    (lambda d: d.update(errors_total=1, errors=[{"t": 3.0, "kind": "chat", "what": "500 ..."}]), "1 unexpected"),
    (lambda d: d.update(server_exit=-9), "status -9"),
], ids=["rss", "slow-leak", "stuck", "stuck-at-end", "kv-used", "running", "no-metrics", "error", "exit"])
def test_the_checks_fire(spoil, reason):
    assert soak.check(passing()) == []
    d = copy.deepcopy(passing())
    spoil(d)
    why = soak.check(d)
    assert len(why) == 1 and reason in why[0], why


def test_refusals_cannot_fit_and_long_prompts_can():
    rng, a = random.Random(0), SimpleNamespace(prompt_len=64, output_len=16)
    for _ in range(20):
        path, body, refusal = soak.request("refuse", rng, 512, a)
        assert refusal and len(body["prompt"]) + body["max_tokens"] > 512
        path, body, refusal = soak.request("long", rng, 512, a)
        assert not refusal and 256 <= len(body["prompt"]) and len(body["prompt"]) + body["max_tokens"] <= 512
