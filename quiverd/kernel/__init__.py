"""The kernel every layer shares: CRC-32C, errors, crash-safe writes, bundles, config, logs,
the shard layout and quarantine. Imports nothing else of quiverd.
"""
