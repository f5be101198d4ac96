"""The folders flax/, tensorflow/ and tokenizers/ share names with packages: they must not shadow them."""

import os

from conftest import ROOT, check_ok, run


def test_package_named_folders_have_no_init():
    for folder in ("flax", "tensorflow", "tokenizers"):
        assert not os.path.exists(os.path.join(ROOT, folder, "__init__.py")), f"{folder}/__init__.py would shadow the package"


def test_imports_resolve_to_site_packages_from_repo_root():
    # `python -c` puts the current directory first on sys.path: the worst case for shadowing.
    code = "import flax, tensorflow, tokenizers; print(flax.__file__); print(tensorflow.__file__); print(tokenizers.__file__)"
    result = check_ok(run(["-c", code], env={"TF_CPP_MIN_LOG_LEVEL": "3"}, cwd=ROOT))
    paths = result.stdout.strip().splitlines()
    assert len(paths) == 3
    for path in paths:
        assert path and "site-packages" in path and not path.startswith(ROOT + os.sep + "flax"), paths
        assert not os.path.abspath(path).startswith(os.path.join(ROOT, "tokenizers")), paths
        assert not os.path.abspath(path).startswith(os.path.join(ROOT, "tensorflow")), paths
