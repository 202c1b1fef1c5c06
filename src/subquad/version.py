"""The version of subquad (also ``subquad.__version__``)."""

__version__ = "0.1.0"
