"""quiverd test suite (a package, so tests/actors never shadows the actors package)."""
