"""The wheel installs every package folder, under import names that do not collide with other
distributions (pyproject.toml lists them; kernels/ and recipes/ are renamed)."""

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_installed_and_nothing_else():
    renamed = {folder: name for name, folder in SETUPTOOLS["package-dir"].items()}
    folders = {p.parent.relative_to(ROOT).parts
               for top in ("rollout", "kernels", "recipes", "trainer_hooks")
               for p in (ROOT / top).rglob("__init__.py")}
    expected = {".".join([renamed.get(parts[0], parts[0]), *parts[1:]]) for parts in folders}
    assert set(SETUPTOOLS["packages"]) == expected


def test_every_folder_is_a_package_and_the_configs_ship():
    """A folder without __init__.py (recipes/configs once) is a namespace package setuptools
    warns it will stop shipping; the recipes' YAML configs are their package's data."""
    folders = [d for top in ("rollout", "kernels", "recipes", "trainer_hooks")
               for d in [ROOT / top, *(ROOT / top).rglob("*")]
               if d.is_dir() and d.name != "__pycache__"]
    assert [d for d in folders if not (d / "__init__.py").exists()] == []
    configs = ROOT / "recipes" / "configs"
    shipped = {p for g in SETUPTOOLS["package-data"]["rollout_recipes.configs"]
               for p in configs.glob(g)}
    assert shipped == set(configs.glob("*.yaml")) and shipped


def test_no_top_level_name_that_other_distributions_install():
    top = {name.split(".")[0] for name in SETUPTOOLS["packages"]}
    assert top == {"rollout", "rollout_kernels", "rollout_recipes", "trainer_hooks"}


def test_the_renamed_packages_import_from_their_folders():
    import rollout_kernels
    import rollout_recipes

    assert pathlib.Path(rollout_kernels.__file__).parent == ROOT / "kernels"
    assert pathlib.Path(rollout_recipes.__file__).parent == ROOT / "recipes"


def test_the_native_kernels_sources_and_headers_ship_and_are_built():
    """The wheel carries what rollout_kernels.cpu compiles at first use, and the build (and its
    cache key) takes every C file of the folder: a header left out of the key would let a
    changed header reuse a stale library."""
    from rollout_kernels import cpu as native

    folder = ROOT / "kernels" / "cpu"
    globs = SETUPTOOLS["package-data"]["rollout_kernels.cpu"]
    shipped = {p.name for g in globs for p in folder.glob(g)}
    assert {*native.SOURCES, *native.HEADERS} == shipped == {
        p.name for p in folder.iterdir() if p.suffix in (".c", ".h")}


def test_the_kernels_folder_does_not_hide_hub_kernels(tmp_path):
    """With the repository root on sys.path (python -m from it), `import kernels` finds this
    folder first; transformers >= 5.25 imports Hugging Face's hub-kernels package by that name.
    The folder hands the import over to an installed `kernels` (a stand-in one here, later on
    the path), and rollout_kernels stays ours."""
    import subprocess
    import sys

    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("HUB = True\n")
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
            "import kernels, rollout_kernels\n"
            "assert getattr(kernels, 'HUB', False), kernels.__file__\n"
            "print(rollout_kernels.__file__)\n")
    run = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert pathlib.Path(run.stdout.strip()).parent == ROOT / "kernels"
    # Without another `kernels` on the path the folder is what the name finds, as before.
    alone = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import kernels; print(kernels.__file__)", str(ROOT)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    if alone.returncode == 0 and "site-packages" not in alone.stdout:
        assert pathlib.Path(alone.stdout.strip()).parent == ROOT / "kernels"


def test_no_script_folder_module_hides_an_installed_one():
    """bench/ and the test folders are sys.path[0] for their scripts (and pytest puts the test
    folders on the path): a module there named like an installed top-level module hides it
    from everything imported after (a bench script named kernels.py hid the hub `kernels`
    that transformers >= 5.25 imports)."""
    import importlib.machinery
    import sys

    installed = [p for p in sys.path if "site-packages" in p or "dist-packages" in p]
    folders = [ROOT / "bench", *(p for p in (ROOT / "tests").iterdir() if p.is_dir())]
    clashes = [(folder.name, f.stem) for folder in folders for f in folder.glob("*.py")
               if importlib.machinery.PathFinder.find_spec(f.stem, installed) is not None]
    assert not clashes
