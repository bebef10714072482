"""Paths written into shipped artifacts (peagle/paths.py): never an absolute path of this machine."""
import os

from peagle.paths import HOME, REPO, missing_hint, portable_path, portable_paths, portable_settings


def test_relative_under_the_working_directory_or_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert portable_path(tmp_path / "runs" / "data") == os.path.join("runs", "data")
    assert portable_path("runs/data") == os.path.join("runs", "data")
    assert portable_path(os.path.join(REPO, "models", "demo-target")) == os.path.join("models", "demo-target")


def test_elsewhere_is_symbolic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outside = os.path.join(os.path.dirname(str(tmp_path)), "elsewhere", "data2")
    assert portable_path(outside) == "<external>/data2"
    assert portable_paths(f"{tmp_path}/a,{outside}") == "a,<external>/data2"
    assert portable_path(None) is None
    assert portable_path(tmp_path.parent) == f"<external>/{tmp_path.parent.name}"    # not "..": above the cwd


def test_settings_make_only_their_path_keys_portable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outside = os.path.join(os.path.dirname(str(tmp_path)), "elsewhere", "head")
    s = {"model": os.path.join(REPO, "models", "demo-target"), "head": outside, "json": None,
         "note": outside, "k": 7, "func": print}
    got = portable_settings(s, ("model", "head", "json"), drop=("func",))
    assert got == {"model": os.path.join("models", "demo-target"), "head": "<external>/head", "json": None,
                   "note": outside, "k": 7}


def test_missing_hint_names_the_path_under_peagles_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = os.path.join("models", "demo-target-peagle")              # shipped: exists under HOME, not here
    assert os.path.isdir(os.path.join(HOME, rel))
    assert missing_hint(rel).endswith(f"did you mean {os.path.join(HOME, rel)}?")
    assert missing_hint(os.path.join("models", "no-such-head")) == ""            # nothing there either
    assert missing_hint(os.path.join(HOME, rel, "x")) == ""                       # absolute: nothing to add
    (tmp_path / "models" / "demo-target-peagle").mkdir(parents=True)
    assert missing_hint(rel) == ""                                                # it does name something here
