"""The bisection behind "largest window under a cap": exact, and never far past the answer."""

from scripts.lib.bench import largest_window


def test_largest_window_finds_the_edge_without_probing_far_past_it():
    tried = []

    def ok(n):
        tried.append(n)
        return n <= 5000

    assert largest_window(ok, 256, 1 << 20, 256) == 4864
    assert max(tried) <= 8192  # doubling stops at the first failure
    assert largest_window(lambda n: True, 256, 4096, 256) == 4096
    assert largest_window(lambda n: False, 256, 4096, 256) == 0
