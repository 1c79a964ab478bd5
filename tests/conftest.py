"""Hypothesis profiles: `ci` (default; derandomized, fast) and `deep` (HYPOTHESIS_PROFILE=deep); one
thread per test process.

The suite sets its own thread count, so that its time does not depend on the machine's load: with one
OpenMP thread per core, a 2-core machine whose other core is busy makes every small matmul wait for
it (docs/testing.md). DFLASH2_TEST_THREADS overrides it; subprocesses started by the tests inherit
it through OMP_NUM_THREADS.
"""

import os

THREADS = os.environ.get("DFLASH2_TEST_THREADS", "1")
os.environ["OMP_NUM_THREADS"] = THREADS  # before torch is imported, for this process and its children

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(int(THREADS))

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _shared_targets_stay_float64():
    """tiny_target's models are cached and shared by the tests of a process: one cast in place (`.float()`)
    would change the numbers of every later test on that worker, so that results hung on the order."""
    yield
    from tests.helpers import SHARED_TARGETS

    cast = {p.dtype for m in SHARED_TARGETS for p in m.parameters()} - {torch.float64}
    assert not cast, f"a test cast a shared tiny_target to {cast}: copy.deepcopy it first"
