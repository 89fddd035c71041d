"""The benchmarks' pure helpers: what they print is measured as they say (bench/ is not in CI
otherwise but through test_bench_smoke.py's runs)."""

from rollout.engine.stats import EngineStats

from bench.fma_peak import rotated
from bench.spec import since


def test_spec_rates_are_those_of_the_run_after_the_warm_up():
    warm_up = EngineStats(generated_tokens=4, steps=2, spec_proposed=8, spec_accepted=8,
                          spec_verifications=2, spec_emitted=10).as_dict()
    after = EngineStats(generated_tokens=20, steps=10, spec_proposed=16, spec_accepted=10,
                        spec_verifications=6, spec_emitted=16).as_dict()
    run = since(warm_up, after)
    assert (run.generated_tokens, run.steps, run.spec_proposed) == (16, 8, 8)
    assert run.acceptance_rate == 2 / 8  # cumulative: 10 / 16
    assert run.tokens_per_verification == 6 / 4  # cumulative: 16 / 6


def test_each_case_runs_first_after_the_probe_in_turn():
    cases = ["native", "shared", "plain", "matmul"]
    orders = [rotated(cases, repeat) for repeat in range(8)]
    assert [order[0] for order in orders] == cases * 2
    for order in orders:  # the same cycle: each case still follows the same neighbour
        k = order.index("native")
        assert order[k:] + order[:k] == cases
