"""In-process actor tests: real memory streams and real files, no daemon subprocess."""
