"""jax / flax pairs: flax 0.12.8 fails to import on jax 0.11.2 (the 2026-11-26 GPU image: jax 0.11.2
needs flax 0.12.10). `import jaxinfer` refuses such a pair with one error naming the fix, and the
GPU extras pin a flax that works with the jax they allow."""
from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from jaxinfer.versions import check_jax_flax, release

ROOT = Path(__file__).resolve().parent.parent


def fake(versions: dict[str, str]):
    def version(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]
    return version


@pytest.mark.parametrize("jax_v,flax_v,ok", [
    ("0.11.2", "0.12.8", False),          # the pair that fails to import
    ("0.11.1", "0.12.9", False),
    ("0.12.0.dev20261101", "0.12.8", False),
    ("0.11.2", "0.12.10", True),
    ("0.11.2+cuda13", "0.12.11", True),
    ("0.10.2", "0.12.8", True),           # what PyPI gives this project's CPU machines
    ("0.11.0", "0.12.8", True),
])
def test_broken_pairs_are_refused_naming_the_fix(jax_v, flax_v, ok):
    check = lambda: check_jax_flax(fake({"jax": jax_v, "flax": flax_v}))  # noqa: E731
    if ok:
        check()
    else:
        with pytest.raises(ImportError, match=rf"flax {flax_v} does not work with jax {jax_v}.*pip install 'flax>=0\.12\.10'"):
            check()


def test_missing_packages_are_left_to_their_own_import():
    check_jax_flax(fake({"jax": "0.11.2"}))
    check_jax_flax(fake({}))


def test_release_parsing():
    assert release("0.12.10rc1") == (0, 12, 10) and release("0.11.2+cuda13") == (0, 11, 2)
    assert release("1.0") == (1, 0, 0) and release("0.12.0.dev2026") == (0, 12, 0)


def test_installed_pair_passes():
    check_jax_flax()


def test_gpu_extras_pin_a_flax_that_imports_on_the_jax_they_allow():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for name in ("cuda12", "cuda13"):
        reqs = {Requirement(r).name: Requirement(r) for r in extras[name]}
        assert name in reqs["jax"].extras
        lowest_jax = min(v for v in (Version(f"0.{m}.{p}") for m in (10, 11, 12) for p in range(12))
                         if reqs["jax"].specifier.contains(v))
        assert lowest_jax >= Version("0.11.1")     # so every jax they allow needs flax >= 0.12.10
        assert not reqs["flax"].specifier.contains(Version("0.12.9"))
        assert reqs["flax"].specifier.contains(Version("0.12.10"))
