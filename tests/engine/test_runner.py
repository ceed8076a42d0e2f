"""EngineRunner: continuous batching, admission, preemption + recompute, accounting, dense check."""

import pytest
import torch

from dsv4.config import get_preset
from dsv4.engine import EngineRunner, Request, Tolerance, make_workload, memory_by_layer_kind

CFG = get_preset("tiny")
LAYERS = (0, 1, 2)  # one SWA, one CSA, one HCA layer: every kind, faster than the whole stack


def _runner(**kw):
    args = dict(max_requests=3, num_pages=8, block_tokens=128, prefill_chunk=64, token_budget=128, backend="torch")
    args.update(kw)
    return EngineRunner(CFG, layers=args.pop("layers", LAYERS), **args)


def _assert_all_free(eng):
    eng.manager.check_invariants()
    st = eng.manager.stats()
    assert st.requests_active == 0 and st.requests_preempted == 0 and st.slots_used == 0
    assert st.tokens_cached == 0
    assert all(p.pages_used == 0 and p.pages_free == p.pages_total for p in st.pools.values())


@pytest.fixture(scope="module")
def preempting_run():
    """Three requests that need 5 ratio-4 pages together, in a pool of 3: someone must be preempted."""
    eng = _runner(num_pages=3)
    infos = []
    reqs = [Request("a", 150, 4), Request("b", 140, 5), Request("c", 100, 3, arrival_step=1)]
    eng.run(reqs, on_step=lambda info, e: infos.append(info))
    eng.verify()
    return eng, infos


def test_preemption_happens_and_every_request_verifies(preempting_run):
    eng, infos = preempting_run
    r = eng.result
    assert r.preemptions >= 1 and any(i.preempted for i in infos)
    assert r.recomputed_tokens > 0
    assert r.finished == 3 and eng.done
    assert [q.tokens for q in sorted(r.requests, key=lambda q: q.id)] == [153, 144, 102]
    resumed = [q for q in r.requests if q.recomputed_tokens > 0]
    assert resumed and all(q.preemptions >= 1 for q in resumed)
    for q in r.requests:
        assert q.passed, q
        assert q.layer_max_abs <= 0.02 and q.layer_mean_abs <= 1e-3, q  # one or two bf16 ulps per layer
    assert r.all_passed
    # token accounting: each input computed once, plus recomputation
    assert r.prefill_tokens == 150 + 140 + 100
    assert r.decode_tokens == 3 + 4 + 2
    assert r.tokens == r.prefill_tokens + r.decode_tokens + r.recomputed_tokens
    assert r.peak_pages_used[4] == 3 and r.tokens_per_s > 0


def test_swapped_requests_are_not_recomputed_and_verify():
    """swap=True: a preempted request's cache goes to the host and comes back (``save`` / ``load``); the same
    workload then finishes with nothing recomputed and every request matching the dense reference."""
    eng = EngineRunner(CFG, max_requests=3, num_pages=3, backend="torch", swap=True)
    infos = []
    eng.run([Request("a", 150, 4), Request("b", 140, 5), Request("c", 100, 3, arrival_step=1)],
            on_step=lambda info, e: infos.append(info))  # fmt: skip
    eng.verify()
    r = eng.result
    assert r.preemptions >= 1 and r.swapped_bytes > 0 and r.recomputed_tokens == 0
    assert r.finished == 3 and eng.done and r.all_passed
    assert [q.tokens for q in sorted(r.requests, key=lambda q: q.id)] == [153, 144, 102]
    s = eng.manager.stats()
    assert s.slots_used == 0 and all(p.pages_used == 0 for p in s.pools.values())


def test_fp8_weights_run_verifies():
    """fp8_weights=True: every layer's linear weights are FP8Weight; the same preempting workload finishes with every
    request matching the dense reference on those weights (CPU: the projections' torch path)."""
    eng = EngineRunner(CFG, max_requests=3, num_pages=3, backend="torch", fp8_weights=True)
    assert all(w.has_fp8 for w in eng.weights.values())
    eng.run([Request("a", 150, 4), Request("b", 140, 5), Request("c", 100, 3, arrival_step=1)])
    eng.verify()
    assert eng.result.finished == 3 and eng.result.all_passed


