"""The version of subquad (also ``subquad.__version__``)."""

__version__ = "0.2.0.dev0"  # as pyproject.toml; the changelog's 0.2, unreleased
