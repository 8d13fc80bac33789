"""The packages whose internals mlxwalk reaches into name the range it was tried on: an upper
bound at the first release not yet tried, so a user's fresh install never resolves an untried
release; and what is installed here lies inside those ranges."""

from importlib import metadata

import pytest
from packaging.requirements import Requirement

REACHED_INTO = {"mlx", "mlx-lm", "torch", "transformers", "peft"}


def requirements() -> dict[str, Requirement]:
    found = {}
    for line in metadata.requires("mlxwalk") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": "torch"}):
            found[req.name] = req
    return found


def test_every_package_reached_into_has_an_upper_bound():
    reqs = requirements()
    assert REACHED_INTO <= set(reqs), f"not declared: {REACHED_INTO - set(reqs)}"
    for name in REACHED_INTO:
        bounds = [s for s in reqs[name].specifier if s.operator in ("<", "<=", "~=", "==")]
        assert bounds, f"{name} {reqs[name].specifier} names no upper bound"


@pytest.mark.parametrize(
    "name",
    [
        n if n not in ("torch", "peft") else pytest.param(n, marks=pytest.mark.torch)
        for n in sorted(REACHED_INTO)
    ],
)
def test_the_installed_release_is_one_tried(name):
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed (the torch extra)")
    req = requirements()[name]
    assert req.specifier.contains(version, prereleases=True), f"{name} {version} not in {req}"
