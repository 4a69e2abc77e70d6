"""The one place the version lives (pyproject.toml reads it; ``mx-refit --version`` prints it)."""

__version__ = "0.1.0"
