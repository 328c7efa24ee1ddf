"""Helpers shared by the engine-level test modules (no tests here)."""


def run_requests(eng, reqs, check=True):
    """Adds reqs ({id: (prompt ids, SamplingParams)}) at once and steps the engine until nothing is left;
    returns {id: generated ids}. check: the scheduler's bookkeeping after every step."""
    out = {r: [] for r in reqs}
    for r, (p, sp) in reqs.items():
        eng.add_request(r, p, sp)
    while eng.has_unfinished():
        for u in eng.step():
            out[u.request_id] += u.new_token_ids
        if check:
            eng.scheduler.check_integrity()
    return out
