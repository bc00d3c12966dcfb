"""quiverd: a durable Arrow buffer between producers and consumers."""

__version__ = "0.1.0"