def test_samples_fork_the_prompt_and_verify():
    """Request(samples=n): once the prompt is cached, n - 1 continuations get its cache by ``fork`` (filled pages
    shared) instead of computing it; each continues on its own (seeded noise on its inputs) and every one, the forks
    included, matches the dense reference over its own recorded inputs."""
    eng = EngineRunner(CFG, max_requests=6, num_pages=8, backend="torch")
    eng.run([Request("a", 150, 5, samples=3), Request("b", 140, 1, samples=2), Request("c", 100, 4, arrival_step=1)])
    eng.verify()
    r = eng.result
    assert r.finished == 6 and r.all_passed and r.forked_tokens == 2 * 150 + 140
    assert r.prefill_tokens == 150 + 140 + 100  # each prompt computed once
    a, a1, a2 = (eng._finished[i] for i in ("a", ("a", 1), ("a", 2)))
    assert torch.equal(a.outputs[:150], a1.outputs[:150])  # the shared prompt
    assert not torch.equal(a.outputs[150:154], a1.outputs[150:154]) and not torch.equal(a1.inputs, a2.inputs)
    s = eng.manager.stats()
    assert s.slots_used == 0 and all(p.pages_used == 0 for p in s.pools.values())
    with pytest.raises(ValueError, match="samples"):
        Request("x", 10, 2, samples=0)


def test_a_sample_that_does_not_fit_computes_its_prompt():
    """No free slot when the prompt completes: the sample waits as a request of its own and prefills the prompt."""
    eng = EngineRunner(CFG, max_requests=1, num_pages=8, backend="torch")
    eng.run([Request("a", 60, 3, samples=2)])
    eng.verify()
    r = eng.result
    assert r.finished == 2 and r.all_passed and r.forked_tokens == 0 and r.prefill_tokens == 2 * 60


def test_everything_free_at_the_end(preempting_run):
    eng, _ = preempting_run
    _assert_all_free(eng)


def test_steps_respect_budget_chunk_and_slots(preempting_run):
    eng, infos = preempting_run
    for info in infos:
        assert sum(n for _, n in info.schedule) <= eng.token_budget
        assert all(1 <= n <= eng.prefill_chunk for _, n in info.schedule)
        assert info.running <= eng.manager.state.num_slots
        assert all(used <= info.pages_total[m] for m, used in info.pages_used.items())


def test_admission_waits_for_a_free_slot():
    eng = _runner(max_requests=2)
    infos = []
    reqs = [Request(i, 20 + 10 * i, 3) for i in range(4)]
    eng.run(reqs, on_step=lambda info, e: infos.append(info))
    admitted = {rid: i.step for i in infos for rid in i.admitted}
    finished = {rid: i.step for i in infos for rid in i.finished}
    assert admitted[0] == admitted[1] == 0
    assert infos[0].running == 2 and infos[0].waiting == 2
    first_finish = min(finished.values())
    assert admitted[2] > first_finish and admitted[3] > first_finish  # only once slots were freed
    assert max(i.running for i in infos) == 2
    assert eng.result.preemptions == 0
    _assert_all_free(eng)
    assert all(q.passed for q in eng.verify())


def test_decodes_are_scheduled_before_prefill_chunks():
    eng = _runner(token_budget=40, prefill_chunk=64)
    infos = []
    eng.run([Request("short", 8, 6), Request("long", 200, 2, arrival_step=2)], on_step=lambda i, e: infos.append(i))
    mixed = [i for i in infos if len(i.schedule) == 2]
    assert mixed
    for i in mixed:
        assert i.schedule[0] == ("short", 1)  # the decode first, the prefill chunk gets the rest of the budget
        assert i.schedule[1] == ("long", 39)


def test_verification_detects_a_wrong_output(preempting_run):
    eng, _ = preempting_run
    live = next(iter(eng._finished.values()))
    saved = live.layer_out.clone()
    try:
        live.layer_out[10:20, 1] += 0.25  # a stale/wrong cache would look like this
        bad = {q.id: q for q in eng.verify()}
        assert not bad[live.req.id].passed
        assert sum(not q.passed for q in bad.values()) == 1
    finally:
        live.layer_out.copy_(saved)
        eng.verify()
    assert eng.result.all_passed


