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


def _drafter(tmp_path_factory, preset):
    from openinfer.drafter import write_random_drafter
    from openinfer.tools.random_checkpoint import drafter_config
    return write_random_drafter(tmp_path_factory.mktemp(preset), drafter_config(preset))


@pytest.fixture(scope="module")
def dspark_dir(tmp_path_factory):
    return _drafter(tmp_path_factory, "tiny-dspark")


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory):
    return _drafter(tmp_path_factory, "tiny-dflash")


@pytest.fixture(scope="module")
def rounds(tiny_dir, dspark_dir, dflash_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "rounds.json"
    spec_bench.main(["rounds", "--model-path", str(tiny_dir), "--device", "cpu", "--context", "20",
                     "--batches", "1,2", "--spans", "4,8", "--rounds", "2", "--warmup", "1",
                     "--draft-model-path", f"{dspark_dir},{dflash_dir}", "--out", str(out)])
    return out


def test_rounds(rounds):
    res = json.loads(rounds.read_text())
    assert res["what"] == "rounds" and res["commit"] and not res["errors"]
    rows = res["rows"]
    shapes = {(r["engine"], r["what"], r["batch"], r["span"]) for r in rows}
    engines = {r["drafter"]["format"]: r["engine"] for r in rows if "drafter" in r}
    assert set(engines) == {"dspark", "dflash"}
    for B in (1, 2):
        assert {("target", "decode", B, 1), ("target", "verify", B, 4), ("target", "verify", B, 8)} <= shapes
        # each drafter's own span gets the verify+draft row: DSpark block 7 (7 drafts, 8 tokens verified);
        # DFlash block 16 (15 drafts, 16 verified), whose draft block then reaches 16 positions past the
        # verified ones, more than the largest span past them (the backend refuses a table short of it)
        assert (engines["dspark"], "verify+draft", B, 8) in shapes
        assert (engines["dflash"], "verify+draft", B, 16) in shapes
        assert {(engines["dflash"], "verify", B, s) for s in (4, 8, 16)} <= shapes
    for r in rows:
        assert r["steps"] == 2 and r["ctx"] == 20 and r["tokens"] == r["batch"] * r["span"]
        assert r["wall_ms_median"] > 0 and r["gpu_ms_median"] >= 0 and r["draft_ms_median"] >= 0
        assert r["wall_x_plain"] > 0
        if r["what"] != "decode":
            assert 1 <= r["accepted_mean"] <= r["span"]  # random drafts: 1 almost always
    for fmt, k in (("dspark", 7), ("dflash", 15)):
        d = {r["batch"]: r for r in rows if r["what"] == "verify+draft" and r["engine"] == engines[fmt]}
        assert d[1]["drafter"]["num_drafts"] == k
        # the drafter runs in the verify+draft step only: its clock (the engine's stats) shows it there
        verify = {r["batch"]: r for r in rows if r["what"] == "verify" and r["span"] == k + 1
                  and r["engine"] == engines[fmt]}
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
    assert res["lossless"] and "controlled acceptance" in res["acceptance"] and res["near_tie_bound"] == 0.25
    plain = {r["concurrency"]: r for r in res["rows"] if r["engine"] == "plain"}
    spec = {(r["concurrency"], r["tau"]): r for r in res["rows"] if r["engine"] == "replay"}
    assert set(plain) == {1, 2} and set(spec) == {(c, t) for c in (1, 2) for t in (1, 3, 5)}
    for c, p in plain.items():
        assert p["requests"] == c and p["output_tokens"] == 11 * c and p["tpot_ms_p50"] > 0 and p["output_tok_s"] > 0
        assert p["logprobs_run_differs"] == 0  # the logprobs rerun repeats the timed run's tokens
    for (c, tau), r in spec.items():
        assert r["mismatched_requests"] == 0 and r["output_tokens"] == 11 * c
        assert r["near_tie_partings"] == r["real_partings"] == [] and r["tokens_off_recording"] == 0
        # one untimed run records the engine's own output (tau >= 2), which follows the plain one here
        assert r["recording"] == ("plain output" if tau == 1 else "own output (untimed runs: 1)")
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


def test_partings_near_tie_or_real(capsys):
    """The serve check's verdict on where a speculative output parts from the plain one, from the plain
    run's best logprobs there (the CPU backend's outputs do not part, so synthetic ones)."""
    part = spec_bench.parting
    plain = [5, 6, 7, 8]
    top = [[(5, -0.1), (1, -3.0)], [(6, -0.2), (2, -2.0)], [(7, -1.0), (9, -1.1)], [(8, -0.5), (3, -4.0)]]
    assert part(plain, list(plain), plain, top) is None
    tie = part(plain, [5, 6, 9, 4], plain, top)  # 9 is the plain run's second best, 0.1 behind
    assert tie["kind"] == "near-tie" and tie["first_diff"] == 2 and tie["margin"] == pytest.approx(0.1)
    assert (tie["plain_token"], tie["spec_token"]) == (7, 9)
    # an exact tie that the logprobs run lists the other way round is a near-tie too
    assert part(plain, [5, 6, 9], plain, top[:2] + [[(9, -1.0), (7, -1.0)]] + top[3:])["margin"] == 0.0
    # what bf16 rounding does not explain: a clear lead, a token that is not the second best, no margin
    wide = part(plain, [5, 6, 9, 4], plain, top[:2] + [[(7, -1.0), (9, -1.5)]] + top[3:])
    assert wide["kind"] == "real" and "above" in wide["why"] and wide["margin"] == pytest.approx(0.5)
    third = part(plain, [5, 3, 7, 8], plain, top)  # 3 is not among the plain run's two listed at token 1
    assert third["kind"] == "real" and "2 best" in third["why"] and third["margin"] == pytest.approx(1.8)
    # a three-way tie: the speculative token is the third best, within the bound of the plain one
    three = [(7, -1.0), (4, -1.02), (9, -1.05), (1, -3.0)]
    tie3 = part(plain, [5, 6, 9, 4], plain, top[:2] + [three] + top[3:])
    assert tie3["kind"] == "near-tie" and tie3["margin"] == pytest.approx(0.05)
    left = part(plain, [5, 6, 9, 4], [5, 2, 7, 8], top)  # the logprobs run took another path before token 2
    assert left["kind"] == "real" and left["margin"] is None
    assert part(plain, [5, 6, 7], plain, top)["why"] == "the lengths differ"
    assert part(plain, [5, 6, 9], plain, top, bound=0.05)["kind"] == "real"
    # the table lists each real parting and the near-tie margins; lossless is the rows' verdict
    row = dict(engine="replay", concurrency=1, tau=1, tpot_ms_p50=1.0, output_tok_s=1.0, tpot_speedup_vs_plain=1.0,
               tokens_per_round=1.0, rounds=3, rounds_expected=3, tokens_off_recording=0, mismatched_requests=2,
               near_tie_partings=[dict(request=0, **tie)], real_partings=[dict(request=1, **wide)])
    spec_bench.table_serve(dict(acceptance="controlled", near_tie_bound=0.25, lossless=False, rows=[row]))
    got = capsys.readouterr().out
    assert "real parting: conc 1 tau 1 request 1 at token 2: margin above the near-tie bound (margin 0.500)" in got
    assert " 0.100" in got and got.rstrip().endswith("False")


def test_project_without_its_rounds_json(tmp_path):
    """A rounds run that failed leaves no JSON: project says so in one sentence (no traceback)."""
    got = subprocess.run([sys.executable, str(BENCH / "spec_bench.py"), "project", "--rounds-json",
                          str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert got.returncode == 1 and "Traceback" not in got.stderr
    assert got.stderr.strip() == f"project: {tmp_path / 'missing.json'} does not exist (its rounds run failed or did not run)"


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
