"""Built-in reference workloads: small models with synthetic data, so a trace can
be recorded and replayed on any machine without downloading anything."""
