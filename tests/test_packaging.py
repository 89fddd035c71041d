"""The wheel installs every package folder, under import names that do not collide with other
distributions (pyproject.toml lists them; kernels/ and recipes/ are renamed)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).parent.parent
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
