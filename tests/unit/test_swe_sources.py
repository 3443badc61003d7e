"""envs/swe/sources.py on local sources (no network): a sdist tarball and a folder, which files are
tests and which are code, and the declared test requirements."""

from __future__ import annotations

import tarfile

import pytest
from swe_fixture import TINY_PACKAGE, write_tree

from gapless.envs.swe.sources import SourceError, fetch

PYPROJECT = """\
[project]
name = "tinystats"
version = "0.2.0"
dependencies = ["text-unidecode>=1.3"]

[project.optional-dependencies]
test = ["pytest>=7", "pytest-cov", "hypothesis>=6; python_version >= '3.8'", "legacy; python_version < '3'"]
"""


def test_a_local_sdist_is_split_into_tests_and_code(tmp_path):
    extra = {
        "pyproject.toml": PYPROJECT,
        "setup.py": "from setuptools import setup\nsetup()\n",
        "docs/test_docs.py": "def test_docs():\n    pass\n",
        "tinystats/_version.py": "version = '0.2.0'\n",
        "requirements/test.txt": "-r base.txt\nsortedcontainers==2.4.0  # for the tests\n",
    }
    folder = write_tree(tmp_path / "tinystats-0.2.0", {**TINY_PACKAGE, **extra})
    sdist = tmp_path / "tinystats-0.2.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(folder, arcname="tinystats-0.2.0")
    source = fetch(str(sdist), tmp_path / "cache")
    assert source.label == "tinystats-0.2.0"
    assert source.test_files == ("tests/test_core.py", "tests/test_text.py")
    assert source.source_files == ("tinystats/__init__.py", "tinystats/core.py", "tinystats/text.py")
    assert source.requirements == ("hypothesis>=6", "sortedcontainers==2.4.0", "text-unidecode>=1.3")
    assert fetch(str(folder), tmp_path / "cache").files == source.files


def test_a_source_without_tests_or_a_bad_spec_is_refused(tmp_path):
    folder = write_tree(tmp_path / "notests-1.0", {"notests/__init__.py": "x = 1\n"})
    with pytest.raises(SourceError, match="no test_"):
        fetch(str(folder), tmp_path / "cache")
    with pytest.raises(SourceError, match="NAME==VERSION"):
        fetch("toolz", tmp_path / "cache")