def test_stack_tolerance_is_enforced(preempting_run):
    eng, _ = preempting_run
    try:
        res = eng.verify(Tolerance(max_abs=1e-6))
        assert not any(q.passed for q in res)  # the stack differs at bf16 level: a zero tolerance must fail
    finally:
        eng.verify(Tolerance())


def test_pool_too_small_for_one_request_raises():
    """A request that could never fit the whole cache is refused when submitted (pages needed and available named),
    and queues nothing: the runner stays usable."""
    eng = _runner(num_pages=1, max_requests=1)
    with pytest.raises(ValueError, match="need 3 ratio-4 pages, the cache has 1: it could never run"):
        eng.run([Request(0, 300, 2)])
    assert eng.done
    eng.run([Request(1, 20, 2)])
    assert eng.num_finished == 1


def test_submit_is_all_or_nothing():
    """A batch with a bad request (a duplicate id, a non-Request) queues none of it; the corrected batch then goes."""
    eng = _runner()
    for bad in ([Request(0, 4, 2), Request(1, 4, 2), Request(0, 4, 2)], [Request(0, 4, 2), "not a request"]):
        with pytest.raises(ValueError, match="duplicate id|expected Request"):
            eng.submit(bad)
        assert eng.done and eng.num_waiting == 0
    eng.run([Request(0, 4, 2), Request(1, 4, 2)])
    assert eng.num_finished == 2
    _assert_all_free(eng)


def test_a_step_that_fails_in_the_model_leaks_nothing_and_the_runner_goes_on(monkeypatch):
    """An error inside the layers (here: the first forward raises) cancels the step's plan, drops the cache of its
    requests (recomputed on readmission) and re-raises; the next steps run, every request finishes as in a clean
    run, and nothing is left allocated."""
    clean = _runner().run([Request(0, 70, 3), Request(1, 20, 2)])
    eng = _runner()
    forward, calls = eng.forward, []

    def flaky(x, plan):
        calls.append(plan.num_tokens)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return forward(x, plan)

    monkeypatch.setattr(eng, "forward", flaky)
    eng.submit([Request(0, 70, 3), Request(1, 20, 2)])
    eng.step()
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.manager.check_invariants()
    assert eng.manager._outstanding is None  # noqa: SLF001 - the plan was cancelled
    res = eng.run()
    assert res.finished == clean.finished == 2 and res.preemptions >= 1
    _assert_all_free(eng)


def test_unknown_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match="backend: expected one of"):
        _runner(backend="bogus")


def test_argument_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        Request(0, 0, 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(0, 5, 0)
    with pytest.raises(ValueError, match="exactly one"):
        EngineRunner(CFG, num_pages=4, budget_bytes=1 << 30)
    eng = _runner()
    eng.submit([Request(0, 5, 1)])
    with pytest.raises(ValueError, match="duplicate"):
        eng.submit([Request(0, 5, 1)])


def test_budget_sizing_and_memory_by_kind():
    eng = EngineRunner(CFG, max_requests=2, budget_bytes=8 << 20, backend="torch", layers=(0,))
    st = eng.manager.stats()
    assert st.bytes_total <= 8 << 20
    kinds = memory_by_layer_kind(eng.manager)
    assert {k: v["layers"] for k, v in kinds.items()} == {"swa": 2, "csa": 2, "hca": 1}
    assert sum(v["bytes_allocated"] for v in kinds.values()) == st.bytes_total
    assert all(v["bytes_used"] == 0 for v in kinds.values())


def test_workload_is_seeded():
    a, b = make_workload(5, seed=3), make_workload(5, seed=3)
    assert a == b and a != make_workload(5, seed=4)
    assert [r.arrival_step for r in a] == sorted(r.arrival_step for r in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_with_triton_backend_verifies():
    eng = EngineRunner(CFG, max_requests=3, num_pages=3, backend="auto", device="cuda")
    eng.run([Request("a", 150, 4), Request("b", 140, 5), Request("c", 100, 3, arrival_step=1)])
    assert eng.result.preemptions >= 1
    assert all(q.passed for q in eng.verify())
    _assert_all_free(eng)
