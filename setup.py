"""Packaging glue that pyproject.toml cannot express: the top-level ``recipes/`` folder (where
Hydra users and the README expect it) ships inside the wheel as ``mx_refit/recipes``, so that
``mx_refit.config.load_recipe`` finds the recipes in an installed package too."""

from setuptools import find_namespace_packages, setup

RECIPES = ["mx_refit.recipes", *(f"mx_refit.recipes.{sub}" for sub in find_namespace_packages("recipes"))]

setup(
    packages=[*find_namespace_packages("core/src", include=["mx_refit", "mx_refit.*"], exclude=["*.__pycache__"]),
              *RECIPES],
    package_dir={"": "core/src", "mx_refit.recipes": "recipes"},
    # Here, not in pyproject.toml: a [tool.setuptools.package-data] table there replaces this one.
    package_data={"mx_refit": ["py.typed", "catalog/v1/*.proto", "catalog/v1/*.pyi"],
                  **{package: ["*.yaml"] for package in RECIPES}},
)
