"""The actors quiverd's daemon wires together; one module per actor."""
