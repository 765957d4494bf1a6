"""Recipe schema and loading."""

from cptune.config.loader import load_recipe, validate_recipe
from cptune.config.recipe import DatasetConfig, Recipe

__all__ = ["DatasetConfig", "Recipe", "load_recipe", "validate_recipe"]
