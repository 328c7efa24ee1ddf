"""bench/spec_bench.py on the CPU backend with the tiny model: each subcommand runs in seconds and writes
real, consistent numbers (round shapes as asked, drafts back from a verify+draft step, a controlled
acceptance that keeps exactly tau tokens a round, speculative output == plain output, projections that
follow from the round costs)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
import spec_bench  # noqa: E402


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    from openinfer.drafter import write_random_drafter
    from openinfer.tools.random_checkpoint import drafter_config
    return write_random_drafter(tmp_path_factory.mktemp("tiny-dspark"), drafter_config("tiny-dspark"))


@pytest.fixture(scope="module")
def rounds(tiny_dir, dspark_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "rounds.json"
    spec_bench.main(["rounds", "--model-path", str(tiny_dir), "--device", "cpu", "--context", "20",
                     "--batches", "1,2", "--spans", "4,8", "--rounds", "2", "--warmup", "1",
                     "--draft-model-path", str(dspark_dir), "--out", str(out)])
    return out


def test_rounds(rounds):
    res = json.loads(rounds.read_text())
    assert res["what"] == "rounds" and res["commit"] and not res["errors"]
    rows = res["rows"]
    shapes = {(r["engine"], r["what"], r["batch"], r["span"]) for r in rows}
    for B in (1, 2):
        assert {("target", "decode", B, 1), ("target", "verify", B, 4), ("target", "verify", B, 8)} <= shapes
        # the drafter's own span (DSpark block 7: 7 drafts, 8 tokens verified) gets the verify+draft row
        assert ("target+" + Path(rows[-1]["drafter"]["path"]).name, "verify+draft", B, 8) in shapes
    for r in rows:
        assert r["steps"] == 2 and r["ctx"] == 20 and r["tokens"] == r["batch"] * r["span"]
        assert r["wall_ms_median"] > 0 and r["gpu_ms_median"] >= 0 and r["draft_ms_median"] >= 0
        assert r["wall_x_plain"] > 0
        if r["what"] != "decode":
            assert 1 <= r["accepted_mean"] <= r["span"]  # random drafts: 1 almost always
    d = {r["batch"]: r for r in rows if r["what"] == "verify+draft"}
    assert d[1]["drafter"]["num_drafts"] == 7 and d[1]["drafter"]["format"] == "dspark"
    # the drafter runs in the verify+draft step only: its clock (the engine's stats) shows it there
    verify = {r["batch"]: r for r in rows if r["what"] == "verify" and r["span"] == 8 and r["engine"] != "target"}
    for B in (1, 2):
        assert d[B]["draft_ms_median"] > verify[B]["draft_ms_median"]
        assert d[B]["draft_wall_ms_over_verify"] == d[B]["wall_ms_median"] - verify[B]["wall_ms_median"]


def test_serve_controlled_acceptance(tiny_dir, tmp_path):
    out = tmp_path / "serve.json"
    k = 4
    spec_bench.main(["serve", "--model-path", str(tiny_dir), "--device", "cpu", "--concurrency", "1,2",
                     "--taus", "1,3,5", "--num-drafts", str(k), "--input-len", "8", "--output-len", "11",
                     "--requests-per-client", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["lossless"] and "controlled acceptance" in res["acceptance"]
    plain = {r["concurrency"]: r for r in res["rows"] if r["engine"] == "plain"}
    spec = {(r["concurrency"], r["tau"]): r for r in res["rows"] if r["engine"] == "replay"}
    assert set(plain) == {1, 2} and set(spec) == {(c, t) for c in (1, 2) for t in (1, 3, 5)}
    for c, p in plain.items():
        assert p["requests"] == c and p["output_tokens"] == 11 * c and p["tpot_ms_p50"] > 0 and p["output_tok_s"] > 0
    for (c, tau), r in spec.items():
        assert r["mismatched_requests"] == 0 and r["output_tokens"] == 11 * c
        assert r["tpot_ms_p50"] > 0 and r["output_tok_s"] > 0 and r["tpot_speedup_vs_plain"] > 0
        # the ReplayDrafter controls acceptance exactly on the CPU backend: tau tokens a round (the last
        # round of a request cut by max_tokens)
        assert (r["rounds"], r["accepted_tokens"]) == (r["rounds_expected"], r["accepted_expected"])
        assert r["tokens_per_round"] == pytest.approx(r["tokens_per_round_expected"])
        if tau == 1:
            assert r["accepted_tokens"] == 0 and r["rounds"] == 9 * c  # 10 tokens after the first, the last plain
        if tau == k + 1:  # every proposal is the target's: every one accepted
            assert r["accepted_tokens"] == r["draft_tokens"] > 0
        else:
            assert r["accepted_tokens"] < r["draft_tokens"]
    assert spec_bench.expected_rounds(11, 3, 4) == (3, 6)  # 10 tokens: 3 + 3 + 3, then one by a plain step
    assert spec_bench.expected_rounds(11, 5, 4) == (2, 8)


def test_project_from_measured_rounds(rounds, tmp_path):
    out = tmp_path / "project.json"
    got = subprocess.run([sys.executable, str(BENCH / "spec_bench.py"), "project", "--rounds-json", str(rounds),
                          "--out", str(out)], capture_output=True, text=True, check=True).stdout
    assert "PROJECTION" in got
    res = json.loads(out.read_text())
    assert "projection" in res["label"] and res["round_kind"] == "verify+draft"
    src = {(r["engine"], r["what"], r["batch"], r["span"]): r for r in json.loads(rounds.read_text())["rows"]}
    rows = res["rows"]
    assert {r["benchmark"] for r in rows} == {"GSM8K", "MATH", "MBPP", "MT-Bench", "tau=5"}
    assert {r["basis"] for r in rows} == {"wall"}  # the CPU backend reports no device time
    assert {r["batch"] for r in rows} == {1, 2}
    for r in rows:
        rnd = src[(r["engine"], "verify+draft", r["batch"], 8)]["wall_ms_median"]
        step = src[("target", "decode", r["batch"], 1)]["wall_ms_median"]
        assert r["round_ms"] == rnd and r["plain_step_ms"] == step
        assert r["tpot_spec_ms"] == pytest.approx(rnd / r["tau"])
        assert r["speedup"] == pytest.approx(step * r["tau"] / rnd)
    assert next(r for r in rows if r["benchmark"] == "GSM8K")["tau"] == 6.11


def test_project_device_time_and_verify_only(tmp_path):
    """Device times, as the CUDA engine reports them: the gpu basis and the issue's goal check; without a
    drafter the round is the verify step alone, and says so."""
    def row(what, B, span, gpu, engine="target"):
        return dict(engine=engine, what=what, batch=B, span=span, gpu_ms_median=gpu, wall_ms_median=gpu + 0.1)
    rows = [row("decode", 1, 1, 2.0), row("verify", 1, 8, 2.4), row("decode", 4, 1, 2.2), row("verify", 4, 8, 3.0)]
    src = tmp_path / "r.json"
    src.write_text(json.dumps(dict(rows=rows)))
    res = spec_bench.main(["project", "--rounds-json", str(src)])
    assert res["round_kind"].startswith("verify only")
    g = res["goal_check"]
    assert g["tau"] == 5.0 and g["tpot_spec_ms"] == pytest.approx(0.48) and g["speedup"] == pytest.approx(2.0 / 0.48)
    rows.append(row("verify+draft", 1, 8, 3.0, engine="target+d"))
    src.write_text(json.dumps(dict(rows=rows)))
    res = spec_bench.main(["project", "--rounds-json", str(src)])
    assert res["round_kind"] == "verify+draft" and {r["batch"] for r in res["rows"]} == {1}
    assert res["goal_check"]["round_x_plain"] == pytest.approx(1.5)
