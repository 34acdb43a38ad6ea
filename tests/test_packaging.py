"""pyproject.toml's extras: whatever of them this environment has installed works together (every requirement of
every package they brought is met: what broke when [torchtitan] was installed after [hf], its datasets pulling
huggingface-hub below the 2.4 that transformers 5.25 needs), and the package metadata builds without the
deprecated license table."""

import importlib.metadata as metadata
import tomllib
from pathlib import Path

import pytest

requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def unmet(requirement: str, extra: str = "") -> list[str]:
    """The requirements, from `requirement` down through what it needs, that this environment does not meet
    (one not installed where its marker applies, or installed at a version outside its specifier)."""
    found, seen, todo = [], set(), [(requirements.Requirement(requirement), extra, "pyproject.toml")]
    while todo:
        need, extra, wanted_by = todo.pop()
        if need.marker is not None and not need.marker.evaluate({"extra": extra}):
            continue
        try:
            version = metadata.version(need.name)
        except metadata.PackageNotFoundError:
            found.append(f"{need} (for {wanted_by}): not installed")
            continue
        if not need.specifier.contains(version, prereleases=True):
            found.append(f"{need} (for {wanted_by}): {version} installed")
        for chosen in {""} | set(need.extras):
            if (need.name.lower(), chosen) not in seen:
                seen.add((need.name.lower(), chosen))
                todo += [(requirements.Requirement(r), chosen, f"{need.name} {version}")
                         for r in metadata.requires(need.name) or ()]
    return found


@pytest.mark.parametrize("extra", sorted(PYPROJECT["project"]["optional-dependencies"]))
def test_every_installed_extra_has_every_requirement_met(extra):
    """An extra counts as installed when its first requirement's package is; then each of its packages and
    everything they need must be there at a version they accept (pip check, for shardopt's extras)."""
    wanted = PYPROJECT["project"]["optional-dependencies"][extra]
    try:
        metadata.version(requirements.Requirement(wanted[0]).name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"the [{extra}] extra is not installed")
    problems = [problem for requirement in wanted for problem in unmet(requirement)]
    assert not problems, f"[{extra}]: " + "; ".join(problems)


def test_the_license_is_an_spdx_expression():
    """`license = {text = ...}` makes setuptools ≥ 77 warn on every install; the SPDX string needs ≥ 77 to build."""
    assert PYPROJECT["project"]["license"] == "MIT"
    assert any(r.startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in PYPROJECT["build-system"]["requires"])
