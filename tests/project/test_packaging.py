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
