"""Socket protocol v1, sans-IO: frame layouts, encoders and decoders (docs/protocol.md)."""
