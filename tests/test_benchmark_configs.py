"""The benchmarks' sweep configs pass the sweep's validation at every grid point they time
(`python -m benchmarks.sweep_throughput --quick` once stopped on its reference batch size)."""

import pytest

from benchmarks import sweep_throughput
from cbs.sweeps import launch


@pytest.mark.parametrize("batch_size", [16, 256])
@pytest.mark.parametrize("k", [1, 4])
def test_sweep_throughput_configs_are_valid(batch_size, k):
    c = sweep_throughput._config(batch_size, k, steps=10)
    trials = launch.check_config(c)
    assert [t.batch_size for t in trials] == [batch_size] * k
